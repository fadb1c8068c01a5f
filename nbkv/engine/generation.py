"""Generation decodes: one row per generating request, with an optional guess beside it.

Exactly what plain llama.cpp does, so replies equal its replies. With speculative decoding
a guess of the following token rides along (:mod:`nbkv.engine.drafts`): if the model then samples
that very token, its KV and logits are already there; if not, the guess's position is
removed.

A token decoded beside its guess is a two-row decode. Where the calibration found two-row
chunks canonical (threshold 2, alignment 1: Q4_0, Q4_1, Q8_0 on CPU), exact mode then gives
*every* sequence a second row (the guess, or the token itself when there is none): each
generated row is then computed as a canonical prefill computes it, and the reply needs no
rewrite at all. Its logits are a two-row batch's, so such replies equal nbkv's own from
scratch with guesses, not plain llama.cpp's one-row decoding (README, Exactness).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbkv.engine.jobs import Job, JobState

if TYPE_CHECKING:
    from nbkv.engine.scheduler import Scheduler


def generate(sched: Scheduler, jobs: list[Job]) -> None:
    """Decode the next token of every generating request."""
    if not jobs:
        return
    jobs.sort(key=lambda j: j.placed_slot.seq_id)  # one micro-batch (see nbkv.kv.batching)
    # more rows than the calibration proved would take another kernel: split the step
    limit = sched.res.rule.gen_rows
    size = max(limit // (2 if sched.settings.speculative else 1), 1) if limit else len(jobs)
    for i in range(0, len(jobs), size):
        _generate_rows(sched, jobs[i:i + size])


def two_row_exact(sched: Scheduler) -> bool:
    """Exact mode with guesses on a rule whose two-row chunks are canonical (see above)."""
    rule, cfg = sched.res.rule, sched.settings
    return (cfg.exact and cfg.speculative and rule.exact and not rule.single_row
            and rule.threshold <= 2 and rule.align == 1)


def _generate_rows(sched: Scheduler, jobs: list[Job]) -> None:
    """One generation decode for ``jobs`` (see :func:`generate`)."""
    batch = sched.res.batch
    batch.clear()
    plan = []
    pairs = two_row_exact(sched)
    for job in jobs:
        tok = job.take_token()
        slot = job.placed_slot
        kv = slot.kv
        idx = batch.add(tok, len(kv), kv.seq_id, True)
        guess = extra = None
        if job.drafter is not None and len(kv) + 2 < slot.capacity:
            guess = job.drafter.draft()
            if guess is None and pairs:
                guess = tok  # a second row all the same: it keeps the step canonical
            if guess is not None:
                extra = batch.add(guess, len(kv) + 1, kv.seq_id, True)
        plan.append((job, tok, idx, guess, extra))
    # llama.cpp gives every sequence of a micro-batch the same rows: only if each holds two
    # is each one's token row a two-row (canonical) computation
    pairs = pairs and all(p[4] is not None for p in plan)
    try:
        sched.res.ctx.decode(batch)
    except BaseException as e:  # noqa: BLE001 - every request in the batch fails cleanly
        for job, *_ in plan:
            sched.fail(job, e, "error")
        return
    # a one-row decode is a canonical row where the calibration says so; a row decoded
    # beside another of its sequence is one where two-row chunks are
    exact = sched.res.rule.single_row or pairs
    for job, tok, *_ in plan:
        kv = job.placed_slot.kv
        kv.extend([tok], exact=exact, settled=len(kv) + 1 if exact else None)
    for job, _, idx, guess, extra in plan:
        kv = job.placed_slot.kv
        try:
            sched.on_logits(job, idx)
            if guess is not None:
                job.drafted += 1
            if guess is not None and extra is not None and job.next_token == guess:
                job.accepted += 1
                job.take_token()
                kv.extend([guess], exact=pairs, settled=len(kv) + 1 if pairs else None)
                sched.on_logits(job, extra)
            elif guess is not None and job.state is not JobState.DONE:
                kv.resync()  # drop the wrong guess's position
        except BaseException as e:  # noqa: BLE001
            sched.fail(job, e, "error")
