"""Freed whole-state buffers of a context, reused by its next state read (parking speed).

Reading a sequence's state into a fresh buffer pays for the allocation and the first touch of
every page; a buffer that held a state before is already mapped. The engine hands back the
buffer of a state it restored (:meth:`nbkv.llama.backend.Context.recycle`), and the next park
reads into it.

Conversations grow: the buffer a restore frees held the state of an earlier turn, smaller than
the next one parked. A fresh buffer therefore reserves address space beyond its state
(:data:`RESERVE`): an anonymous mapping whose pages take memory only once written, so the
reserve costs no RAM until a later, larger state is read into it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

#: a fresh buffer reserves address space for a state this many times its own size
RESERVE = 2


# a private mapping (a shared one keeps released pages); Windows' anonymous maps are private
_PRIVATE = ({"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE")
            else {})
_RELEASE = getattr(mmap, "MADV_DONTNEED", None)  # None: nothing to release pages with


def _pages(n: int) -> int:
    """``n`` rounded up to whole pages."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass(eq=False)
class _Buffer:
    """A base buffer: its mapping (None: plain memory) and the bytes of it written so far."""

    base: Any  # a ctypes byte array
    mapping: mmap.mmap | None
    touched: int


class StateBuffers:
    """Freed whole-state buffers, reused by the next state read that fits (bounded).

    A buffer is lent as an exact-size ctypes view over a larger (or equal) base, so that
    ``ctypes.sizeof`` of a state is always its true length. A fresh one (:meth:`fresh`)
    reserves :data:`RESERVE` times its state's size of address space, so that it fits the
    conversation's later, larger states. A buffer is taken for a state needing at least
    half of it; memory a larger earlier state had written beyond the new one is released,
    so that a state holds no more RAM than its size. At most ``keep`` buffers and
    ``max_bytes`` of written memory are held free, the largest kept.
    """

    def __init__(self, keep: int = 4, max_bytes: int = 1 << 30) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self._free: list[_Buffer] = []  # smallest first
        self._lent: dict[int, _Buffer] = {}  # id(view) -> its buffer, while the view is alive
        self._lock = threading.Lock()
        self.reused = 0  # states read into a recycled buffer

    def take(self, size: int) -> ctypes.Array | None:
        """An exact-size view of a free buffer of ``size`` to ``2 * size`` bytes, or None."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if size <= ctypes.sizeof(buf.base) <= _pages(2 * size):
                    del self._free[i]
                    break
            else:
                return None
            self.reused += 1
        if buf.mapping is not None and buf.touched > _pages(size) and _RELEASE is not None:
            # an earlier, larger state wrote past this one: give those pages back
            buf.mapping.madvise(_RELEASE, _pages(size), buf.touched - _pages(size))
        buf.touched = size
        return self._lend(buf, size)

    def fresh(self, size: int) -> ctypes.Array:
        """A new exact-size buffer whose base reserves :data:`RESERVE` times ``size``.

        An anonymous private mapping: its pages take memory only once written (zeroed at the
        first write), so the reserve costs address space, not RAM.
        """
        cap = _pages(max(RESERVE * size, 1))
        mapping = mmap.mmap(-1, cap, **_PRIVATE)
        base = (ctypes.c_uint8 * cap).from_buffer(mapping)
        return self._lend(_Buffer(base, mapping, size), size)

    def _lend(self, buf: _Buffer, size: int) -> ctypes.Array:
        view = (ctypes.c_uint8 * size).from_buffer(buf.base)
        with self._lock:
            self._lent[id(view)] = buf
        # forget the view's buffer once it is gone (ids are reused)
        weakref.finalize(view, self._forget, id(view), buf)
        return view

    def _forget(self, key: int, buf: _Buffer) -> None:
        with self._lock:
            if self._lent.get(key) is buf:
                del self._lent[key]

    def give(self, state: Any, owners: int) -> bool:
        """Keep ``state``'s memory for reuse if only the caller's ``owners`` references hold it."""
        if not isinstance(state, ctypes.Array):
            return False
        # references: the caller's, this function's parameter, getrefcount's argument
        if sys.getrefcount(state) > owners + 2:
            return False
        with self._lock:
            buf = self._lent.pop(id(state), None) or _Buffer(state, None, ctypes.sizeof(state))
            self._free.append(buf)
            self._free.sort(key=lambda b: ctypes.sizeof(b.base))
            # over the bounds: the smallest leave first (a conversation's states only grow)
            while self._free and (len(self._free) > self.keep
                                  or sum(b.touched for b in self._free) > self.max_bytes):
                del self._free[0]
            return buf in self._free
