"""A reusable ``llama_batch`` for tokens of several sequences (the text decodes' input)."""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp


class Batch:
    """A reusable ``llama_batch`` for tokens of several sequences."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._b = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n = 0

    def clear(self) -> None:
        """Empty the batch."""
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append a token; returns its index in the batch (for reading its logits)."""
        i = self.n
        if i >= self.capacity:
            raise OverflowError("batch full")
        b = self._b
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        self.n += 1
        return i

    def add_run(self, tokens: Sequence[int], start_pos: int, seq: int, logits_last: bool) -> int:
        """Append consecutive tokens of one sequence; returns the index of the last one."""
        last = len(tokens) - 1
        for j, t in enumerate(tokens):
            self.add(t, start_pos + j, seq, logits_last and j == last)
        return self.n - 1

    @property
    def raw(self) -> llama_cpp.llama_batch:
        """The ``llama_batch`` struct, with ``n_tokens`` set."""
        self._b.n_tokens = self.n
        return self._b

    def close(self) -> None:
        """Free the native arrays."""
        if self._b is not None:
            llama_cpp.llama_batch_free(self._b)
            self._b = None
