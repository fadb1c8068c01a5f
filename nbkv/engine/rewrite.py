"""Rewriting a reply's KV as a batched prefill, in the scheduler's idle time (exact mode).

A reply is decoded one token per step, as plain llama.cpp does; a one-row decode rounds
slightly differently from a batched prefill, so a cached reply would not equal a fresh
prefill of it. Once the reply has streamed, its positions are trimmed and prefilled again in
canonical chunks, one chunk per idle iteration. A request that arrives meanwhile is admitted
between two chunks: it waits for one chunk at most (:data:`REWRITE_CHUNK`), keeps what is
rewritten and re-reads only the rest (``record.rewrite_absorbed``). When requests come back
to back the reply is rewritten while it is generated instead (:mod:`nbkv.engine.shadow`);
what is left of it then is finished here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nbkv.core.events import SlotRewritten
from nbkv.engine.placement import REPLY_TAIL
from nbkv.kv import invariance
from nbkv.kv.slot_kv import trim_valid

if TYPE_CHECKING:
    from nbkv.engine.scheduler import EngineSlot, Scheduler

log = logging.getLogger("nbkv")

REWRITE_CHUNK = 16  # positions per idle-time rewrite step: what a new request may wait for
# (a prefill row costs about as much in chunks of 16 as of 64 on a CPU)


def settling_slot(sched: Scheduler) -> EngineSlot | None:
    """An idle slot whose KV still holds token-by-token decodes (exact mode, IMC).

    Only the Incremental Message Cache reuses a slot's reply; SPC and "off" rebuild it.
    """
    if not sched.settings.exact or sched.settings.cache != "imc":
        return None
    for s in sched.table:
        if not s.pending and (s.redo or s.kv.needs_rewrite):
            return s
    return None


def settle(sched: Scheduler, slot: EngineSlot) -> None:
    """Rewrite one chunk of ``slot``'s token-by-token KV as a canonical prefill.

    The first call trims the slot back to where a canonical prefill may begin at or before
    its settled prefix (a checkpoint on hybrid and recurrent models); each call then
    prefills one chunk of what was trimmed.
    """
    kv = slot.kv
    rule = sched.res.rule
    t0 = time.perf_counter()
    if not slot.redo:
        tokens = list(kv.tokens)
        with sched.cv:  # slots() sees the tokens and the KV change together
            kept = trim_valid(kv, tokens, kv.settled, rule)
            slot.redo = tokens[kept:]
            if not all(isinstance(t, int) for t in slot.redo):
                slot.redo = []  # back before an image: the next request rebuilds it
                return
        slot.rewrite_s = 0.0
        slot.rewrite_n = len(slot.redo)
        slot.rewrite_mixed = 0
    units = kv.tokens + slot.redo
    # on checkpointed memory, checkpoints near the reply's end: a reply whose last word
    # re-tokenizes differently next turn still reuses the rest
    stops = (invariance.checkpoint_stops(units, (len(units) - REPLY_TAIL, len(units)), rule)
             if kv.memory.checkpoints else ())
    batch = sched.res.batch
    # the chunk cap leaves next_chunk room to give the last chunk threshold rows
    cap = min(max(REWRITE_CHUNK, 2 * rule.threshold + rule.align - 2), batch.capacity)
    take = invariance.next_chunk(units, len(kv), rule, cap, stops)
    toks = slot.redo[:take]
    batch.clear()
    batch.add_run(toks, len(kv), kv.seq_id, False)
    try:
        sched.res.ctx.decode(batch)
    except BaseException:  # noqa: BLE001 - drop the tail; the next request prefills it
        log.exception("slot[%d]: rewriting a reply's KV failed", slot.index)
        slot.redo.clear()
        kv.resync()
        return
    end = len(kv) + take
    dt = time.perf_counter() - t0
    sched.note_rows(take, dt)
    with sched.cv:
        kv.extend(toks, settled=invariance.stable_end(units, end, rule))
        del slot.redo[:take]
    if end in stops and kv.settled == end:
        kv.checkpoint()
    slot.rewrite_s += time.perf_counter() - t0
    if not slot.redo:
        finished(sched, slot)


def finished(sched: Scheduler, slot: EngineSlot) -> None:
    """``slot``'s reply is rewritten: say so (:class:`SlotRewritten`)."""
    sched.events.publish(SlotRewritten(slot.index, slot.last_request, slot.rewrite_n,
                                       slot.rewrite_s, slot.rewrite_mixed))
    log.debug("slot[%d]: rewrote %d positions in %.0f ms (%d while generating)", slot.index,
              slot.rewrite_n, slot.rewrite_s * 1000, slot.rewrite_mixed)


def settle_all(sched: Scheduler) -> None:
    """Rewrite every finished reply's KV now (scheduler thread)."""
    while (slot := settling_slot(sched)) is not None:
        settle(sched, slot)
