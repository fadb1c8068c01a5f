"""Rewriting a reply's KV as a batched prefill (exact mode): in idle time, or while generated.

A reply is decoded one token per step, as plain llama.cpp does; a one-row decode rounds
slightly differently from a batched prefill, so a cached reply would not equal a fresh
prefill of it. Once the reply has streamed, its positions are trimmed and prefilled again in
canonical chunks, one chunk per idle iteration. A request that arrives meanwhile is admitted
between two chunks: it waits for one chunk at most (:data:`REWRITE_CHUNK`), keeps what is
rewritten and re-reads only the rest (``record.rewrite_absorbed``). When requests come back
to back the reply is rewritten while it is generated instead, in a shadow sequence
(:class:`Shadow`); what is left of it then waits a moment for the next request
(:meth:`Rewriter.grace`), and is finished in idle time if none comes.

The :class:`Rewriter` owns the idle work; the pending rewrite of each slot is its ``redo``
(the positions cut back and not yet prefilled again), changed through the table's locked
methods (:class:`nbkv.engine.slots.EngineTable`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nbkv.core.events import SlotRewritten
from nbkv.engine.slots import REPLY_TAIL, TO_REWRITE
from nbkv.kv import invariance
from nbkv.kv.slot_kv import SlotKV, trim_valid

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import EventBus
    from nbkv.engine.jobs import Job
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



SHADOW_CHUNK = 8  # rows per shadow chunk (rounded up to the rule's): at most this many are
# left to the next request when a reply ends; larger chunks cost hardly less per row


class Shadow:
    """The engine's shadow sequence, and the reply it is rewriting (one at a time).

    With no idle time between requests (an agent loop, a notebook's Run All) the next
    request would re-read the whole reply first; the shadow takes that work into the reply
    itself. Once the reply has a chunk's worth of rows, the generating slot's KV is copied
    into the shadow (``seq_cp``, queued by llama.cpp until the next decode) and cut back to
    the slot's settled prefix; from then on, each step that completes a chunk of block rows
    (:func:`nbkv.kv.invariance.block_chunk`) decodes it into the shadow right after the
    generation decode: a *mixed step*, proven bit for bit at load
    (:attr:`nbkv.kv.invariance.PrefillRule.mixed`). When the reply ends the shadow and the
    slot trade sequences (:meth:`nbkv.kv.slot_kv.SlotKV.swap`): the slot holds the canonical
    KV, and only the rows after the shadow's last chunk are left to rewrite.

    The chunk is its own ``llama_decode``: with one KV stream per sequence, llama.cpp gives
    every sequence of a micro-batch the same number of rows, so a chunk can never share one
    with a one-row decode. Its rows cost what prefill rows cost (on two CPU cores ~0.4 of a
    one-row decode each), so they slow the reply down: with ``rewrite="auto"`` (the default)
    the engine does it only when the previous reply had no idle time to be rewritten in.
    """

    def __init__(self, kv: SlotKV, res: Resources, settings: EngineSettings, table: EngineTable,
                 rewriter: Rewriter) -> None:
        self.kv = kv  # its tokens are its KV, as a slot's are
        self.res = res
        self.settings = settings
        self.table = table  # a finished reply's slot takes the shadow's KV (hand_over)
        self.rewriter = rewriter  # whether requests come back to back
        self.pace = rewriter.pace  # where each chunk's time per row is noted
        self.job: Job | None = None  # the generating request it follows
        self.start = 0  # the followed slot's settled prefix, where the shadow's rows begin
        self.rows = 0  # rows it has decoded since
        self.seconds = 0.0  # the time the shadow's copy and chunks took

    @property
    def busy(self) -> bool:
        """Following a reply."""
        return self.job is not None

    def chunk_cap(self) -> int:
        """Rows of a shadow chunk on this model (a block chunk: aligned, threshold rows)."""
        rule = self.res.rule
        cap = max(SHADOW_CHUNK, rule.min_chunk)
        return min(-(-cap // rule.align) * rule.align, self.res.batch.capacity)

    def step(self, generating: list[Job]) -> None:
        """After a generation decode: follow a reply if none yet, then decode one chunk."""
        if self.job is None:
            self.job = next((j for j in generating if self._wants(j)), None)
            if self.job is None:
                return
            if not self._attach():
                self.job = None
                return
        job = self.job
        if job.done.is_set() or job.slot is None:
            return
        units = job.slot.kv.tokens
        cap = self.chunk_cap()
        if len(units) - len(self.kv) < cap:  # not a whole chunk yet (the usual step)
            return
        take = invariance.block_chunk(units, len(self.kv), self.res.rule, cap)
        if take < cap:
            return
        toks = units[len(self.kv):len(self.kv) + take]
        batch = self.res.batch
        batch.clear()
        batch.add_run(toks, len(self.kv), self.kv.seq_id, False)
        t0 = time.perf_counter()
        try:
            self.res.ctx.decode(batch)
        except BaseException:  # noqa: BLE001 - the reply goes on; idle time rewrites it
            log.exception("shadow: a mixed-step chunk failed; the reply is rewritten later")
            self.drop()
            return
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.pace.note_rows(take, dt)
        end = len(self.kv) + take
        self.kv.extend(toks, settled=end)  # block rows: settled whatever the reply becomes
        self.rows += take

    def _wants(self, job: Job) -> bool:
        """Whether ``job``'s reply should be rewritten while it is generated."""
        cfg, rule = self.settings, self.res.rule
        if not (cfg.exactness.exact and cfg.slots.cache == "imc" and rule.exact and rule.mixed
                and not rule.single_row and cfg.exactness.rewrite != "idle"):
            return False
        if cfg.exactness.rewrite == "auto" and not self.rewriter.back_to_back:
            return False
        if job.done.is_set() or job.slot is None or not job.slot.kv.memory.can_trim:
            return False
        kv = job.slot.kv
        units = kv.tokens
        # the copy pays off once a first chunk is there (a reply shorter than that is left
        # to the idle rewrite, or the next request)
        cap = self.chunk_cap()
        if len(units) - kv.settled < cap:
            return False
        if not all(isinstance(u, int) for u in units[kv.settled:]):
            return False  # an image after the settled prefix
        return invariance.block_chunk(units, kv.settled, self.res.rule, cap) >= cap

    def _attach(self) -> bool:
        """Copy the followed slot's KV into the shadow, cut back to its settled prefix."""
        assert self.job is not None and self.job.slot is not None
        kv = self.job.slot.kv
        t0 = time.perf_counter()
        kept = self.kv.copy_from(kv, kv.settled)
        self.seconds = time.perf_counter() - t0
        self.start, self.rows = kept, 0
        if kept != kv.settled:  # the memory could not be cut there (a slid window)
            self.kv.clear()
            return False
        log.debug("shadow: following slot[%d] from %d", self.job.slot.index, kept)
        return True

    def hand_over(self, job: Job, ok: bool) -> int:
        """``job`` ended: give its slot the shadow's canonical KV; returns its reply rows.

        The slot's sequence and the shadow's are swapped (under the table's lock, so that
        snapshots see the tokens and the KV change together); the rows after the shadow's
        last chunk become the slot's pending rewrite. 0 if nothing was handed over (the
        reply's KV is then rewritten as before: in idle time, or by the next request).
        """
        if self.job is not job:
            return 0
        slot = job.slot
        try:
            if not ok or slot is None or self.rows == 0:
                return 0
            units = list(slot.kv.tokens)
            if self.kv.tokens != units[:len(self.kv)] or slot.kv.settled != self.start:
                log.warning("shadow: slot[%d] no longer holds the reply it followed",
                            slot.index)
                return 0
            # back to where the rest can be one canonical chunk (threshold rows or more)
            trim_valid(self.kv, units, len(self.kv), self.res.rule)
            mixed = len(self.kv) - self.start
            if mixed <= 0:
                return 0
            self.table.take_over(slot, self.kv, units, self.start, self.seconds, mixed)
            return mixed
        finally:
            self.drop()

    def drop(self) -> None:
        """Stop following; the shadow sequence is emptied."""
        self.job = None
        self.rows = 0
        self.seconds = 0.0
        self.kv.clear()
