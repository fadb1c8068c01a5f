"""Admitting a request: pick its slot, make the slot hold exactly the reusable prefix.

Runs on the scheduler thread. The slot table's policy chooses (:mod:`nbkv.kv.slot_table`,
through :mod:`nbkv.kv.policy`); :func:`nbkv.kv.admission.admit` turns the choice into an
:class:`~nbkv.kv.admission.Admission` (the source, the ordered KV steps, the length kept);
the :class:`Executor` applies its steps to the slot's KV; the request's record is built from
the admission and the executor's outcome (:func:`record`).

llama.cpp runs the data part of a copy at the next decode
(:meth:`nbkv.llama.backend.Context.seq_cp`), so across the requests admitted in one scheduler
pass a slot with a copy queued from or into it takes no state write until then: a request
whose plan would restore a state into it waits for the next pass, one decode step later
(:meth:`Placer.must_wait`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbkv.core.events import RequestRecord, RequestStarted, Segment
from nbkv.engine.decoder import replay_reason
from nbkv.engine.slots import REPLY_TAIL
from nbkv.kv import admission, invariance, policy
from nbkv.kv.policy import Judge, restorable, restore_point
from nbkv.kv.slot_kv import SWA, trim_valid
from nbkv.kv.slot_table import prompt_segments
from nbkv.llama.tokens import Sampler
from nbkv.media.units import MediaUnit

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import EventBus
    from nbkv.engine.decoder import Replays
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.rewrite import Rewriter
    from nbkv.engine.slot_parking import Parker
    from nbkv.engine.slots import EngineSlot, EngineTable
    from nbkv.kv.invariance import PrefillRule
    from nbkv.kv.slot_kv import MemoryInfo, SlotKV
    from nbkv.kv.slot_table import SlotInfo
    from nbkv.kv.spc import SystemPromptStore
    from nbkv.prompt.builder import Prompt
    from nbkv.store.parked import ParkedEntry, ParkedInfo
    from nbkv.store.parking import ParkingLot

log = logging.getLogger("nbkv")


@dataclass
class Outcome:
    """What an admission's steps did to the slot."""

    reuse: int  # positions the slot keeps of the prompt
    planned: int  # ... as planned before the trim (the admission's, or a restored state's)
    parked_to: ParkedInfo | None = None  # where the displaced conversation went
    branch: ParkedInfo | None = None  # the entry taken back, parked again as the edit's branch
    restored: admission.Restored | None = None  # the parked conversation put back
    memo: Any = None  # the reply replayed (nbkv.engine.decoder), if any
    held_after: int = 0  # ... and how many of its tokens follow the prompt in the slot
    trimmed: int = 0  # positions cut off the slot's KV (cache "imc")
    checkpoint_pos: int | None = None  # a checkpoint restored to cut the KV there
    spc_hit: bool = False  # the system prompt's state was loaded (cache "spc")
    park_s: float = 0.0
    unpark_s: float = 0.0  # taking a parked entry, putting its state back
    restore_s: float = 0.0  # every step together


class Executor:
    """Applies admissions to slots: the only code that changes a slot's KV to admit a request.

    The steps run in the order the admission states (:data:`nbkv.kv.admission.STEP_ORDER`)
    on the target slot's :class:`~nbkv.kv.slot_kv.SlotKV`; what they did is reported as an
    :class:`Outcome`: the positions really kept, what was parked, restored, replayed,
    trimmed, and the time each took. Two things only the KV can tell are settled here: how
    much a restored state holds (the length kept is capped to it), and whether the slot
    already holds this very prompt's reply (a replay: nothing is parked or cut after that).
    A parked conversation its own session takes back and then cuts (an edit) is parked
    again as its earlier branch, as an edit in the slot parks a copy of the branch it cuts
    (:meth:`~nbkv.engine.slot_parking.Parker.keep_branch`). On a failure the slot is
    resynced and a parked entry taken back is parked again (unless it is that branch now):
    nothing is lost.
    """

    def __init__(self, res: Resources, settings: EngineSettings, table: EngineTable,
                 spc: SystemPromptStore, parking: ParkingLot | None, parker: Parker,
                 replays: Replays) -> None:
        self.res = res
        self.settings = settings
        self.table = table
        self.spc = spc
        self.parking = parking
        self.parker = parker
        self.replays = replays

    def run(self, adm: admission.Admission, job: Job, slot: EngineSlot, donor: EngineSlot | None,
            entry: ParkedEntry | None, unpark_s: float = 0.0, t0: float | None = None
            ) -> Outcome:
        """Apply ``adm``'s steps to ``slot`` for ``job``; what they did.

        ``donor`` is the slot copied from, ``entry`` the parked conversation restored,
        ``unpark_s`` the time taking it from the parking lot took, and ``t0`` when the
        admission began (its ``restore_s`` counts from there; default: now).
        """
        t0 = time.perf_counter() if t0 is None else t0
        out = Outcome(adm.keep, adm.keep, unpark_s=unpark_s)
        kv = slot.kv
        kv.last_restore = None
        self.table.serve(slot, True)
        owned = entry if adm.taken else None  # taken from the lot (else a copy read)
        try:
            self._steps(adm, job, slot, donor, entry, out)
        except BaseException:
            kv.resync()
            self.table.serve(slot, False)
            if owned is not None and out.branch is None and self.parking is not None:
                self.parking.park(owned)  # taken from the lot: not lost
            raise
        if owned is not None and out.branch is None:  # its state is in the slot now: the next
            # park reuses its memory (not a borrowed copy's, whose buffers the entry still
            # parked shares, nor that of an entry parked again as the edit's branch)
            t_put = time.perf_counter()
            state, owned.state = owned.state, None
            self.res.ctx.recycle(state)
            del state
            out.unpark_s += time.perf_counter() - t_put
        out.checkpoint_pos = kv.last_restore
        out.restore_s = time.perf_counter() - t0
        return out

    def _steps(self, adm: admission.Admission, job: Job, slot: EngineSlot, donor: EngineSlot | None,
               entry: ParkedEntry | None, out: Outcome) -> None:
        p, kv, rule, cache = job.prompt, slot.kv, self.res.rule, self.settings.slots.cache
        steps = adm.steps
        if admission.PARK in steps:  # before the slot is cut, copied over or reused
            t_park = time.perf_counter()
            out.parked_to = self.parker.park_slot(slot)
            out.park_s = time.perf_counter() - t_park
        self.table.drop_rewrite(slot)
        held = 0
        if admission.RESTORE in steps and entry is not None:
            t_put = time.perf_counter()
            held = self.parker.restore_into(slot, entry)  # (it empties the slot first)
            out.unpark_s += time.perf_counter() - t_put
            out.restored = admission.Restored(entry.session, entry.tier, admission.Cached(
                tuple(entry.tokens), tuple(entry.hashes), tuple(entry.msg_ends)))
            out.reuse = out.planned = invariance.valid_start(p.tokens, min(
                adm.plan.reuse,
                kv.settled if self.settings.exactness.exact and not self.res.lean else held,
                policy.reuse_limit(len(p.tokens))), rule)
        if admission.COPY in steps and donor is not None:
            out.reuse = kv.copy_from(donor.kv, out.reuse)
            log.debug("imc-copy-prefix: slot[%d] -> slot[%d], %d tokens",
                      donor.index, slot.index, out.reuse)
        if admission.LOAD_SPC in steps:
            out.reuse = self._load_spc(job, slot)
            out.spc_hit = bool(out.reuse)
        if admission.CLEAR in steps:
            kv.clear()
            out.reuse = 0
        # the same prompt and settings, and the slot holds the reply: nothing is cut
        found = self.replays.match(job, slot) if donor is None else None
        if found is not None:
            out.memo, out.held_after = found
            out.reuse = len(p.tokens)
            return
        if admission.PARK_BRANCH in steps and entry is not None:  # a parked conversation taken back
            if held:  # (a state that did not restore is not kept)
                out.branch = self.parker.keep_branch(entry, out.reuse, p.tokens, job.replay)
        elif admission.PARK_BRANCH in steps and out.parked_to is None:
            self.parker.park_branch(slot, out.reuse)
        if cache == "imc":
            out.trimmed = len(kv) - out.reuse
            if out.trimmed > 0:
                log.debug("imc-trim-prefix: slot[%d] cached_tokens=%d trim_pos=%d",
                          slot.index, len(kv), out.reuse)
        out.reuse = trim_valid(kv, p.tokens, out.reuse, rule)

    def _load_spc(self, job: Job, slot: EngineSlot) -> int:
        """SPC: put the system prompt's saved KV into ``slot``; returns the tokens restored.

        On the first request with a given system prompt nothing is restored: the prompt is
        prefilled as usual and the slot's state is saved when the prefill passes its end.
        """
        p, min_tokens, rule = job.prompt, self.settings.slots.cache_min_tokens, self.res.rule
        slot.kv.clear()
        if p.messages[0]["role"] != "system" or p.ends[0] < min_tokens:
            return 0
        key = p.hashes[0]
        entry = self.spc.get(key, p.tokens)
        if entry is None:
            # saved where a canonical chunk ends at or before the system prompt's end (and,
            # on sliding-window memory, where its window put back continues exactly)
            at = invariance.valid_start(p.tokens, p.ends[0], rule)
            mem = self.res.memory
            if not restorable(mem.kind, mem.n_swa, at):
                at = restore_point(p.tokens, at, rule, mem.kind, mem.n_swa)
            if at >= max(min_tokens, rule.min_chunk):
                job.capture_spc(at, key)
            return 0
        slot.kv.load_state(entry.state, entry.tokens)
        return len(slot.kv)


def record(job: Job, adm: admission.Admission, out: Outcome, slot: EngineSlot,
           why: admission.Reason, segments: tuple[Segment, ...], *, exact: bool, path: str
           ) -> RequestRecord:
    """``job``'s record as it starts: built from its admission and the outcome, nothing else.

    ``why`` is the reason the admission decided, in words; ``segments`` the slot's KV map;
    ``exact`` whether the reply is proven bit-identical, ``path`` the engine's decode path.
    """
    p, plan, reuse, imc = job.prompt, adm.plan, out.reuse, adm.cache == "imc"
    strategy = plan.strategy
    if admission.LOAD_SPC in adm.steps:
        strategy = "spc" if out.spc_hit else policy.MISS
    reply_cached, reply_reused = admission.reply_reuse(adm, reuse)
    parked, restored = out.parked_to, out.restored if reuse else None
    return RequestRecord(
        id=job.id, session=job.session, strategy=strategy, slot=slot.index,
        prompt_tokens=len(p.tokens), reused_tokens=reuse, prefilled_tokens=len(job.todo),
        trimmed_tokens=max(out.trimmed, 0) if imc else 0,
        donor_slot=plan.donor if reuse else None,
        donor_session=adm.donor_session if reuse else None,
        evicted_session=adm.held_by if parked is not None else plan.evicted,
        evicted_tokens=parked.n_tokens if parked is not None else plan.evicted_tokens,
        matched_messages=plan.matched_messages, reply_tokens_cached=reply_cached,
        reply_tokens_reused=reply_reused, dropped_messages=p.dropped,
        media_chunks=p.image_chunks, media_reused=sum(
            1 for u in p.tokens[:reuse] if isinstance(u, MediaUnit) and u.offset == 0),
        checkpoint_pos=out.checkpoint_pos,
        reprefilled_tokens=max(adm.wanted - reuse - adm.absorbed, 0) if imc else 0,
        rewrite_absorbed=adm.absorbed, exact=exact, capacity=slot.capacity,
        restore_s=out.restore_s, segments=segments, started_at=time.time(), reason=why.code,
        reason_text=why.text, divergence=why.divergence,
        restored_from=restored.tier if restored is not None else "",
        restored_tokens=(len(slot.kv) if out.memo is not None else reuse) if restored else 0,
        restored_session=restored.session if restored is not None else None,
        unpark_s=out.unpark_s if out.restored is not None else 0.0,
        evicted_parked=parked.tier if parked is not None else "", park_s=out.park_s,
        path=path)



CHECKPOINT_INTERVAL = 64  # hybrid/recurrent: a checkpoint at least this often in a prompt


class Placer:
    """Admits requests into slots: the slot table's plan carried out on the KV.

    Runs on the scheduler thread. Given the engine's resources, serve settings, slot
    table, system prompt store (SPC), parking lot (None: parking off), event bus, the
    :class:`~nbkv.engine.rewrite.Rewriter` (it keeps the engine's pace), the
    :class:`~nbkv.engine.slot_parking.Parker` (a displaced conversation is parked, a parked
    one restored) and the
    :class:`~nbkv.engine.decoder.Replays` (a re-run answered from the cache).
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
                ) -> admission.Reason:
        """Why ``job`` kept what it kept: its admission's decision, in words.

        Decided from the admission and the outcome (:func:`nbkv.kv.admission.decide`); the
        comparison is kept for ``explain``.
        """
        p, table, lot, reuse = job.prompt, self.table, self.parking, out.reuse
        if out.memo is not None:
            table.compare(job.id, slot.kv.tokens, p.tokens)
            return replay_reason(out.memo)
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
