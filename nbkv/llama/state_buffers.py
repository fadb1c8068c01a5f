"""Freed whole-state buffers of a context, reused by its next state read (parking speed).

Reading a sequence's state into a fresh buffer pays for the allocation and the first touch of
every page; a buffer that held a state before is already mapped. The engine hands back the
buffer of a state it restored (:meth:`nbkv.llama.backend.Context.recycle`), and the next park
reads into it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from typing import Any


class StateBuffers:
    """Freed whole-state buffers, reused by the next state read that fits (bounded).

    A buffer is lent as an exact-size ctypes view over a larger (or equal) base, so that
    ``ctypes.sizeof`` of a state is always its true length. At most ``keep`` buffers and
    ``max_bytes`` are held; a buffer is taken for a state needing at least half of it.
    """

    def __init__(self, keep: int = 4, max_bytes: int = 1 << 30) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self._free: list[Any] = []  # bases (ctypes byte arrays), smallest first
        self._lent: dict[int, Any] = {}  # id(view) -> its base, while the view is alive
        self._lock = threading.Lock()
        self.reused = 0  # states read into a recycled buffer

    def take(self, size: int) -> ctypes.Array | None:
        """An exact-size view of a free buffer of ``size`` to ``2 * size`` bytes, or None."""
        with self._lock:
            for i, base in enumerate(self._free):
                if size <= ctypes.sizeof(base) <= 2 * size:
                    del self._free[i]
                    break
            else:
                return None
            view = (ctypes.c_uint8 * size).from_buffer(base)
            self._lent[id(view)] = base
            self.reused += 1
        # forget the view's base once it is gone (ids are reused)
        weakref.finalize(view, self._forget, id(view), base)
        return view

    def _forget(self, key: int, base: Any) -> None:
        with self._lock:
            if self._lent.get(key) is base:
                del self._lent[key]

    def give(self, state: Any, owners: int) -> bool:
        """Keep ``state``'s memory for reuse if only the caller's ``owners`` references hold it."""
        if not isinstance(state, ctypes.Array):
            return False
        # references: the caller's, this function's parameter, getrefcount's argument
        if sys.getrefcount(state) > owners + 2:
            return False
        with self._lock:
            base = self._lent.pop(id(state), state)
        with self._lock:
            held = sum(ctypes.sizeof(b) for b in self._free)
            if len(self._free) >= self.keep or held + ctypes.sizeof(base) > self.max_bytes:
                return False
            self._free.append(base)
            self._free.sort(key=ctypes.sizeof)
        return True
