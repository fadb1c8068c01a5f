"""An engine's caches as plain data: what a save writes and a restore (or a park) brings back.

:func:`export_state` and :func:`import_state` run on the scheduler thread (through
``Engine.export_state`` / ``Engine.import_state``); :mod:`nbkv.store.persist` uses only them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from nbkv.core.errors import EngineBusy, NbkvError, RestoreError
from nbkv.engine.recompute import Recomputation
from nbkv.engine.recompute import recompute as recompute_slot
from nbkv.engine.slots import SlotPhase
from nbkv.kv.slot_kv import SWA, KVSnapshot
from nbkv.kv.slot_table import EngineState, SlotState
from nbkv.kv.spc import SavedPrompt
from nbkv.store.parked import ParkedEntry

if TYPE_CHECKING:
    from nbkv.engine.core import EngineCore
    from nbkv.engine.slots import EngineSlot

log = logging.getLogger("nbkv")


def export_state(core: EngineCore, only_if_idle: bool = False) -> EngineState:
    """Copy every idle slot's state and bookkeeping (only proven KV: rewrites run first)."""
    if only_if_idle and core.busy():
        raise EngineBusy("the engine is busy")
    core.rewriter.settle_all()
    slots, busy = [], []
    for s in core.table:
        if s.phase in (SlotPhase.SERVING, SlotPhase.REWRITING):
            busy.append(s.index)
            continue
        if not s.tokens:
            continue
        if not s.kv.verify():
            log.warning("slot[%d]: KV does not match its tokens; not saved", s.index)
            continue
        snap = s.kv.snapshot()
        if core.proof is not None and core.proof.pending():  # grouped by an unproven rule:
            snap = replace(snap, settled=0, exact_len=0)  # ... recomputed before any reuse
        slots.append(core.table.state_of(s, snap))
    return EngineState(tuple(slots), tuple(busy), tuple(core.spc.items()))


def import_state(core: EngineCore, placed: Sequence[tuple[int, SlotState]],
                 spc: Sequence[tuple[str, SavedPrompt]], recompute: bool = False
                 ) -> list[Recomputation]:
    """Replace every slot's content: ``placed`` gives each state its slot; all or nothing.

    States go in oldest first, so that the LRU clock orders them as they were. What the
    slots held before is parked (with a parking lot). On any failure every slot is put back
    as it was and :class:`RestoreError` says why.
    ``recompute`` (an untrusted save): each placed slot's KV is then replaced by a full
    prefill of its tokens, in the same scheduler call, so no request sees the saved KV.
    """
    if core.active or any(s.pending for s in core.table):
        raise RestoreError("the engine is serving requests: restore when it is idle")
    core.rewriter.settle_all()  # what is parked below is proven KV
    if core.parking is not None:
        for s in core.table:  # cut where a parked state goes back exactly (cut_for_park)
            if s.tokens:
                core.parker.cut_for_park(s)
    backup = [(s, s.kv.snapshot() if s.tokens else None, core.table.state_of(s, None))
              for s in core.table]
    try:
        for s in core.table:
            core.table.reset(s)
        for i, state in sorted(placed, key=lambda p: p[1].last_used):
            slot = core.table[i]
            saved = state.kv
            if saved is None:
                raise RestoreError(f"slot {i}: the saved state holds no KV")
            slot.kv.put_back(saved)
            held = len(slot.kv)
            if held != len(saved.tokens) and not (slot.kv.memory.kind == SWA
                                                  and held < len(saved.tokens)):
                raise RestoreError(f"slot {i}: the restored KV does not hold the saved "
                                   f"{len(saved.tokens)} positions")
            if held:  # a sliding-window state may go back to a checkpoint (SlotKV.put_back)
                core.table.adopt(slot, held_state(state, held))
    except BaseException as e:
        for s, snap, state in backup:
            _roll_back(core, s, snap, state)
        if isinstance(e, RestoreError):
            raise
        raise RestoreError(f"llama.cpp refused a saved state ({e}); the engine is unchanged"
                           ) from e
    core.spc.clear()
    for key, entry in spc:
        core.spc.put(key, entry.state, entry.tokens)
    if core.parking is not None:  # what the slots held is parked, not lost
        # a session the restore put back in a slot goes on from its saved conversation: the
        # one it had since (parked, or in a slot the restore displaced) stays as an unnamed
        # branch (as an edit's old branch does), so that neither supersedes the other in
        # the lot (by its later use, the newer one would have: the restored one, parked
        # next, was not kept, without a word)
        restored = {state.session for _, state in placed if state.session is not None}
        lot = core.parking
        for name in restored:
            info = lot.find(name)
            since = lot.take(info.key) if info is not None else None
            if since is not None:
                since.conversation = replace(since.conversation, session=None)
                lot.park(since)
        for _, snap, state in backup:
            if snap is not None:
                part = held_state(state, len(snap.tokens))  # the messages it still holds
                who = None if part.session in restored else part.session
                core.parking.park(ParkedEntry.from_snapshot(
                    snap, session=who, hashes=part.hashes,
                    msg_ends=part.msg_ends, segments=part.segments,
                    last_request=part.last_request, last_used=part.last_used,
                    used_at=part.used_at))
    return [recompute_slot(core, i) for i, _ in placed] if recompute else []


def _roll_back(core: EngineCore, s: EngineSlot, snap: KVSnapshot | None,
               state: SlotState) -> None:
    core.table.reset(s)
    if snap is None:
        return
    try:
        s.kv.put_back(snap)
    except NbkvError:
        log.exception("slot[%d]: could not put its state back after a failed restore", s.index)
        return
    if s.kv.tokens:
        core.table.put_back(s, held_state(state, len(s.kv)))


def held_state(state: SlotState, n: int) -> SlotState:
    """``state``'s bookkeeping for its first ``n`` positions (the messages that end there)."""
    return replace(state, conversation=state.conversation.cut(n))
