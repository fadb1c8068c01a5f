"""A reusable ``llama_batch`` for tokens of several sequences (the text decodes' input)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp

_I32 = ctypes.c_int32
_P32 = ctypes.POINTER(_I32)


class Batch:
    """A reusable ``llama_batch`` for tokens of several sequences.

    Its arrays are owned here (one sequence a token): a run of a sequence's tokens is
    written with slice assignments, in C, instead of a Python step a token.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.n = 0
        self._token = (_I32 * capacity)()
        self._pos = (_I32 * capacity)()
        self._n_seq = (_I32 * capacity)(*([1] * capacity))
        self._seq = (_I32 * capacity)()
        base = ctypes.addressof(self._seq)
        self._seq_ptrs = (_P32 * capacity)(
            *[ctypes.cast(base + ctypes.sizeof(_I32) * i, _P32) for i in range(capacity)])
        self._logits = (ctypes.c_int8 * capacity)()
        self._b: llama_cpp.llama_batch | None = llama_cpp.llama_batch(
            0, ctypes.cast(self._token, _P32), None, ctypes.cast(self._pos, _P32),
            ctypes.cast(self._n_seq, _P32), ctypes.cast(self._seq_ptrs, ctypes.POINTER(_P32)),
            ctypes.cast(self._logits, ctypes.POINTER(ctypes.c_int8)))

    def clear(self) -> None:
        """Empty the batch."""
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append a token; returns its index in the batch (for reading its logits)."""
        i = self.n
        if i >= self.capacity:
            raise OverflowError("batch full")
        self._token[i] = token
        self._pos[i] = pos
        self._seq[i] = seq
        self._logits[i] = logits
        self.n = i + 1
        return i

    def add_run(self, tokens: Sequence[int], start_pos: int, seq: int, logits_last: bool) -> int:
        """Append consecutive tokens of one sequence; returns the index of the last one."""
        n, k = self.n, len(tokens)
        end = n + k
        if end > self.capacity:
            raise OverflowError("batch full")
        # ctypes takes any sequence of the slice's length (its stubs say a list)
        self._token[n:end] = tokens  # type: ignore[call-overload]
        self._pos[n:end] = range(start_pos, start_pos + k)  # type: ignore[call-overload]
        self._seq[n:end] = (seq,) * k  # type: ignore[call-overload]
        self._logits[n:end] = bytes(k)  # type: ignore[call-overload]
        if logits_last and k:
            self._logits[end - 1] = 1
        self.n = end
        return end - 1

    @property
    def raw(self) -> llama_cpp.llama_batch:
        """The ``llama_batch`` struct, with ``n_tokens`` set."""
        b = self._b
        if b is None:
            raise RuntimeError("this batch is closed")
        b.n_tokens = self.n
        return b

    def close(self) -> None:
        """Drop the struct (its arrays are Python's: nothing native to free)."""
        self._b = None
