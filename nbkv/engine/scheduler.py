"""The scheduler thread: the only code that touches the KV cache.

Requests are prepared in the caller's thread (template, tokens, message hashes) and queued
here. Each iteration runs the control calls (``Engine.probe``, saves, ...), admits queued
requests into slots (the :class:`~nbkv.engine.placement.Placer`), then advances the active
ones by one step (:func:`nbkv.kv.invariance.plan_step`), dispatched on each request's state
(:class:`nbkv.engine.jobs.JobState`): one prefill chunk or image piece and one generation
decode for every generating request. The :class:`~nbkv.engine.decoder.Decoder` decodes and
returns the rows of logits; the scheduler samples them, streams the tokens and finishes
the requests (:meth:`Scheduler.finish`: the slot trimmed back to what it holds, its map,
the reply kept for a replay, the record published, the slot freed). Back to back, one chunk
of a reply's rewrite goes into the shadow sequence (:mod:`nbkv.engine.rewrite`); idle, the
:class:`~nbkv.engine.rewrite.Rewriter` rewrites finished replies' KV. A request generating
alone runs its steps in one loop, back to the iteration as soon as anything else needs a
look. Slots change only through the table's locked methods; ``cv`` (the same lock) guards
the queue. A slot's ``tokens`` list is the truth about its KV: it is extended only after a
successful decode, and on any failure the KV is trimmed back to it.

The loop runs over the engine's :class:`~nbkv.engine.core.EngineCore` (requests, control
calls, replays, parking, rewriter). Only the facade imports this module (import-linter).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

from nbkv.core.errors import EngineClosedError, NbkvError, SlotTimeoutError
from nbkv.core.events import Progress, RequestFinished
from nbkv.engine.core import EngineCore
from nbkv.engine.decoder import Decoder
from nbkv.engine.jobs import READING, Job, JobState, finished_record
from nbkv.engine.native import Resources
from nbkv.engine.placement import Placer
from nbkv.engine.proving import adopt
from nbkv.engine.rewrite import Shadow
from nbkv.kv.invariance import Prefilling, StepPlan, next_chunk, plan_step
from nbkv.kv.policy import PREFIX_SALVAGE
from nbkv.kv.slot_kv import SlotKV

log = logging.getLogger("nbkv")

_GENERATE = StepPlan(generate=True)  # the plan while every active request generates


class Scheduler:
    """Queue, admission, decode steps and idle rewrites of one engine, on its own thread."""

    def __init__(self, core: EngineCore, shadow_kv: SlotKV | None = None) -> None:
        self.core = core
        self.res = res = core.res
        self.table = table = core.table
        self.settings = settings = core.settings
        #: the table's lock: it guards the core's requests as well, and wakes the thread
        self.cv = table.lock
        self.held = 0  # hold_admission() depth: requests queue but are not admitted
        self.thread: threading.Thread | None = None
        #: the parts it shares with the control calls (built by the core)
        self.replays, self.parker, self.rewriter = core.replays, core.parker, core.rewriter
        #: admits requests into slots
        self.placer = Placer(res, settings, table, core.spc, core.parking, core.events,
                             self.rewriter, self.parker, self.replays)
        #: rewrites replies while they are generated (None: no shadow sequence)
        self.shadow = (Shadow(shadow_kv, res, settings, table, self.rewriter)
                       if shadow_kv is not None else None)
        #: the requests' steps into the KV
        self.decoder = Decoder(res, settings, core.spc, self.rewriter.pace, self.wake)
        #: requests ran since the last idle pass that looked for a due garbage collection
        self.gc_pending = True

    def start(self, owner: Any) -> None:
        """Run on a thread that holds ``owner`` (the engine) only weakly."""
        self.thread = threading.Thread(
            target=_schedule, args=(weakref.ref(owner), self.cv, self.res),
            name="nbkv-scheduler", daemon=True)
        weakref.finalize(owner, _notify, self.cv)
        self.thread.start()

    # ------------------------------------------------------------ caller threads

    def submit(self, job: Job) -> None:
        """Queue ``job`` for admission."""
        with self.cv:
            if self.core.closed:
                raise EngineClosedError("this engine is closed")
            self.core.queue.append(job)
            self.cv.notify_all()

    def wake(self) -> None:
        """Have the thread look at its requests now."""
        with self.cv:
            self.cv.notify_all()

    def stop(self) -> None:
        """Cancel every request and end the thread (it then frees the native objects)."""
        core = self.core
        with self.cv:
            if core.closed:
                return
            core.closed = True
            for j in core.queue + core.active:
                j.cancel.set()
            self.cv.notify_all()
        if self.thread is not None and threading.current_thread() is not self.thread:
            self.thread.join()

    # --------------------------------------------------------------- the thread

    def has_work(self) -> bool:
        """Anything for the scheduler to do (call with ``cv`` held)."""
        core = self.core
        return bool(core.queue or core.active or core.control or core.closed
                    or (core.proof is not None and core.proof.ready())
                    or self.rewriter.settling_slot() is not None
                    or self.parker.prepark_slot(busy=False) is not None  # (none queued)
                    or self.gc_pending)

    def run_once(self) -> bool:
        """One scheduler iteration; False once the engine is closed (the thread then ends)."""
        core = self.core
        control: list[Any] = []
        jobs: list[Job] | None = None  # set once closed: the requests to cancel
        if core.closed or core.control:  # (read without the lock: only a peek)
            with self.cv:
                if core.closed:
                    jobs = core.queue + core.active
                    core.queue.clear()
                    core.active.clear()
                    for _, fut in core.control:
                        fut.set_exception(EngineClosedError("this engine is closed"))
                    core.control.clear()
                else:
                    control, core.control = core.control, []
            if jobs is not None:
                for j in jobs:
                    self.finish(j, "cancelled")
                return False
        for fn, fut in control:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        self._admit()
        if core.active or core.queue:
            self.gc_pending = True
        if core.active:
            # the step's host work outside its named parts (building batches, the KV's
            # bookkeeping) counts too, shared by the step's requests
            with self.res.ctx.counters.part("step", tuple(j.counts for j in core.active)):
                ran = self._step()
            if not ran:  # every active request waits for the vision encoder
                with self.cv:
                    self.cv.wait(0.05)
        elif core.queue:
            with self.cv:  # every slot busy: wait for a change, or a deadline
                self.cv.wait(0.05)
        elif core.proof is not None and core.proof.ready():  # idle, and proven meanwhile
            adopt(core.proof, self.res, self.table, core.spc, core.parking, self.shadow,
                  core.events)
        else:  # idle: rewrite one chunk of a finished reply's KV (see Engine's exact), copy
            slot = self.rewriter.settling_slot()  # out the conversation parked next, or run
            counters = self.res.ctx.counters  # the garbage collection due soonest
            if slot is not None and (wait := self.rewriter.grace(slot)) > 0:
                with self.cv:  # back to back: the next request may read the reply itself
                    if not (core.queue or core.control or core.closed):
                        self.cv.wait(wait)
            elif slot is not None:  # no request waits for any of them
                with counters.part("rewrite", idle=True):
                    self.rewriter.settle(slot)
            elif (slot := self.parker.prepark_slot(busy=False)) is not None:
                with counters.part("parking", idle=True):
                    self.parker.prepark(slot)
            elif self.gc_pending:  # once an idle period: another thread's allocations are its own
                self.gc_pending = False
                if (gen := gc_due()) is not None:
                    with counters.part("gc", idle=True):
                        gc.collect(gen)
        return True

    def hold(self, on: bool) -> None:
        """Hold admission (``on``), or release one hold: see ``Engine.hold_admission``."""
        with self.cv:
            self.held += 1 if on else -1
            self.cv.notify_all()

    def _admit(self) -> None:
        """Admit queued requests in order, each into its slot (:meth:`Placer.start`).

        One pass: a request that finds no slot free, or whose plan must wait for a queued
        copy to run (:meth:`nbkv.engine.placement.Placer.must_wait`), stays queued for the next.
        """
        if self.held or not self.core.queue:
            return
        now = time.monotonic()
        queue, active = self.core.queue, self.core.active
        for job in list(queue):
            if job.cancel.is_set():
                queue.remove(job)
                self.fail(job, None, "cancelled")
                continue
            counters = self.res.ctx.counters
            moved = counters.bytes_moved
            try:
                with counters.part("placement", job.counts):
                    started = self.placer.start(job)
            except BaseException as e:  # noqa: BLE001 - reported to the requester
                queue.remove(job)
                self.fail(job, e, "error")
                continue
            job.counts.kv_bytes += counters.bytes_moved - moved
            if started:
                queue.remove(job)
                if job.state is JobState.REPLAY:  # the cached reply: nothing to decode
                    self.replays.finish(job)
                else:
                    active.append(job)
            elif now > job.deadline:
                queue.remove(job)
                self.fail(job, SlotTimeoutError(
                    f"no slot became free within the wait limit ({len(self.table)} slots, "
                    f"all busy)"), "error")

    def _step(self) -> bool:
        """Advance the active requests by one step (:func:`nbkv.kv.invariance.plan_step`).

        False if nothing could run (every active request waits for the vision encoder).
        """
        active = self.core.active  # planning it is the step's own host work (part "step")
        for job in list(active):
            if job.cancel.is_set():
                if job.drop_pieces():  # drop the part of an image decoded so far
                    job.placed_slot.kv.resync()
                self.finish(job, "cancelled")
        if all(j.state is JobState.GENERATE for j in active):  # no prompt to read
            plan, generating = _GENERATE, list(active)
        else:
            plan, generating = self._plan()
        self.res.ctx.sampling.use(self._sampled_in_graph())
        if plan is _GENERATE and len(generating) == 1 and self.decoder.one_row(generating[0]):
            self._generate_run(generating[0])
            return True
        ran = False
        if plan.prefill is not None:
            job = next(j for j in active if j.id == plan.prefill)
            if not job.t_prefill:
                job.t_prefill = time.perf_counter()
            ran = self._read(job, plan.take)
        if plan.generate:
            if plan.prefill is not None:  # what it ran may have ended requests meanwhile
                generating = [j for j in generating if j.state is JobState.GENERATE]
            self._generate(generating)
            if self.shadow is not None:
                with self.res.ctx.counters.part("shadow"):
                    self.shadow.step([j for j in generating if not j.done.is_set()])
            ran = True
        return ran

    def _read(self, job: Job, take: int) -> bool:
        """Read ``take`` prompt positions of ``job``, or a piece of the image it is at.

        Its first token is sampled once the whole prompt is read. False while the vision
        encoder is still at work (nothing ran).
        """
        todo = len(job.todo)
        try:
            if job.state is JobState.PREFILL:
                row = self.decoder.prefill(job, take)
                if row is not None:
                    with self.res.ctx.counters.part("sampling", job.counts):
                        self.sample(job, row)
                    return True
            elif not self.decoder.decode_image(job):
                return False
        except BaseException as e:  # noqa: BLE001 - the request fails cleanly
            self.fail(job, e, "error")
            return True
        if len(job.todo) < todo:
            self.progress(job)
        return True

    def _generate(self, jobs: list[Job]) -> None:
        """Decode the next token of every generating request, and take the tokens sampled."""
        if not jobs:
            return
        if len(jobs) == 1 and self.decoder.one_row(jobs[0]):
            return self._generate_one(jobs[0])
        for batch in self.decoder.batches(jobs):
            try:
                rows, pairs = self.decoder.generate(batch)
            except BaseException as e:  # noqa: BLE001 - every request in it fails cleanly
                for job in batch:
                    self.fail(job, e, "error")
                continue
            # one part for the step's tokens, shared by its requests: a part per token would
            # cost as much as the sampling it counts
            with self.res.ctx.counters.part("sampling", tuple(job.counts for job in batch)):
                for job, row, guess, extra in rows:
                    try:
                        self.sample(job, row)
                        if guess is not None and (after := self.decoder.guessed(
                                job, guess, extra, pairs)) is not None:
                            self.sample(job, after)
                    except BaseException as e:  # noqa: BLE001
                        self.fail(job, e, "error")
        return None

    def _generate_one(self, job: Job) -> None:
        """:meth:`Decoder.generate_one`, its token taken (a failure fails ``job`` alone)."""
        try:
            self.take(job, self.decoder.generate_one(job), time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - the request fails cleanly
            self.fail(job, e, "error")

    def _generate_run(self, job: Job) -> None:
        """Generate ``job``'s tokens, one decode a step, while it is the only request.

        The usual steps of one conversation, in one loop: the scheduler's iteration (its
        lock, admission, plan) runs again as soon as anything else has to be looked at (a
        request queued, a control call, a cancel, the engine closing) or the reply ends.
        """
        core, shadow, generate = self.core, self.shadow, self._generate_one
        part = self.res.ctx.counters.part
        while True:
            generate(job)
            if shadow is not None and not job.done.is_set():
                with part("shadow"):
                    shadow.step([job])
            if (job.state is not JobState.GENERATE or core.queue or core.control or core.closed
                    or job.cancel.is_set()):
                return

    def _sampled_in_graph(self) -> range:
        """The sequences whose tokens llama.cpp's graph picks (``DeviceGreedy``).

        All of them (a slot and the shadow trade sequences) while every request samples
        greedily, has no image and decodes no guess (one output row a sequence), else none.
        """
        if all(j.sampler is not None and j.sampler.greedy and j.prompt.media is None
               and j.drafter is None for j in self.core.active):
            return range(self.res.ctx.n_seq_max)
        return range(0)

    def _plan(self) -> tuple[StepPlan, list[Job]]:
        """The next step (:func:`nbkv.kv.invariance.plan_step`) and the generating requests."""
        active = self.core.active
        generating = [j for j in active if j.state is JobState.GENERATE]
        prefilling = []
        for j in active:
            if j.state not in READING:
                continue
            image = j.state is not JobState.PREFILL
            stops = j.stops if j.capture_at is None else (*j.stops, j.capture_at)
            take = 0 if image else next_chunk(
                j.prompt.tokens, len(j.placed_slot.kv), self.res.rule, self.res.batch.capacity,
                stops, j.prompt.media is None)
            prefilling.append(Prefilling(j.id, len(j.todo), j.ready(), image, take))
        return plan_step(prefilling, len(generating)), generating

    # ------------------------------------------------------------ a request's tokens and end

    def progress(self, job: Job) -> None:
        """Publish how far ``job``'s prefill is."""
        total = job.started.prefilled_tokens
        phase = "extend" if job.reuse else "rebuild"
        self.core.events.publish(Progress(job.id, job.placed_slot.index, phase,
                                          total - len(job.todo), total))

    def sample(self, job: Job, row: int) -> None:
        """Sample ``job``'s next token from batch ``row`` (inside a part the caller opened)."""
        now = time.perf_counter()
        sampler = job.sampler
        assert sampler is not None  # placed with its sampler (nbkv.engine.placement)
        token = sampler.sample(self.res.ctx, row)
        if not job.t_first:  # the first token counts once it is sampled
            job.t_first = time.perf_counter()
            job.first_decode_s = job.t_first - now  # into the record as it finishes
        self.take(job, token, now)

    def take(self, job: Job, token: int, now: float) -> None:
        """A token sampled for ``job`` at time ``now``: stream it, or finish."""
        piece = self.res.model.emitted(token)
        if piece is None:
            return self.finish(job, "stop")
        generated = job.generated
        generated.append(token)
        if job.drafter is not None:
            job.drafter.append(token)
        text = job.text
        delta = text.push(piece)
        if delta:
            job.out.put(("delta", delta))
        if text.stopped is not None:
            return self.finish(job, "stop")
        # as llama-server stops (process_token): when the token just sampled would take the
        # slot's last position, so that both engines give a reply at the edge the same length
        slot = job.placed_slot
        if (len(generated) >= job.params.max_tokens
                or len(slot.kv.tokens) + 1 >= slot.capacity):
            return self.finish(job, "length")
        job.sampled(token)
        if now - job.t_last_progress > 0.25:
            job.t_last_progress = now
            self.core.events.publish(Progress(job.id, slot.index, "generate",
                                              len(job.generated), job.params.max_tokens))
        return None

    def fail(self, job: Job, error: BaseException | None, reason: str) -> None:
        """End ``job`` with ``error``, its slot trimmed back to what it really holds."""
        if job.slot is not None:
            job.slot.kv.resync()
        self.finish(job, reason, error)

    def finish(self, job: Job, reason: str, error: BaseException | None = None) -> None:
        """Close a request: settle its slot's bookkeeping, publish the record, free the slot."""
        with self.res.ctx.counters.part("lifecycle", job.counts):
            self._finish(job, reason, error)

    def _finish(self, job: Job, reason: str, error: BaseException | None = None) -> None:
        if job.done.is_set():
            return
        job.finished()
        active = self.core.active
        if job in active:
            active.remove(job)
        if job.sampler is not None:
            job.sampler.close()
        tail = job.text.flush()
        if tail:
            job.out.put(("delta", tail))
        now = time.perf_counter()
        slot, rec = job.slot, job.record
        mixed = settled = 0
        if slot is not None and self.res.ctx.ptr:  # a guessed position may follow
            try:
                slot.kv.resync()
                if slot.kv.copy_queued and not active:  # ended before its first decode
                    slot.kv.run_queued_copy()  # no later decode is coming to run the queued copy
            except BaseException:  # noqa: BLE001 - the request must still end
                log.exception("slot[%d]: could not trim past its tokens", slot.index)
                self.table.reset(slot)
            settled = slot.kv.settled
            if self.shadow is not None:  # the reply's KV, rewritten while it was generated
                mixed = self.shadow.hand_over(job, error is None)
        if slot is not None and rec is not None:
            n = len(slot.tokens) + len(slot.redo)
            self.table.replied(
                slot, job.prompt, job.text.text, n,
                segments=tuple(s if s.end <= n else replace(s, end=n)
                               for s in self.placer.segments(job, n) if min(s.end, n) > s.start),
                t_replied=now, reply_rows=n - settled if self.res.ctx.ptr else 0)
            rec = job.record = finished_record(job, rec, reason, error, now, slot.segments, mixed)
            self.replays.remember(job)
            if rec.strategy == PREFIX_SALVAGE:
                log.debug("imc-partial-rebuilt: total_cached=%d salvaged_prefix=%d "
                          "salvaged_pct=%.0f", n, rec.reused_tokens, rec.salvage_pct)
            self.core.events.publish(RequestFinished(rec))
            if mixed and not slot.redo:  # the shadow did the whole rewrite
                self.rewriter.finished(slot)
        if error is not None:
            job.out.put(("error", error))
        elif rec is not None:
            job.out.put(("done", rec))
        else:
            job.out.put(("error", NbkvError("request cancelled before it started")))
        job.done.set()
        self.wake()


def gc_due() -> int | None:
    """The oldest generation of Python's collector half way or more to its automatic run.

    The scheduler runs it in idle time, so that the collections the requests' allocations
    make due (a full one walks every object of the process) rarely fall inside a request.
    None while nothing is half way, or the collector's automatic runs are off (disabled, or
    a first threshold of 0).
    """
    counts, limits = gc.get_count(), gc.get_threshold()
    if not gc.isenabled() or limits[0] <= 0:
        return None
    for gen in range(len(limits) - 1, -1, -1):
        if limits[gen] > 0 and 2 * counts[gen] >= limits[gen]:
            return gen
    return None


def _schedule(ref: weakref.ref[Any], cv: threading.Condition, res: Resources) -> None:
    """The scheduler thread: run the engine while it is open and referenced, then free it.

    Holds the engine strongly only while it works; waits with just the weak reference, so
    dropping the last reference elsewhere collects the engine (its finalizer wakes us).
    """
    try:
        while True:
            engine = ref()
            if engine is None:
                break
            sched = engine.scheduler
            if not sched.core.active:  # (only this thread changes it: no lock to read it)
                with cv:
                    if not sched.has_work():
                        del engine, sched
                        cv.wait()
                        continue
            go = sched.run_once()
            del engine, sched
            if not go:
                break
    finally:
        res.close()


def _notify(cv: threading.Condition) -> None:
    with cv:
        cv.notify_all()
