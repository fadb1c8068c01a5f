"""A request's life on the scheduler thread: its progress, its sampled tokens, its end.

The :class:`~nbkv.engine.decoder.Decoder` reports here (:class:`~nbkv.engine.decoder.Steps`):
how far a prefill is, each row of logits to sample from, a failure. :meth:`Lifecycle.finish`
closes a request: the slot trimmed back to what it really holds, its bookkeeping settled
(the map, the reply for a later replay, the shadow's rewrite), the record published, the
caller's stream ended, the slot freed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from nbkv.core.errors import NbkvError
from nbkv.core.events import Progress, RequestFinished
from nbkv.kv.policy import PREFIX_SALVAGE

if TYPE_CHECKING:
    from nbkv.engine.core import EngineCore
    from nbkv.engine.jobs import Job
    from nbkv.engine.placement import Placer
    from nbkv.engine.shadow import Shadow

log = logging.getLogger("nbkv")


class Lifecycle:
    """Progress, sampling and the end of the requests placed in slots (scheduler thread).

    Given the engine's core (its resources, slot table, event bus, rewriter, replays, and
    ``active`` requests: a finished one leaves them) and the other parts a request's end
    settles: the :class:`~nbkv.engine.shadow.Shadow` or None, and the
    :class:`~nbkv.engine.placement.Placer`'s map.
    """

    def __init__(self, core: EngineCore, shadow: Shadow | None, placer: Placer) -> None:
        self.core = core
        self.res = core.res
        self.table = core.table
        self.events = core.events
        self.rewriter = core.rewriter
        self.shadow = shadow
        self.replays = core.replays
        self.placer = placer

    def wake(self) -> None:
        """Have the scheduler thread look at its requests now."""
        with self.table.lock:
            self.table.lock.notify_all()

    def progress(self, job: Job) -> None:
        """Publish how far ``job``'s prefill is."""
        total = job.started.prefilled_tokens
        phase = "extend" if job.reuse else "rebuild"
        self.events.publish(Progress(job.id, job.placed_slot.index, phase,
                                     total - len(job.todo), total))

    def on_logits(self, job: Job, idx: int) -> None:
        """Sample ``job``'s next token from batch row ``idx``; stream it, or finish."""
        with self.res.ctx.counters.part("sampling", job.counts):
            self.sample(job, idx)

    def sample(self, job: Job, idx: int) -> None:
        """:meth:`on_logits` inside a part the caller opened (one for a step's requests)."""
        now = time.perf_counter()
        sampler = job.sampler
        assert sampler is not None  # placed with its sampler (nbkv.engine.placement)
        token = sampler.sample(self.res.ctx, idx)
        if not job.t_first:  # the first token counts once it is sampled
            job.t_first = time.perf_counter()
            job.first_decode_s = job.t_first - now  # into the record as it finishes
        self.take(job, token, now)

    def take(self, job: Job, token: int, now: float) -> None:
        """:meth:`sample` for a token already sampled, at time ``now``: stream it, or finish."""
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
            self.events.publish(Progress(job.id, slot.index, "generate",
                                         len(job.generated), job.params.max_tokens))
        return None

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
        slot = job.slot
        rec = job.record
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
            rec = finished_record(job, rec, reason, error, now, slot.segments, mixed)
            job.record = rec
            self.replays.remember(job)
            if rec.strategy == PREFIX_SALVAGE:
                log.debug("imc-partial-rebuilt: total_cached=%d salvaged_prefix=%d "
                          "salvaged_pct=%.0f", n, rec.reused_tokens, rec.salvage_pct)
            self.events.publish(RequestFinished(rec))
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

    def fail(self, job: Job, error: BaseException | None, reason: str) -> None:
        """End ``job`` with ``error``, its slot trimmed back to what it really holds."""
        if job.slot is not None:
            job.slot.kv.resync()
        self.finish(job, reason, error)


def finished_record(job: Job, rec: Any, reason: str, error: BaseException | None, now: float,
                    segments: Any, mixed: int = 0) -> Any:
    """``rec`` completed with what the request did: tokens, timings, encoder and guesses.

    ``mixed``: the reply rows the shadow rewrote as the reply was generated.
    """
    t_first = job.t_first or now
    return rec.evolve(
        first_decode_s=job.first_decode_s if job.t_first else rec.first_decode_s,
        rewrite_absorbed_s=rec.rewrite_absorbed_s + job.absorbed_s,
        generated_tokens=len(job.generated),
        prefilled_tokens=rec.prefilled_tokens - len(job.todo),
        ttft_s=(t_first - job.t_submit) if job.t_first else 0.0,
        prefill_s=(t_first - job.t_prefill) if job.t_prefill and job.t_first else 0.0,
        wait_s=max(job.t_prefill - job.t_submit - rec.restore_s, 0.0) if job.t_prefill
        else 0.0,
        decode_s=(now - t_first) if job.t_first else 0.0,
        finish_reason=reason,
        encoder_runs=job.encoder_runs,
        embedding_cache_hits=job.embedding_hits,
        draft_tokens=job.drafted,
        draft_accepted=job.accepted,
        error=None if error is None else f"{type(error).__name__}: {error}",
        segments=segments,
        decode_calls=job.counts.decode_calls,
        rows_computed=job.counts.rows,
        prefill_calls=job.counts.prefill_calls,
        prefill_rows=job.counts.prefill_rows,
        kv_bytes=job.counts.kv_bytes,
        host_parts=tuple(sorted(job.counts.host_s.items())),
        rewrite_mixed=mixed,
    )
