"""The decoder: a request's steps into the KV, or its reply replayed (scheduler thread).

One prefill chunk of a prompt, in the canonical chunks of :mod:`nbkv.kv.invariance`
(:meth:`Decoder.prefill`); an image's embeddings, in sub-batches between the other requests'
steps (:meth:`Decoder.decode_image`); one generation decode for every generating request
(:meth:`Decoder.generate`: a row each, and an optional guess of the following token beside
it, :mod:`nbkv.engine.drafts`, whose position is removed if the model samples another). It
owns what decoding needs (:class:`~nbkv.engine.native.Resources`) and returns the batch row
whose logits give a request's next token (the scheduler samples and streams it), or nothing;
a failure is raised (the scheduler fails the request, its KV trimmed back to its tokens). The
system prompt's state is saved when a prefill reaches it (:func:`spc_capture`). Replies equal
plain llama.cpp's, except where the calibration found two-row chunks canonical (Q4_0, Q4_1,
Q8_0 on CPU): exact mode then gives every sequence a second row, so that no reply needs a
rewrite, and replies equal nbkv's own from scratch (docs/concepts/exactness.md).

Replay (:class:`Replays`): a cell run again ("Run All" a second time) sends the prompt its
turn had; with deterministic sampling, the same stop conditions and exact KV, decoding would
give the same reply, token for token. When the slot that serves the request (its own, or a
parked conversation restored into it) still holds that prompt and that reply, the reply is
streamed at once from the cache: nothing is read or decoded, and the slot's later turns stay
in KV. Opt-in per request (``Engine.chat(..., replay=True)``; ``%%chat`` asks when a cell runs
again); never on inexact KV. The replies are kept in :class:`nbkv.kv.replies.ReplyBook`.
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
from dataclasses import replace
from typing import TYPE_CHECKING

from nbkv.core.events import GENERATED, KEPT, REUSED, RequestFinished
from nbkv.core.streams import TextStream
from nbkv.kv.admission import REPLAYED, Reason
from nbkv.kv.invariance import valid_start
from nbkv.kv.policy import reuse_limit
from nbkv.kv.replies import ReplyBook, ReplyMemo, deterministic, digest, settings_key
from nbkv.kv.slot_table import prompt_segments

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import EventBus
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.slots import EngineSlot, EngineTable


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


class Replays:
    """The replies a re-run may be answered with, and the replays themselves (scheduler thread).

    Given the engine's resources, serve settings, slot table and event bus; owns the
    :class:`~nbkv.kv.replies.ReplyBook`.
    """

    def __init__(self, res: Resources, settings: EngineSettings, table: EngineTable,
                 events: EventBus) -> None:
        self.res = res
        self.settings = settings
        self.table = table
        self.events = events
        #: replies a re-run of the same prompt and settings may be answered with
        self.replies = ReplyBook()

    def proven(self) -> bool:
        """True when this engine's replies are exact, so a reply may stand for a new decode."""
        cfg = self.settings
        return cfg.slots.cache == "imc" and cfg.exactness.exact and bool(self.res.rule.exact)

    def remember(self, job: Job) -> None:
        """Note the reply of a request that ended normally, if it may ever be replayed."""
        rec, slot = job.record, job.slot
        if (rec is None or slot is None or job.memo is not None or not self.proven()
                or not rec.exact or rec.error is not None
                or rec.finish_reason not in ("stop", "length") or not deterministic(job.params)):
            return
        n = len(job.prompt.tokens)
        held = len(slot.kv.tokens) - n
        if held < 0 or tuple(slot.kv.tokens[n:n + held]) != tuple(job.generated[:held]):
            return
        self.replies.add(ReplyMemo(digest(job.prompt.tokens), n, settings_key(job.params),
                                   tuple(job.generated), held, rec.finish_reason, job.id))

    def match(self, job: Job, slot: EngineSlot) -> tuple[ReplyMemo, int] | None:
        """The reply to give ``job`` if it may be replayed, with its tokens held; else None.

        The count is how many of the reply's tokens follow the prompt in ``slot``. ``slot``
        must hold its prompt (all a request for it could reuse), and the same prompt
        and settings must have been answered before.
        """
        if not job.replay or not self.proven():
            return None
        tokens = job.prompt.tokens
        # what the cache keeps of a prompt: all a request for it could reuse (a parked
        # conversation ends where a canonical prefill may resume)
        need = valid_start(tokens, reuse_limit(len(tokens)), self.res.rule)
        return self.replies.find(tokens, job.params, [slot.kv.tokens], need)

    def text_of(self, job: Job, memo: ReplyMemo) -> str:
        """The reply's text, as its generation released it (stop strings cut as they were)."""
        stream: TextStream = job.text
        model = self.res.model
        for t in memo.tokens:
            stream.push(model.text_piece(t))
            if stream.stopped is not None:
                break
        stream.flush()
        return stream.text

    def finish(self, job: Job) -> None:
        """Answer ``job`` (placed in its slot) with the reply ``job.memo``; nothing is decoded.

        The slot keeps all it holds: its map is this request's (prompt and reply reused), then
        what it held after them, marked as kept.
        """
        memo: ReplyMemo = job.memo
        slot = job.slot
        assert slot is not None and job.record is not None
        text = self.text_of(job, memo)
        if text:
            job.out.put(("delta", text))
        now = time.perf_counter()
        n = memo.n_prompt + job.memo_held  # the reply as far as the slot holds it
        proj = self.res.projector
        mine = tuple(replace(s, state=REUSED) if s.state == GENERATED else s
                     for s in prompt_segments(job.prompt, memo.n_prompt, n, text,
                                              proj.marker if proj is not None else "\0"))
        later = tuple(replace(s, start=max(s.start, n), state=KEPT) for s in slot.segments
                      if s.end > n)
        if job.sampler is not None:
            job.sampler.close()
        # the first-token time in parts (nbkv.ui.figures.ttft_parts): what placement spent
        # restoring (a parked conversation put back first) is its own part, not waiting
        ttft = now - job.t_submit
        rec = replace(job.record, segments=mine, ttft_s=ttft,
                      wait_s=max(ttft - job.record.restore_s, 0.0),
                      finish_reason=memo.finish_reason,
                      replayed_tokens=len(memo.tokens))
        job.record = rec
        job.finished()
        self.table.release(slot, mine + later)
        self.events.publish(RequestFinished(rec))
        job.out.put(("done", rec))
        job.done.set()
        with self.table.lock:
            self.table.lock.notify_all()


def replay_reason(memo: ReplyMemo) -> Reason:
    """Why a request was replayed, in plain words."""
    return Reason(REPLAYED, f"the same prompt and settings as request #{memo.request}, so "
                            f"the same reply: its {len(memo.tokens)} tokens came from the "
                            "cache, nothing was decoded, and the slot kept what followed")
