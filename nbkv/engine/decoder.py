"""The decoder: a request's steps into the KV (scheduler thread).

One prefill chunk of a prompt, in the canonical chunks of :mod:`nbkv.kv.invariance`
(:meth:`Decoder.prefill`); an image's embeddings, in sub-batches between the other requests'
steps (:meth:`Decoder.decode_image`); one generation decode for every generating request
(:meth:`Decoder.generate`). It owns what decoding needs (the context, its batch, the prefill
rule, the projector: :class:`~nbkv.engine.native.Resources`) and returns the batch row whose
logits give a request's next token (the scheduler samples and streams it), or nothing; a
failure is raised (the scheduler fails the request, its KV trimmed back to its tokens).
The system prompt's state is saved here when a prefill reaches it (:func:`spc_capture`).

Generation decodes: one row per generating request, with an optional guess beside it.

Exactly what plain llama.cpp does, so replies equal its replies. With speculative decoding
a guess of the following token rides along (:mod:`nbkv.engine.drafts`): if the model then samples
that very token, its KV and logits are already there; if not, the guess's position is
removed.

A token decoded beside its guess is a two-row decode. Where the calibration found two-row
chunks canonical (threshold 2, alignment 1: Q4_0, Q4_1, Q8_0 on CPU), exact mode then gives
*every* sequence a second row (the guess, or the token itself when there is none): each
generated row is then computed as a canonical prefill computes it, and the reply needs no
rewrite at all. Its logits are a two-row batch's, so such replies equal nbkv's own from
scratch with guesses, not plain llama.cpp's one-row decoding (docs/concepts/exactness.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nbkv.core.errors import MediaError
from nbkv.engine.jobs import Job, JobState
from nbkv.kv import invariance

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.engine.native import Resources
    from nbkv.engine.rewrite import Pace
    from nbkv.kv.spc import SystemPromptStore

log = logging.getLogger("nbkv")

#: a request's rows in a generation decode: ``(job, its row, its guess, the guess's row)``
Row = tuple[Job, int, int | None, int | None]


class Decoder:
    """Decodes the requests' steps into their slots' KV (see the module's docstring)."""

    def __init__(self, res: Resources, settings: EngineSettings, spc: SystemPromptStore,
                 pace: Pace, wake: Callable[[], None]) -> None:
        self.res = res
        self.settings = settings
        self.spc = spc  # SPC: where a system prompt's state is saved once prefilled
        self.pace = pace  # where each prefill chunk's time per row is noted
        self.wake = wake  # the scheduler looks again (an image's embeddings are ready)

    def prefill(self, job: Job, take: int) -> int | None:
        """Decode the next ``take`` prompt positions of ``job`` as one batch.

        Returns the batch row of the prompt's last logits once the whole prompt is read
        (None: more to read).
        """
        kv = job.placed_slot.kv
        toks = job.todo[:take]
        batch = self.res.batch
        batch.clear()
        done = take >= len(job.todo)
        last = batch.add_run(toks, len(kv), kv.seq_id, done)
        t0 = time.perf_counter()
        counts = job.counts
        counts.decode_calls += 1
        counts.rows += take
        counts.prefill_calls += 1
        counts.prefill_rows += take
        self.res.ctx.decode(batch)
        self.pace.note_rows(take, time.perf_counter() - t0)
        rec = job.started
        # the positions re-read first: settled ones the grouping needs, then the previous
        # reply's (absorbed: its rewrite had not run); time the absorbed share of this chunk
        read = rec.prefilled_tokens - len(job.todo)
        lo, hi = rec.reprefilled_tokens, rec.reprefilled_tokens + rec.rewrite_absorbed
        overlap = min(hi, read + take) - max(lo, read)
        if overlap > 0:  # into the record as it finishes
            job.absorbed_s += overlap / take * (time.perf_counter() - t0)
        end = len(kv) + take  # only now are these positions really in the KV
        kv.extend(toks, settled=invariance.stable_end(job.prompt.tokens, end, self.res.rule,
                                                      job.prompt.media is None))
        job.read(take)
        if end in job.stops and kv.settled == end:
            kv.checkpoint()
        if job.capture_at is not None and end >= job.capture_at:
            if end == job.capture_at and kv.settled == end:
                spc_capture(self.spc, job)
            job.spc_captured()
        return last if done else None

    def decode_image(self, job: Job) -> bool:
        """Decode the image at the head of ``job``'s prefill, if its embeddings are ready.

        Where a picture starts, the projector's embedding service is asked once: held by the
        request or cached (a hit), else it encodes on its own thread (a run; the other requests
        keep decoding meanwhile); it counts either in ``job``. False while the encoder is still
        at work (nothing ran).
        """
        projector, ctx = self.res.projector, self.res.ctx
        unit = job.todo[0]
        chunk = job.prompt.chunk_for(unit)
        n = chunk.n_pos
        if n >= len(job.todo):
            raise MediaError("a prompt must not end with an image")
        image = chunk.image
        assert image is not None  # chunk_for gives image chunks only
        h = image.hash
        fut = job.take_encoding()  # done: the step skips the job until then
        if fut is None and (h not in job.embeddings
                            or (chunk.sub_index == 0 and not job.image_piece)):
            fut = projector.embeddings.fetch(image, job.prompt.media,
                                             held=job.embeddings, tally=job, wait=False)
            if not fut.done():
                job.wait_encoder(fut)
                fut.add_done_callback(lambda _: self.wake())
                return False
        if fut is not None:
            job.embeddings[h] = fut.result()
        emb = job.embeddings[h]
        slot = job.placed_slot
        # a big causal image goes in sub-batches, one per step, between the other
        # requests' tokens (a non-causal one is a single batch)
        total = projector.pieces(ctx, chunk)
        piece = job.image_piece
        calls, rows = ctx.counters.decode_calls, ctx.counters.rows
        try:
            projector.decode_chunk(ctx, chunk, slot.seq_id, len(slot.kv),
                                   embedding=emb, piece=piece if total > 1 else None)
            job.counts.decode_calls += ctx.counters.decode_calls - calls
            job.counts.rows += ctx.counters.rows - rows
        except BaseException:  # decode_chunk removed what it decoded
            job.drop_pieces()
            raise
        if piece + 1 < total:
            job.piece_read()
            return True
        slot.kv.extend(job.todo[:n], settled=len(slot.kv) + n)
        job.read(n)
        slot.kv.checkpoint()  # a follow-up question never re-decodes the image
        return True

    def batches(self, jobs: list[Job]) -> list[list[Job]]:
        """The generating requests' micro-batches for one step: one decode each.

        One batch by slot order (see :mod:`nbkv.kv.invariance`), split where it holds more rows
        than the calibration proved (more would take another kernel).
        """
        if len(jobs) > 1:
            jobs.sort(key=lambda j: j.placed_slot.seq_id)
        limit = self.res.rule.gen_rows
        size = max(limit // (2 if self.res.speculative else 1), 1) if limit else len(jobs)
        return [jobs[i:i + size] for i in range(0, len(jobs), size)]

    def two_row_exact(self) -> bool:
        """Exact mode with guesses on a rule whose two-row chunks are canonical (see above)."""
        rule, cfg = self.res.rule, self.settings
        return (cfg.exactness.exact and self.res.speculative and rule.exact and not rule.single_row
                and rule.threshold <= 2 and rule.align == 1)

    def one_row(self, job: Job) -> bool:
        """Whether ``job``'s step is one row whose token the graph picks (:meth:`generate_one`)."""
        return job.drafter is None and bool(self.res.ctx.sampling.seqs)

    def generate_one(self, job: Job) -> int:
        """One request's generation decode, its token picked by the graph: the usual step.

        What :meth:`generate` does for one row with no guess, in one function: after a
        decode every line of Python runs with cold caches, and a step's host time is mostly
        the code and objects it touches. Returns the token the request's sampler reads from
        the graph (its sampling counts in the step's part).
        """
        res = self.res
        ctx, kv = res.ctx, job.placed_slot.kv
        tok = job.take_token()
        pos = len(kv.tokens)
        batch = res.batch
        batch.clear()
        batch.add(tok, pos, kv.seq_id, True)
        counts = job.counts
        counts.decode_calls += 1
        counts.rows += 1
        ctx.decode(batch)
        exact = res.rule.single_row
        kv.extend((tok,), exact=exact, settled=pos + 1 if exact else None)
        sampler = job.sampler
        assert sampler is not None  # placed with its sampler (nbkv.engine.placement)
        return sampler.sample(ctx, 0)

    def generate(self, jobs: list[Job]) -> tuple[list[Row], bool]:
        """One generation decode for a micro-batch of :meth:`batches`.

        Returns each request's :data:`Row` (its row of logits, and its guess and the guess's
        row, if any) and whether every request decoded two rows (then each row is computed
        as a canonical two-row chunk). Raises what the decode raised: every request in it
        then fails.
        """
        batch = self.res.batch
        batch.clear()
        rows: list[Row] = []
        pairs = self.two_row_exact()
        toks = []
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
            rows.append((job, idx, guess, extra))
            toks.append(tok)
        # llama.cpp gives every sequence of a micro-batch the same rows: only if each holds two
        # is each one's token row a two-row (canonical) computation
        pairs = pairs and all(r[3] is not None for r in rows)
        for job, _, _, extra in rows:
            job.counts.decode_calls += 1
            job.counts.rows += 1 + (extra is not None)
        self.res.ctx.decode(batch)
        # a one-row decode is a canonical row where the calibration says so; a row decoded
        # beside another of its sequence is one where two-row chunks are
        exact = self.res.rule.single_row or pairs
        for (job, *_), tok in zip(rows, toks):
            kv = job.placed_slot.kv
            kv.extend([tok], exact=exact, settled=len(kv) + 1 if exact else None)
        return rows, pairs

    def guessed(self, job: Job, guess: int, extra: int | None, pairs: bool) -> int | None:
        """``job`` decoded a guess beside its token, which was sampled and taken: keep it or not.

        Kept when it is the token sampled (and the request goes on): its position joins the
        KV and its row (``extra``, returned) gives the next token. Else its position is
        dropped and None returned.
        """
        kv = job.placed_slot.kv
        job.drafted += 1
        if extra is not None and job.next_token == guess:
            job.accepted += 1
            job.take_token()
            kv.extend([guess], exact=pairs, settled=len(kv) + 1 if pairs else None)
            return extra
        if job.state is not JobState.DONE:
            kv.resync()  # drop the wrong guess's position
        return None


def spc_capture(spc: SystemPromptStore, job: Job) -> None:
    """SPC: save the slot's state now that its prefill has reached the system prompt's end."""
    assert job.spc_key is not None
    kv = job.placed_slot.kv
    moved = kv.ctx.counters.bytes_read
    spc.put(job.spc_key, kv.save_state(), kv.tokens)
    job.counts.kv_bytes += kv.ctx.counters.bytes_read - moved
    job.spc_captured()
    log.debug("spc: saved system prompt state, %d tokens", len(kv))
