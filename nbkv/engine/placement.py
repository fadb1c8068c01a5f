"""Admitting a request: pick its slot, make the slot hold exactly the reusable prefix.

Runs on the scheduler thread. The slot table's policy chooses (:mod:`nbkv.kv.slot_table`,
through :mod:`nbkv.kv.policy`); :func:`nbkv.kv.admission.admit` turns the choice into an
:class:`~nbkv.kv.admission.Admission` (the source, the ordered KV steps, the length kept);
the :class:`~nbkv.engine.admit.Executor` applies its steps to the slot's KV; the request's
record is built from the admission and the executor's outcome.

llama.cpp runs the data part of a copy at the next decode
(:meth:`nbkv.llama.backend.Context.seq_cp`), so across the requests admitted in one scheduler
pass a slot with a copy queued from or into it takes no state write until then: a request
whose plan would restore a state into it waits for the next pass, one decode step later
(:meth:`Placer.must_wait`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nbkv.core.events import RequestStarted, Segment
from nbkv.engine import replay
from nbkv.engine.admit import Executor, Outcome, record
from nbkv.engine.slots import REPLY_TAIL
from nbkv.kv import admission, invariance, policy, reasons
from nbkv.kv.reach import Judge, restorable, restore_point
from nbkv.kv.segments import prompt_segments
from nbkv.kv.slot_kv import SWA
from nbkv.llama.sampling import Sampler

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import EventBus
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.replay import Replays
    from nbkv.engine.rewrite import Rewriter
    from nbkv.engine.slot_parking import Parker
    from nbkv.engine.slots import EngineSlot, EngineTable
    from nbkv.kv.invariance import PrefillRule
    from nbkv.kv.slot_kv import MemoryInfo, SlotKV
    from nbkv.kv.slot_table import SlotInfo
    from nbkv.kv.spc import SystemPromptStore
    from nbkv.prompt.builder import Prompt
    from nbkv.store.parked import ParkedEntry
    from nbkv.store.parking import ParkingLot

log = logging.getLogger("nbkv")

CHECKPOINT_INTERVAL = 64  # hybrid/recurrent: a checkpoint at least this often in a prompt


class Placer:
    """Admits requests into slots: the slot table's plan carried out on the KV.

    Runs on the scheduler thread. Given the engine's resources, serve settings, slot
    table, system prompt store (SPC), parking lot (None: parking off), event bus, the
    :class:`~nbkv.engine.rewrite.Rewriter` (it keeps the engine's pace), the
    :class:`~nbkv.engine.slot_parking.Parker` (a displaced conversation is parked, a parked
    one restored) and the
    :class:`~nbkv.engine.replay.Replays` (a re-run answered from the cache).
    """

    def __init__(self, res: Resources, settings: EngineSettings, table: EngineTable,
                 spc: SystemPromptStore, parking: ParkingLot | None, events: EventBus,
                 rewriter: Rewriter, parker: Parker, replays: Replays) -> None:
        self.res = res
        self.settings = settings
        self.table = table
        self.spc = spc
        self.parking = parking
        self.events = events
        self.rewriter = rewriter
        self.parker = parker
        self.replays = replays
        self.executor = Executor(res, settings, table, spc, parking, parker, replays)

    def start(self, job: Job) -> bool:
        """Pick a slot and prepare its KV; False when no slot is free yet."""
        chosen = self._choose(job)
        if chosen is None:
            return False
        snaps, plan, entry, taken, unpark_s, t0 = chosen
        table, cfg = self.table, self.settings
        slot = table[plan.slot]
        donor = table[plan.donor] if plan.donor is not None else None
        if donor is None and entry is None and slot.session == job.session and slot.reply_rows:
            # this conversation continues: did its last reply have idle time to be rewritten in?
            self.rewriter.continued(slot, job.t_submit)
        adm = admission.admit(plan, holder(slot), holder(donor) if donor is not None else None,
                              job.session, job.prompt.tokens, self.res.rule, cache=cfg.slots.cache,
                              exact=cfg.exactness.exact and not self.res.lean, taken=taken)
        out = self.executor.run(adm, job, slot, donor, entry, unpark_s, t0)
        why = self._reason(job, adm, out, snaps, slot, entry)
        kept = None
        if out.memo is not None:  # the slot's messages stay: its own, or those of the parked entry
            kept = (entry.hashes, entry.msg_ends) if entry is not None else (slot.hashes,
                                                                             slot.msg_ends)
            if entry is not None:
                table.show(slot, entry.segments)
        table.claim(slot, job.id, job.session, job.prompt, out.reuse,
                    adm.held_by if out.parked_to is not None else plan.evicted,
                    parked=out.parked_to is not None, keep=kept)
        job.place(slot, out.reuse, out.memo, out.held_after)
        self._prepare(job, slot)
        job.record = record(job, adm, out, slot, why, self.segments(job, len(job.prompt.tokens)),
                            exact=cfg.exactness.exact and self.res.rule.exact, path=self.res.path)
        log.debug("%s: slot[%d] prompt=%d reused=%d prefill=%d", job.record.strategy, slot.index,
                  len(job.prompt.tokens), out.reuse, len(job.todo))
        self.events.publish(RequestStarted(job.record))
        return True

    def _choose(self, job: Job) -> tuple[tuple[SlotInfo, ...], policy.Plan,
                                         ParkedEntry | None, bool, float, float] | None:
        """The policy's plan for ``job``, with the parked entry it restores taken or borrowed.

        None when no slot is free, or the plan must wait for a queued copy. A parked entry
        that cannot be read is logged and skipped: the policy chooses again without it.
        Also returns whether the entry was taken (else borrowed), the time taking it took,
        and when the chosen plan's KV work began.
        """
        p, cfg, rule, mem = job.prompt, self.settings, self.res.rule, self.res.memory
        snaps = self.table.snapshots()
        lot = self.parking if cfg.slots.cache == "imc" else None
        parked = list(lot.entries()) if lot is not None else []
        exact = cfg.exactness.exact and not self.res.lean
        judge = Judge(p.tokens, rule, exact, mem.kind, mem.n_swa)
        unpark_s = 0.0  # the restore proper: taking a parked entry, putting its state back
        while True:
            plan = self.table.place(snaps, p, job.session, cache=cfg.slots.cache,
                                    min_tokens=cfg.slots.cache_min_tokens, parked=parked,
                                    judge=judge)
            if plan is None or self.must_wait(plan):
                return None
            t0 = time.perf_counter()
            info = next((i for i in parked if i.key == plan.parked), None)
            # its own session takes an entry back; any other conversation restores a copy
            taken = info is not None and policy.takes_parked(info, job.session, p.tokens)
            entry = None
            if info is not None and lot is not None:
                t_take = time.perf_counter()
                entry = lot.take(info.key) if taken else lot.borrow(info.key)
                unpark_s += time.perf_counter() - t_take
            if plan.parked is None or entry is not None:
                return snaps, plan, entry, taken, unpark_s, t0
            parked = [i for i in parked if i.key != plan.parked]  # unreadable: logged, skipped

    def _reason(self, job: Job, adm: admission.Admission, out: Outcome,
                snaps: tuple[SlotInfo, ...], slot: EngineSlot, entry: ParkedEntry | None
                ) -> reasons.Reason:
        """Why ``job`` kept what it kept: its admission's decision, in words.

        Decided from the admission and the outcome (:func:`nbkv.kv.admission.decide`); the
        comparison is kept for ``explain``.
        """
        p, table, lot, reuse = job.prompt, self.table, self.parking, out.reuse
        if out.memo is not None:
            table.compare(job.id, slot.kv.tokens, p.tokens)
            return replay.reason(out.memo)
        donor = adm.plan.donor if reuse else None  # a copy that kept nothing is not one
        still_parked = job.session is not None and lot is not None and (
            lot.find(job.session) is not None or (entry is not None and adm.taken))
        return table.reason(
            job.id, p, job.session, table.own(snaps, job.session),
            table[donor].tokens if donor is not None else (), reuse=reuse, wanted=out.planned,
            donor_session=(adm.donor_session or f"slot {donor}") if donor is not None else None,
            can_trim=out.checkpoint_pos is None, cache=adm.cache,
            restored=out.restored if reuse else None, kept_from=adm.held_by,
            still_parked=still_parked)

    def _prepare(self, job: Job, slot: EngineSlot) -> None:
        """``job``'s checkpoint stops (memory that cannot be cut) and its sampler."""
        p, mem = job.prompt, self.res.memory
        if mem.takes_checkpoints:
            job.stops = plan_checkpoints(slot.kv, mem, self.res.rule, p, job.reuse)
        # the prompt's tokens, for a repeat penalty only (the one reader of a sampler's history)
        history = ([t for t in p.tokens if isinstance(t, int)]
                   if job.params.repeat_penalty != 1.0 else ())
        job.sampler = Sampler(job.params, self.res.model.n_vocab, history)

    def must_wait(self, plan: policy.Plan) -> bool:
        """``plan`` would write a state into a slot that a queued copy still reads or fills.

        A restore of a parked conversation, a system prompt's state (SPC) or a checkpoint (on
        memory that cannot be cut) into the slot; the request waits for the next pass.
        """
        kv = self.table[plan.slot].kv
        return kv.copy_queued and (plan.parked is not None or self.settings.slots.cache == "spc"
                                   or self.res.memory.checkpoints)

    def segments(self, job: Job, n: int) -> tuple[Segment, ...]:
        """KV map of ``job``'s slot: message spans split by reused / prefilled / generated."""
        proj = self.res.projector
        return prompt_segments(job.prompt, job.reuse, n, job.text.text,
                               proj.marker if proj is not None else "\0")


def checkpoint_wanted(every_cut: bool, ends: list[int], n: int) -> tuple[int, ...]:
    """Where a prompt of ``n`` positions with messages ending at ``ends`` wants checkpoints.

    At message boundaries (an edit goes back to the one before it), a few positions before
    the prompt's end (a reply whose start merges with the template's last token) and at the
    end. Where every cut needs one (``every_cut``: hybrid and recurrent memory), also every
    :data:`CHECKPOINT_INTERVAL` positions, what a template drift inside a long message can
    still salvage; sliding-window memory cuts anywhere while live and needs them only once
    its state was put back whole (parked, saved), and each costs a whole window there.
    Each is then moved to where a canonical chunk can end
    (:func:`nbkv.kv.invariance.checkpoint_stops`).
    """
    every = range(CHECKPOINT_INTERVAL, n, CHECKPOINT_INTERVAL) if every_cut else ()
    return (*ends, *every, n - REPLY_TAIL, n)


def plan_checkpoints(kv: SlotKV, mem: MemoryInfo, rule: PrefillRule, p: Prompt, reuse: int
                     ) -> tuple[int, ...]:
    """Where the prefill of ``p`` (from ``reuse``) stops to take checkpoints.

    The stops of :func:`checkpoint_wanted`; on sliding-window memory, where a window put
    back continues exactly. Those at ``p``'s message boundaries are pinned in ``kv``'s
    checkpoints (:meth:`nbkv.kv.slot_kv.CheckpointSet.pin`): a return to an earlier message
    resumes there, so they outlive the newest ones.
    """
    near = checkpoint_wanted(mem.checkpoints, p.ends, len(p.tokens))
    if mem.kind == SWA:  # where a window put back continues exactly
        near = tuple(restore_point(p.tokens, w, rule, mem.kind, mem.n_swa) for w in near)
    kv.checkpoints.pin(invariance.checkpoint_stops(p.tokens, near[:len(p.ends)], rule))
    return tuple(e for e in invariance.checkpoint_stops(p.tokens, near, rule)
                 if e > reuse and restorable(mem.kind, mem.n_swa, e))


def holder(slot: EngineSlot) -> admission.Holder:
    """What :func:`nbkv.kv.admission.admit` reads of a slot: its conversation and its KV's state."""
    kv = slot.kv
    return admission.Holder(tuple(kv.tokens), slot.session, tuple(slot.msg_ends), len(slot.redo),
                            kv.settled, kv.exact_len)
