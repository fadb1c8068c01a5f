"""Rewriting a reply while it is generated: mixed steps (exact mode, IMC).

A reply is decoded one row per step, as plain llama.cpp does, and a one-row decode rounds
differently from a batched prefill: before a cached request may serve the reply's KV, it is
computed again as a canonical prefill (:mod:`nbkv.engine.rewrite`). With idle time between
requests that costs nothing anyone waits for. With none (an agent loop, a notebook's Run
All) the next request re-reads the whole reply first.

A *shadow* sequence takes that work into the reply itself. Once the reply has a chunk's
worth of rows, the generating slot's KV is copied into the shadow (``seq_cp``, queued by
llama.cpp until the next decode) and cut back to the slot's settled prefix; from then on,
each step that completes a chunk of block rows (:func:`nbkv.kv.invariance.block_chunk`)
decodes it into the shadow right after the generation decode: a *mixed step*, proven bit
for bit at load (:attr:`nbkv.kv.invariance.PrefillRule.mixed`). When the reply ends the
shadow and the slot trade sequences (:meth:`nbkv.kv.slot_kv.SlotKV.swap`): the slot holds the
canonical KV, and only the rows after the shadow's last chunk are left to rewrite.

The chunk is its own ``llama_decode``: with one KV stream per sequence, llama.cpp gives every
sequence of a micro-batch the same number of rows, so a chunk can never share one with a
one-row decode. Its rows cost what prefill rows cost (on two CPU cores ~0.4 of a one-row
decode each), so they slow the reply down: with ``rewrite="auto"`` (the default) the engine
does it only when the previous reply had no idle time to be rewritten in.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nbkv.core.config import REWRITE_MODES  # Engine(rewrite=...)
from nbkv.kv import invariance
from nbkv.kv.slot_kv import SlotKV, trim_valid

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.rewrite import Rewriter
    from nbkv.engine.slots import EngineTable

log = logging.getLogger("nbkv")
__all__ = ["REWRITE_MODES", "SHADOW_CHUNK", "Shadow"]

SHADOW_CHUNK = 8  # rows per shadow chunk (rounded up to the rule's): at most this many are
# left to the next request when a reply ends; larger chunks cost hardly less per row


class Shadow:
    """The engine's shadow sequence, and the reply it is rewriting (one at a time)."""

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
