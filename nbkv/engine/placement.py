"""Admitting a request: pick its slot, make the slot hold exactly the reusable prefix.

Runs on the scheduler thread. The slot table decides (:mod:`nbkv.kv.slot_table`, through
:mod:`nbkv.kv.policy`); here the decision is carried out on the KV: a donor's prefix copied,
the system prompt's state restored (SPC), the slot trimmed back to where a canonical prefill
of the prompt may begin (:mod:`nbkv.kv.invariance`), or to a checkpoint on memory that cannot be
cut. Then the request's record is started.

The KV operations of one admission, in this order: the conversation the slot held is parked
(a read of its state); a parked conversation is restored into it (a whole-state write); a
donor's prefix is copied into it; the system prompt's state is loaded (SPC, never with a
copy); it is trimmed (metadata, or a checkpoint's recurrent state). llama.cpp runs the data
part of a copy at the next decode (:meth:`nbkv.llama.backend.Context.seq_cp`), so across
the requests admitted in one scheduler pass a slot with a copy queued from or into it takes
no state write until then: a request whose plan would restore a state into it waits for the
next pass, one decode step later (:func:`must_wait`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from nbkv.core.events import RequestStarted, Segment
from nbkv.engine import replay
from nbkv.engine.slots import REPLY_TAIL
from nbkv.kv import invariance, policy, reasons
from nbkv.kv.reach import Judge, restorable, restore_point
from nbkv.kv.segments import prompt_segments
from nbkv.kv.slot_kv import SWA, trim_valid
from nbkv.llama.sampling import Sampler

if TYPE_CHECKING:
    from nbkv.core.events import EventBus
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.replay import Replays
    from nbkv.engine.rewrite import Pace
    from nbkv.engine.slot_parking import Parker
    from nbkv.engine.slots import EngineSlot, EngineTable, ServeSettings
    from nbkv.kv.invariance import PrefillRule
    from nbkv.kv.slot_kv import MemoryInfo, SlotKV
    from nbkv.kv.spc import SystemPromptStore
    from nbkv.prompt.builder import Prompt
    from nbkv.store.parking import ParkingLot

log = logging.getLogger("nbkv")

CHECKPOINT_INTERVAL = 64  # hybrid/recurrent: a checkpoint at least this often in a prompt


class Placer:
    """Admits requests into slots: the slot table's plan carried out on the KV.

    Runs on the scheduler thread. Given the engine's resources, serve settings, slot
    table, system prompt store (SPC), parking lot (None: parking off), event bus and
    :class:`~nbkv.engine.rewrite.Pace`, the :class:`~nbkv.engine.slot_parking.Parker` (a
    displaced conversation is parked, a parked one restored) and the
    :class:`~nbkv.engine.replay.Replays` (a re-run answered from the cache).
    """

    def __init__(self, res: Resources, settings: ServeSettings, table: EngineTable,
                 spc: SystemPromptStore, parking: ParkingLot | None, events: EventBus,
                 pace: Pace, parker: Parker, replays: Replays) -> None:
        self.res = res
        self.settings = settings
        self.table = table
        self.spc = spc
        self.parking = parking
        self.events = events
        self.pace = pace
        self.parker = parker
        self.replays = replays

    def start(self, job: Job) -> bool:
        """Pick a slot and prepare its KV; False when no slot is free yet."""
        p, cfg, table, rule = job.prompt, self.settings, self.table, self.res.rule
        snaps = table.snapshots()
        lot = self.parking if cfg.cache == "imc" else None
        parked = list(lot.entries()) if lot is not None else []
        mem = self.res.memory
        judge = Judge(p.tokens, rule, cfg.exact and not self.res.lean, mem.kind, mem.n_swa)
        unpark_s = 0.0  # the restore proper: taking a parked entry, putting its state back
        while True:
            plan = table.place(snaps, p, job.session, cache=cfg.cache,
                               min_tokens=cfg.cache_min_tokens, parked=parked, judge=judge)
            if plan is None or self.must_wait(plan):
                return False
            t0 = time.perf_counter()
            info = next((i for i in parked if i.key == plan.parked), None)
            taken = info is not None and policy.takes_parked(info, job.session, p.tokens)
            # its own session takes an entry back; any other conversation restores a copy
            entry = None
            if info is not None and lot is not None:
                t_take = time.perf_counter()
                entry = lot.take(info.key) if taken else lot.borrow(info.key)
                unpark_s += time.perf_counter() - t_take
            if plan.parked is None or entry is not None:
                break
            parked = [i for i in parked if i.key != plan.parked]  # unreadable: logged, skipped
        own = table.own(snaps, job.session)
        slot, donor, strategy = table[plan.slot], plan.donor, plan.strategy
        kv = slot.kv
        source_slot = table[donor] if donor is not None else slot
        source = source_slot.kv
        prev_len = len(source) + len(source_slot.redo)
        prev_prompt_len = slot.msg_ends[-1] if slot.msg_ends and donor is None else prev_len
        if entry is not None:  # what is reused is the parked conversation, not the slot's
            prev_len = prev_prompt_len = 0
        wanted = reuse = plan.reuse  # reuse if every cached position were servable as it is
        absorbed = 0
        if donor is None and entry is None and slot.session == job.session and slot.reply_rows:
            # this conversation continues: did its last reply have idle time to be rewritten in?
            self.pace.back_to_back = (job.t_submit - slot.t_replied
                                       < slot.reply_rows * self.pace.row_s)
        exact = judge.exact  # the exact path (else nothing is cut back)
        if exact and entry is None:  # a reply decoded one token at a time is not servable
            absorbed = max(min(wanted, prev_len) - source.exact_len, 0)
            reuse = min(reuse, source.settled)
        # where a canonical prefill of this prompt may begin (nbkv.kv.invariance)
        reuse = invariance.valid_start(p.tokens, min(reuse, policy.reuse_limit(len(p.tokens))),
                                       rule)
        target = reuse  # where memory that can be cut anywhere is cut
        kv.last_restore = None
        table.serve(slot, True)
        parked_to = None
        park_s = 0.0
        restored = None
        try:
            if displaced(slot, plan, job.session):
                t_park = time.perf_counter()
                # before the slot is cut, copied over or reused
                parked_to = self.parker.park_slot(slot)
                park_s = time.perf_counter() - t_park
            table.drop_rewrite(slot)
            if entry is not None:
                t_put = time.perf_counter()
                held = self.parker.restore_into(slot, entry)  # (it empties the slot first)
                unpark_s += time.perf_counter() - t_put
                restored = reasons.Restored(entry.session, entry.tier, reasons.Cached(
                    tuple(entry.tokens), tuple(entry.hashes), tuple(entry.msg_ends)))
                reuse = target = invariance.valid_start(p.tokens, min(
                    plan.reuse, kv.settled if exact else held,
                    policy.reuse_limit(len(p.tokens))), rule)
            if donor is not None:
                reuse = kv.copy_from(source, reuse)
                log.debug("imc-copy-prefix: slot[%d] -> slot[%d], %d tokens",
                          donor, slot.index, reuse)
            if cfg.cache == "spc":
                reuse = self._spc_restore(job, slot)
                strategy = "spc" if reuse else policy.MISS
            elif cfg.cache == "off":
                kv.clear()
                reuse = 0
            # the same prompt and settings, and the slot holds the reply: nothing is cut
            found = self.replays.match(job, slot) if donor is None else None
            memo, held_after = found if found is not None else (None, 0)
            if memo is not None:
                trimmed, reuse = 0, len(p.tokens)
            else:
                if cfg.cache == "imc" and entry is None and donor is None and parked_to is None:
                    # an edit: its old branch's replies stay
                    self.parker.park_branch(slot, reuse)
                trimmed = len(kv) - reuse if cfg.cache == "imc" else 0
                if cfg.cache == "imc" and trimmed > 0:
                    log.debug("imc-trim-prefix: slot[%d] cached_tokens=%d trim_pos=%d",
                              slot.index, len(kv), reuse)
                reuse = trim_valid(kv, p.tokens, reuse, rule)
        except BaseException:
            kv.resync()
            table.serve(slot, False)
            if entry is not None and taken and lot is not None:  # taken from the lot: not lost
                lot.park(entry)
            raise
        if entry is not None and taken:  # its state is in the slot now: the next park reuses
            # its memory (a borrowed copy shares its buffers with the entry still parked)
            t_put = time.perf_counter()
            state, entry.state = entry.state, None
            self.res.ctx.recycle(state)
            del state
            unpark_s += time.perf_counter() - t_put
        checkpoint_pos = kv.last_restore
        restore_s = time.perf_counter() - t0
        # the previous reply, as generated, against its re-tokenization in this prompt
        reply_cached = max(prev_len - prev_prompt_len, 0) if donor is None else 0
        reply_reused = min(max(reuse - prev_prompt_len, 0), reply_cached)
        if not reuse:  # a copy or a restore that kept nothing is not one: say what was done
            donor, restored = None, None
        donor_session = (table[donor].session or f"slot {donor}") if donor is not None else None
        still_parked = job.session is not None and lot is not None and (
            lot.find(job.session) is not None or (entry is not None and taken))
        if memo is not None:
            why = replay.reason(memo)
            table.compare(job.id, kv.tokens, p.tokens)
        else:
            why = table.reason(job.id, p, job.session, own, table[donor].tokens
                               if donor is not None else (), reuse=reuse, wanted=target,
                               donor_session=donor_session, can_trim=checkpoint_pos is None,
                               cache=cfg.cache, restored=restored,
                               kept_from=snaps[plan.slot].session, still_parked=still_parked)
        if parked_to is not None:  # whose conversation was parked, and how much of it
            plan = replace(plan, evicted=snaps[plan.slot].session,
                           evicted_tokens=parked_to.n_tokens)
        kept = None
        if memo is not None:  # the slot's messages stay: its own, or those of the parked entry
            kept = (entry.hashes, entry.msg_ends) if entry is not None else (slot.hashes,
                                                                             slot.msg_ends)
            if entry is not None:
                table.show(slot, entry.segments)
        table.claim(slot, job.id, job.session, p, reuse, plan.evicted,
                    parked=parked_to is not None, keep=kept)
        job.place(slot, reuse, memo, held_after)
        if mem.takes_checkpoints:
            job.stops = plan_checkpoints(slot.kv, mem, rule, p, reuse)
        job.sampler = Sampler(job.params, self.res.model.n_vocab,
                              [t for t in p.tokens if isinstance(t, int)])
        imc = cfg.cache == "imc"
        job.record = table.record(
            job.id, job.session, p, slot, replace(plan, strategy=strategy), reuse, why,
            prefilled_tokens=len(job.todo), trimmed_tokens=max(trimmed, 0) if imc else 0,
            donor_slot=donor, donor_session=table[donor].session if donor is not None else None,
            reply_tokens_cached=reply_cached, reply_tokens_reused=reply_reused,
            restore_s=restore_s, segments=self.segments(job, len(p.tokens)),
            media_chunks=p.image_chunks, checkpoint_pos=checkpoint_pos,
            restored_from=entry.tier if entry is not None and reuse else "",
            restored_tokens=((len(kv) if memo is not None else reuse)
                             if entry is not None and reuse else 0),
            restored_session=entry.session if entry is not None and reuse else None,
            unpark_s=unpark_s if entry is not None else 0.0,
            evicted_parked=parked_to.tier if parked_to is not None else "", park_s=park_s,
            reprefilled_tokens=max(wanted - reuse - absorbed, 0) if imc else 0,
            rewrite_absorbed=absorbed, exact=cfg.exact and rule.exact, path=self.res.path)
        if reply_cached and reply_reused < reply_cached:
            log.debug("slot[%d] previous reply re-tokenized differently: %d/%d tokens reused",
                      slot.index, reply_reused, reply_cached)
        log.debug("%s: slot[%d] prompt=%d reused=%d prefill=%d", strategy, slot.index,
                  len(p.tokens), reuse, len(job.todo))
        self.events.publish(RequestStarted(job.record))
        return True

    def must_wait(self, plan: policy.Plan) -> bool:
        """``plan`` would write a state into a slot that a queued copy still reads or fills.

        A restore of a parked conversation, a system prompt's state (SPC) or a checkpoint (on
        memory that cannot be cut) into the slot; the request waits for the next pass.
        """
        kv = self.table[plan.slot].kv
        return kv.copy_queued and (plan.parked is not None or self.settings.cache == "spc"
                                   or self.res.memory.checkpoints)

    def segments(self, job: Job, n: int) -> tuple[Segment, ...]:
        """KV map of ``job``'s slot: message spans split by reused / prefilled / generated."""
        proj = self.res.projector
        return prompt_segments(job.prompt, job.reuse, n, job.text.text,
                               proj.marker if proj is not None else "\0")

    def _spc_restore(self, job: Job, slot: EngineSlot) -> int:
        """SPC: put the system prompt's saved KV into ``slot``; returns the tokens restored.

        On the first request with a given system prompt nothing is restored: the prompt is
        prefilled as usual and the slot's state is saved when the prefill passes its end.
        """
        p, min_tokens, rule = job.prompt, self.settings.cache_min_tokens, self.res.rule
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


def displaced(slot: EngineSlot, plan: policy.Plan, session: str | None) -> bool:
    """``slot`` holds a conversation that serving ``plan`` would take over: park it first.

    Any conversation but the session's own (which the new one supersedes): another
    session's, even one the request carries on in place (a fork at its end: the fork may
    later be edited or cut). An unnamed conversation that an unnamed request carries on in
    place is that request's own.
    """
    if not (slot.tokens or slot.redo):
        return False
    if slot.session is not None:
        return slot.session != session
    held = slot.msg_ends[-1] if slot.msg_ends else len(slot.tokens) + len(slot.redo)
    continued = plan.donor is None and plan.parked is None and plan.reuse >= held
    return not (session is None and continued)
