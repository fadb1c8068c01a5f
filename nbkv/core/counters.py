"""The engine's fixed cost, counted: decode calls, rows computed, host time, bytes moved.

:class:`KVCounters` is kept by the llama.cpp context (:mod:`nbkv.llama.backend`): every
``llama_decode`` adds one call, its rows and the time spent inside llama.cpp; every state read
or write adds its bytes; every ``seq_cp`` one copy. The engine's parts wrap their host work in
:meth:`KVCounters.part` ("placement", "parking", "planning", "sampling", "lifecycle",
"rewrite", "shadow"): the part's wall time less what llama.cpp spent inside it (and less any
part nested in it) is its *host time*. Work done while no request is queued or running (a
park's copy made ahead, ``idle=True``) is host time too, but kept apart (``idle_host_s``):
no request waits for it. :class:`RequestCounts` is one request's share: the
decodes that carried its rows and the host time and bytes of its own admission and sampling.

Counts, never timings, are what tests assert; the bench reports the times.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PARTS = ("placement", "parking", "planning", "sampling", "lifecycle", "rewrite", "shadow")


@dataclass
class RequestCounts:
    """One request's share of the engine's work (mutable while the request runs)."""

    decode_calls: int = 0  # llama_decode calls that held rows of this request
    rows: int = 0  # rows of this request those calls computed (prompt, image and reply rows)
    prefill_calls: int = 0  # ... of the calls, those that read its prompt
    prefill_rows: int = 0  # ... and the rows they computed
    kv_bytes: int = 0  # state bytes moved between host RAM and the KV for it (reads + writes)
    host_s: dict[str, float] = field(default_factory=dict)  # host time by part

    def add_host(self, part: str, seconds: float) -> None:
        """Add ``seconds`` of host time to ``part``."""
        self.host_s[part] = self.host_s.get(part, 0.0) + seconds


@dataclass
class KVCounters:
    """What one llama.cpp context did since it was created (see the module's docstring)."""

    decode_calls: int = 0
    rows: int = 0  # rows computed by those calls (padding rows included)
    padded_rows: int = 0  # ... of which rows of the scratch sequence (fixed-shape decodes)
    llama_s: float = 0.0  # time spent inside llama_decode
    state_reads: int = 0
    state_writes: int = 0
    bytes_read: int = 0  # state bytes copied from the KV into host RAM
    bytes_written: int = 0  # ... and from host RAM into the KV
    copies: int = 0  # seq_cp calls: copies inside the KV, no host RAM
    host_s: dict[str, float] = field(default_factory=dict)  # host time by part
    idle_host_s: dict[str, float] = field(default_factory=dict)  # ... of idle-time work
    _stack: list[list[float]] = field(default_factory=list, repr=False)

    @property
    def bytes_moved(self) -> int:
        """State bytes moved between host RAM and the KV, both ways."""
        return self.bytes_read + self.bytes_written

    def decoded(self, rows: int, seconds: float, padded: int = 0) -> None:
        """One ``llama_decode`` of ``rows`` rows took ``seconds``."""
        self.decode_calls += 1
        self.rows += rows
        self.padded_rows += padded
        self.llama_s += seconds

    @contextmanager
    def part(self, name: str, into: RequestCounts | None = None,
             idle: bool = False) -> Iterator[None]:
        """Count the host time of the block as ``name`` (and into one request's ``into``).

        ``idle``: the block runs while no request is queued or running; its time goes to
        ``idle_host_s`` instead.
        """
        # [start, llama_s at start, time of the parts nested in this one]
        frame = [time.perf_counter(), self.llama_s, 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            wall = time.perf_counter() - frame[0]
            host = max(wall - (self.llama_s - frame[1]) - frame[2], 0.0)
            total = self.idle_host_s if idle else self.host_s
            total[name] = total.get(name, 0.0) + host
            if into is not None:
                into.add_host(name, host)
            if self._stack:
                self._stack[-1][2] += wall - (self.llama_s - frame[1])

    def snapshot(self) -> dict[str, Any]:
        """The counts as a plain dict (host times in seconds, by part)."""
        return {
            "decode_calls": self.decode_calls, "rows": self.rows,
            "padded_rows": self.padded_rows, "llama_s": self.llama_s,
            "state_reads": self.state_reads, "state_writes": self.state_writes,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "bytes_moved": self.bytes_moved, "copies": self.copies,
            "host_s": dict(self.host_s), "host_total_s": sum(self.host_s.values()),
            "idle_host_s": dict(self.idle_host_s),
        }
