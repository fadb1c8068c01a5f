"""Replay: a request with the same prompt and settings as an earlier one gets its reply again.

A notebook cell run again ("Run All" a second time) sends the prompt its turn had. With
deterministic sampling (greedy, or the same seed and settings), the same stop conditions and
exact KV, decoding would give the reply it gave before, token for token. When the slot that
serves the request (its own, or a parked conversation restored into it) still holds that
prompt followed by that reply, the reply is streamed at once from the cache: nothing is read
or decoded, and the slot's later turns stay in KV (nothing is trimmed).

Opt-in per request (``Engine.chat(..., replay=True)``; ``%%chat`` asks for it when a cell
runs again). Never on inexact KV: ``exact=False``, or a prefill grouping the calibration
could not prove. Runs on the scheduler thread; the replies are kept in
:class:`nbkv.kv.replies.ReplyBook`.
"""

from __future__ import annotations

import time
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


def reason(memo: ReplyMemo) -> Reason:
    """Why a request was replayed, in plain words."""
    return Reason(REPLAYED, f"the same prompt and settings as request #{memo.request}, so "
                            f"the same reply: its {len(memo.tokens)} tokens came from the "
                            "cache, nothing was decoded, and the slot kept what followed")
