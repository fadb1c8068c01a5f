"""The executor of admissions: an :class:`~nbkv.kv.admission.Admission`'s steps on a slot's KV.

Runs on the scheduler thread. :class:`Executor` applies the steps in the order the admission
states (:data:`nbkv.kv.admission.STEP_ORDER`) to the target slot's
:class:`~nbkv.kv.slot_kv.SlotKV` and reports what they did as an :class:`Outcome`: the
positions really kept, what was parked, restored, replayed, trimmed, and the time each took.
Two things only the KV can tell are settled here: how much a restored state holds (the
length kept is capped to it), and whether the slot already holds this very prompt's reply (a
replay: nothing is parked or cut after that). A parked conversation its own session takes
back and then cuts (an edit) is parked again as its earlier branch, as an edit in the slot
parks a copy of the branch it cuts (:meth:`~nbkv.engine.slot_parking.Parker.keep_branch`).
On a failure the slot is resynced and a parked entry taken back is parked again (unless
it is that branch now): nothing is lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbkv.core.events import RequestRecord
from nbkv.kv import admission as ad
from nbkv.kv import invariance, policy, reasons
from nbkv.kv.reach import restorable, restore_point
from nbkv.kv.slot_kv import trim_valid
from nbkv.media.units import MediaUnit

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import Segment
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.replay import Replays
    from nbkv.engine.slot_parking import Parker
    from nbkv.engine.slots import EngineSlot, EngineTable
    from nbkv.kv.spc import SystemPromptStore
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
    restored: reasons.Restored | None = None  # the parked conversation put back
    memo: Any = None  # the reply replayed (nbkv.engine.replay), if any
    held_after: int = 0  # ... and how many of its tokens follow the prompt in the slot
    trimmed: int = 0  # positions cut off the slot's KV (cache "imc")
    checkpoint_pos: int | None = None  # a checkpoint restored to cut the KV there
    spc_hit: bool = False  # the system prompt's state was loaded (cache "spc")
    park_s: float = 0.0
    unpark_s: float = 0.0  # taking a parked entry, putting its state back
    restore_s: float = 0.0  # every step together


class Executor:
    """Applies admissions to slots: the only code that changes a slot's KV to admit a request."""

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

    def run(self, adm: ad.Admission, job: Job, slot: EngineSlot, donor: EngineSlot | None,
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

    def _steps(self, adm: ad.Admission, job: Job, slot: EngineSlot, donor: EngineSlot | None,
               entry: ParkedEntry | None, out: Outcome) -> None:
        p, kv, rule, cache = job.prompt, slot.kv, self.res.rule, self.settings.slots.cache
        steps = adm.steps
        if ad.PARK in steps:  # before the slot is cut, copied over or reused
            t_park = time.perf_counter()
            out.parked_to = self.parker.park_slot(slot)
            out.park_s = time.perf_counter() - t_park
        self.table.drop_rewrite(slot)
        held = 0
        if ad.RESTORE in steps and entry is not None:
            t_put = time.perf_counter()
            held = self.parker.restore_into(slot, entry)  # (it empties the slot first)
            out.unpark_s += time.perf_counter() - t_put
            out.restored = reasons.Restored(entry.session, entry.tier, reasons.Cached(
                tuple(entry.tokens), tuple(entry.hashes), tuple(entry.msg_ends)))
            out.reuse = out.planned = invariance.valid_start(p.tokens, min(
                adm.plan.reuse,
                kv.settled if self.settings.exactness.exact and not self.res.lean else held,
                policy.reuse_limit(len(p.tokens))), rule)
        if ad.COPY in steps and donor is not None:
            out.reuse = kv.copy_from(donor.kv, out.reuse)
            log.debug("imc-copy-prefix: slot[%d] -> slot[%d], %d tokens",
                      donor.index, slot.index, out.reuse)
        if ad.LOAD_SPC in steps:
            out.reuse = self._load_spc(job, slot)
            out.spc_hit = bool(out.reuse)
        if ad.CLEAR in steps:
            kv.clear()
            out.reuse = 0
        # the same prompt and settings, and the slot holds the reply: nothing is cut
        found = self.replays.match(job, slot) if donor is None else None
        if found is not None:
            out.memo, out.held_after = found
            out.reuse = len(p.tokens)
            return
        if ad.PARK_BRANCH in steps and entry is not None:  # a parked conversation taken back
            if held:  # (a state that did not restore is not kept)
                out.branch = self.parker.keep_branch(entry, out.reuse, p.tokens, job.replay)
        elif ad.PARK_BRANCH in steps and out.parked_to is None:
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


def record(job: Job, adm: ad.Admission, out: Outcome, slot: EngineSlot, why: reasons.Reason,
           segments: tuple[Segment, ...], *, exact: bool, path: str) -> RequestRecord:
    """``job``'s record as it starts: built from its admission and the outcome, nothing else.

    ``why`` is the reason the admission decided, in words; ``segments`` the slot's KV map;
    ``exact`` whether the reply is proven bit-identical, ``path`` the engine's decode path.
    """
    p, plan, reuse, imc = job.prompt, adm.plan, out.reuse, adm.cache == "imc"
    strategy = plan.strategy
    if ad.LOAD_SPC in adm.steps:
        strategy = "spc" if out.spc_hit else policy.MISS
    reply_cached, reply_reused = ad.reply_reuse(adm, reuse)
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
