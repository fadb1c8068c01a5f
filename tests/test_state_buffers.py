"""State buffers reused by the next park: growing sizes, the bounds, memory given back."""

from __future__ import annotations

import ctypes
import mmap

from nbkv.llama.state_buffers import StateBuffers

PAGE = mmap.PAGESIZE


def _filled(bufs: StateBuffers, size: int) -> ctypes.Array:
    view = bufs.fresh(size)
    ctypes.memset(view, 0xFF, size)
    return view


def test_a_buffer_a_restore_frees_fits_the_next_larger_state():
    # a conversation grows: its next park needs more than the state restored before
    bufs = StateBuffers()
    view = _filled(bufs, 100 * PAGE)
    assert ctypes.sizeof(view) == 100 * PAGE  # exact size: the state's true length
    assert bufs.give(view, owners=1)
    del view
    grown = bufs.take(130 * PAGE)
    assert grown is not None and ctypes.sizeof(grown) == 130 * PAGE and bufs.reused == 1
    assert bufs.take(10 * PAGE) is None  # the free list is empty again


def test_a_buffer_still_referenced_elsewhere_is_not_taken_back():
    bufs = StateBuffers()
    view = _filled(bufs, 8 * PAGE)
    other = view  # a save in progress, say
    assert not bufs.give(view, owners=1)
    del other
    assert bufs.take(8 * PAGE) is None


def test_over_the_bound_the_smallest_free_buffers_leave_first():
    bufs = StateBuffers(keep=2)
    for n in (10, 20, 30):  # later states are larger
        view = _filled(bufs, n * PAGE)
        bufs.give(view, owners=1)
        del view
    assert bufs.take(50 * PAGE) is not None  # the newest, largest is kept (60 pages reserved)
    assert bufs.take(25 * PAGE) is not None  # ... and the one before it (40 pages)
    assert bufs.take(12 * PAGE) is None  # the smallest (20 pages) left


def test_a_smaller_state_in_a_reused_buffer_gives_back_what_a_larger_one_wrote():
    bufs = StateBuffers()
    view = _filled(bufs, 40 * PAGE)  # 80 pages reserved
    bufs.give(view, owners=1)
    del view
    grown = bufs.take(70 * PAGE)
    assert grown is not None
    ctypes.memset(grown, 0xFF, 70 * PAGE)
    bufs.give(grown, owners=1)
    del grown
    small = bufs.take(45 * PAGE)  # another conversation's, smaller
    assert small is not None
    # the pages past the new state were released: zero again when read, not held as RAM
    past = (ctypes.c_uint8 * (80 * PAGE)).from_address(ctypes.addressof(small))
    assert past[45 * PAGE - 1] == 0xFF and past[45 * PAGE] == 0 and past[70 * PAGE - 1] == 0
