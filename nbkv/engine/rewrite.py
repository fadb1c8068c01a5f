"""Rewriting a reply's KV as a batched prefill, in the scheduler's idle time (exact mode).

A reply is decoded one token per step, as plain llama.cpp does; a one-row decode rounds
slightly differently from a batched prefill, so a cached reply would not equal a fresh
prefill of it. Once the reply has streamed, its positions are trimmed and prefilled again in
canonical chunks, one chunk per idle iteration. A request that arrives meanwhile is admitted
between two chunks: it waits for one chunk at most (:data:`REWRITE_CHUNK`), keeps what is
rewritten and re-reads only the rest (``record.rewrite_absorbed``). When requests come back
to back the reply is rewritten while it is generated instead (:mod:`nbkv.engine.shadow`);
what is left of it then waits a moment for the next request (:meth:`Rewriter.grace`), and is
finished here if none comes.

The :class:`Rewriter` owns this work; the pending rewrite of each slot is its ``redo`` (the
positions cut back and not yet prefilled again), changed through the table's locked methods
(:class:`nbkv.engine.slots.EngineTable`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nbkv.core.events import SlotRewritten
from nbkv.engine.slots import REPLY_TAIL, TO_REWRITE
from nbkv.kv import invariance

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import EventBus
    from nbkv.engine.native import Resources
    from nbkv.engine.slots import EngineSlot, EngineTable

log = logging.getLogger("nbkv")

REWRITE_CHUNK = 16  # positions per idle-time rewrite step: what a new request may wait for
# (a prefill row costs about as much in chunks of 16 as of 64 on a CPU)
#: while requests come back to back, how long a finished reply's idle rewrite waits for the
#: next request (seconds): one that comes reads the rows itself, in its own prefill
GRACE_S = 0.25


class Pace:
    """How fast the engine prefills: the time a canonical prefill row takes.

    Prefill chunks (requests', rewrites', the shadow's) note their time per row; the
    :class:`Rewriter` compares a conversation's idle time with what rewriting its last reply
    took.
    """

    def __init__(self) -> None:
        self.row_s = 0.0  # seconds a canonical prefill row takes (recent chunks)

    def note_rows(self, rows: int, seconds: float) -> None:
        """A canonical chunk of ``rows`` took ``seconds``: keep the per-row estimate."""
        if rows >= 2 and seconds > 0:
            per = seconds / rows
            self.row_s = per if not self.row_s else 0.7 * self.row_s + 0.3 * per


class Rewriter:
    """Rewrites finished replies' KV as canonical prefills, one chunk at a time.

    It keeps the engine's pace: how fast rows prefill, and whether requests have been
    coming back to back (the shadow then rewrites replies while they are generated).
    """

    def __init__(self, res: Resources, settings: EngineSettings, table: EngineTable,
                 events: EventBus) -> None:
        self.res = res
        self.settings = settings
        self.table = table
        self.events = events
        self.pace = Pace()
        #: requests have been coming back to back: the last reply had no idle time to be
        #: rewritten in (rewrite="auto" then rewrites the next one while it is generated);
        #: what a fresh engine assumes (a notebook's Run All, an agent loop)
        self.back_to_back = True

    def continued(self, slot: EngineSlot, t_submit: float) -> None:
        """``slot``'s conversation continues with a request sent at ``t_submit``.

        Notes whether its last reply had idle time to be rewritten in.
        """
        self.back_to_back = t_submit - slot.t_replied < slot.reply_rows * self.pace.row_s

    def grace(self, slot: EngineSlot) -> float:
        """Seconds before ``slot``'s idle rewrite may start (0 or less: now).

        While requests come back to back (an agent loop, a notebook's Run All), the next one
        usually follows its reply at once. Its prefill then reads the reply's rows not yet
        rewritten with its own (``record.rewrite_absorbed``), which costs less than waiting
        for a rewrite chunk begun in the instant between the two. So the rewrite waits
        :data:`GRACE_S` after the reply ended, then runs as usual.
        """
        if not self.back_to_back:
            return 0.0
        return slot.t_replied + GRACE_S - time.perf_counter()

    def settling_slot(self) -> EngineSlot | None:
        """An idle slot whose KV still holds token-by-token decodes (exact mode, IMC).

        Only the Incremental Message Cache reuses a slot's reply; SPC and "off" rebuild it.
        """
        if not self.settings.exactness.exact or self.settings.slots.cache != "imc" or self.res.lean:
            return None
        for s in self.table:
            if s.phase in TO_REWRITE:
                return s
        return None


    def settle(self, slot: EngineSlot) -> None:
        """Rewrite one chunk of ``slot``'s token-by-token KV as a canonical prefill.

        The first call trims the slot back to where a canonical prefill may begin at or before
        its settled prefix (a checkpoint on hybrid and recurrent models); each call then
        prefills one chunk of what was trimmed.
        """
        kv = slot.kv
        rule = self.res.rule
        t0 = time.perf_counter()
        if not slot.redo:
            if not self.table.begin_rewrite(slot, rule):
                return  # back before an image: the next request rebuilds it
            slot.rewrite_s = 0.0
            slot.rewrite_n = len(slot.redo)
            slot.rewrite_mixed = 0
        units = kv.tokens + slot.redo
        # on checkpointed memory, checkpoints near the reply's end: a reply whose last word
        # re-tokenizes differently next turn still reuses the rest
        stops = (invariance.checkpoint_stops(units, (len(units) - REPLY_TAIL, len(units)), rule)
                 if kv.memory.checkpoints else ())
        batch = self.res.batch
        # the chunk cap leaves next_chunk room to give the last chunk threshold rows
        cap = min(max(REWRITE_CHUNK, 2 * rule.threshold + rule.align - 2), batch.capacity)
        take = invariance.next_chunk(units, len(kv), rule, cap, stops)
        toks = slot.redo[:take]
        batch.clear()
        batch.add_run(toks, len(kv), kv.seq_id, False)
        try:
            self.res.ctx.decode(batch)
        except BaseException:  # noqa: BLE001 - drop the tail; the next request prefills it
            log.exception("slot[%d]: rewriting a reply's KV failed", slot.index)
            self.table.drop_rewrite(slot)
            kv.resync()
            return
        end = len(kv) + take
        dt = time.perf_counter() - t0
        self.pace.note_rows(take, dt)
        self.table.rewrote(slot, toks, invariance.stable_end(units, end, rule))
        if end in stops and kv.settled == end:
            kv.checkpoint()
        slot.rewrite_s += time.perf_counter() - t0
        if not slot.redo:
            self.finished(slot)


    def finished(self, slot: EngineSlot) -> None:
        """``slot``'s reply is rewritten: say so (:class:`SlotRewritten`)."""
        self.events.publish(SlotRewritten(slot.index, slot.last_request, slot.rewrite_n,
                                           slot.rewrite_s, slot.rewrite_mixed))
        log.debug("slot[%d]: rewrote %d positions in %.0f ms (%d while generating)", slot.index,
                  slot.rewrite_n, slot.rewrite_s * 1000, slot.rewrite_mixed)


    def settle_all(self) -> None:
        """Rewrite every finished reply's KV now (scheduler thread)."""
        while (slot := self.settling_slot()) is not None:
            self.settle(slot)

    def settle_now(self) -> None:
        """:meth:`settle_all` because the caller gives the engine time now.

        As a user reading would: ``rewrite="auto"`` then leaves the next replies to idle time.
        """
        self.back_to_back = False
        for s in self.table:
            s.reply_rows = 0
        self.settle_all()
