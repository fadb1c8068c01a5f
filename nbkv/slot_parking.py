"""Parking a slot's conversation, and restoring a parked one into a slot (scheduler thread).

The engine side of :mod:`nbkv.parking`: what leaves a slot is its proven KV only (a reply
whose batched rewrite has not run is cut back to the settled prefix first: cheaper than
rewriting it, and what a returning request would keep anyway), with the message hashes and
boundaries that still lie inside it. A restore puts the whole state back (checkpoints too)
and checks that the memory holds exactly the parked positions; otherwise the slot is
emptied and the request rebuilds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from .parked import ParkedEntry
from .slot_kv import KVSnapshot, trim_valid

if TYPE_CHECKING:
    from .scheduler import EngineSlot, Scheduler

log = logging.getLogger("nbkv")


def park_slot(sched: Scheduler, slot: EngineSlot) -> str:
    """Park what ``slot`` holds and empty it; returns the tier ("ram", "disk") or ""."""
    lot, kv = sched.parking, slot.kv
    if lot is None or not (kv.tokens or slot.redo):
        return ""
    t0 = time.perf_counter()
    with sched.cv:
        if slot.redo or (sched.settings.exact and kv.needs_rewrite):
            slot.redo.clear()  # the rewrite is abandoned: park the proven prefix
            trim_valid(kv, list(kv.tokens), kv.settled, sched.res.rule)
    n = len(kv)
    if not n or not kv.verify():
        return ""
    k = sum(1 for e in slot.msg_ends if e <= n)
    segments = tuple(replace(s, end=min(s.end, n)) for s in slot.segments if s.start < n)
    info = lot.park(ParkedEntry.from_snapshot(
        kv.snapshot(), session=slot.session, hashes=slot.hashes[:k], msg_ends=slot.msg_ends[:k],
        segments=segments, last_request=slot.last_request, last_used=slot.last_used))
    log.debug("parked slot[%d] (%s): %d tokens to %s in %.1f ms", slot.index, slot.session, n,
              info.tier if info else "nowhere (over budget)", 1000 * (time.perf_counter() - t0))
    return info.tier if info is not None else ""


def restore_into(slot: EngineSlot, entry: ParkedEntry) -> int:
    """Put ``entry``'s state into ``slot``'s KV; returns the positions it now holds (0: failed)."""
    kv = slot.kv
    kv.put_back(KVSnapshot.of(entry.state, entry.tokens, entry.settled or 0,
                              entry.exact_len or 0, entry.checkpoints))
    if len(kv) != len(entry.tokens):
        log.warning("slot[%d]: the parked state of %s did not restore; rebuilding", slot.index,
                    entry.session)
        kv.clear()
        return 0
    return len(kv)
