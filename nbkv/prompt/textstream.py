"""Turn generated token bytes into text deltas: split UTF-8 sequences and stop strings."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    """Accumulates token pieces (bytes) and releases text that is safe to show.

    A multi-byte character split across tokens is held until complete. Text that could be
    the start of a stop string is held until it is clear that it is not one; when a stop
    string appears, the text before it is released and :attr:`stopped` becomes true.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""
        self.text = ""  # everything released so far
        self.stopped: str | None = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the newly releasable text (maybe empty)."""
        if self.stopped is not None:
            return ""
        if not self._stop:  # nothing to hold back but a split character (the decoder's)
            out = self._decoder.decode(piece)
            self.text += out
            return out
        self._held += self._decoder.decode(piece)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: release whatever is held (incomplete UTF-8 becomes U+FFFD)."""
        if self.stopped is None:
            self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        cut = len(held)
        for s in self._stop:
            i = held.find(s)
            if i != -1 and i < cut:
                cut = i
                self.stopped = s
        if self.stopped is not None:
            out, self._held = held[:cut], ""
        elif final:
            out, self._held = held, ""
        else:
            keep = 0  # longest tail of `held` that is a proper prefix of some stop string
            for s in self._stop:
                for n in range(min(len(s) - 1, len(held)), keep, -1):
                    if held.endswith(s[:n]):
                        keep = n
                        break
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += out
        return out
