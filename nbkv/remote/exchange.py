"""One request on a llama-server slot: steering, the completion itself, what it left behind.

:class:`Exchange` carries out what :class:`~nbkv.remote.llama_server.LlamaLlamaServerEngine`
decided (the slot, the reusable prefix): in exact mode it first makes the slot's common
prefix with the prompt end at a canonical start (:mod:`nbkv.remote.steering`), then streams
the completion, then reads the server's own figures (``timings.cache_n``) against the plan
and says what they prove: the record's ``reused_tokens``, ``verified`` and ``exact``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nbkv.core.errors import IncompleteReplyError
from nbkv.core.events import Progress, RequestRecord
from nbkv.kv import admission, policy
from nbkv.kv.slot_table import message_segments
from nbkv.prompt.builder import Prompt
from nbkv.remote import steering
from nbkv.remote.base import UNKNOWN, RemoteJob
from nbkv.remote.server_slot import DRAIN_S, SERVER_RAM, ServerSlot, SlotView
from nbkv.remote.steering import Offered, Step

if TYPE_CHECKING:
    from nbkv.remote.llama_server import LlamaServerEngine

log = logging.getLogger("nbkv.remote.connect")


@dataclass
class Outcome:
    """What the completion did, as the server reported it and as nbkv reads it."""

    final: dict[str, Any] = field(default_factory=dict)  # the last event (timings)
    told: int | None = None  # rows the server kept (timings.cache_n)
    finish: str = "cancelled"
    error: BaseException | None = None
    steps: int = 0  # steering requests sent before it
    steer_s: float = 0.0  # the time the steering requests took
    planned: Step | None = None  # the real request as planned (exact mode)
    exact: bool = False
    exact_note: str = ""
    settled: int = 0  # the slot's canonical prefix afterwards
    restored: int = 0  # rows the server loaded from its --cache-ram (asked for, exact mode)
    sent: bool = False  # the completion itself went out (not cancelled while steering)


class Exchange:
    """The HTTP side of one request: steering requests, then the streamed completion."""

    def __init__(self, engine: LlamaServerEngine, job: RemoteJob, prompt: Prompt,
                 slot: ServerSlot) -> None:
        self.engine, self.job, self.p, self.slot = engine, job, prompt, slot
        self.out = Outcome()
        self.sent_held: list[int] = []  # what the slot held when the completion was sent
        self.failed_before = slot.failed  # the error that left the slot unknown, if any

    # ---------------------------------------------------------------- exact mode: steering

    def steer(self) -> Step | None:
        """Bring the slot to where the real request starts canonically; its planned Step.

        None when no plan keeps the reply exact (the request then goes as it is).
        """
        eng, slot, out = self.engine, self.slot, self.out
        rule = eng.rule
        assert rule is not None
        tokens = list(self.p.tokens)
        guard = eng.facts.has_cache is not False
        t0 = time.perf_counter() - out.steer_s  # (after a restore asked for first)
        try:
            for _ in range(steering.MAX_STEPS + 1):
                held, settled = (slot.held, slot.settled) if slot.known else ([], 0)
                steps = steering.route(tokens, held, settled, rule,
                                       ubatch=eng.facts.plan_ubatch, guard_restore=guard)
                if steps is None:
                    out.exact_note = ("no grouping of this prompt's rows into the server's "
                                      "batches is proven exact")
                    return None
                if steps[0].real:
                    return steps[0]
                if out.steps >= steering.MAX_STEPS or self.job.cancel.is_set():
                    out.exact_note = "the server did not keep what nbkv steered it to"
                    return None
                self.send_step(tokens[:steps[0].end] + [steps[0].junk], steps[0].fresh)
            return None
        finally:
            out.steer_s = time.perf_counter() - t0

    def restore_from(self, upto: int) -> None:
        """Ask the server to load a state from its ``--cache-ram``, cut at ``upto`` rows.

        A steering request for the prompt's first ``upto`` rows makes the server look in
        its prompt cache (it does when a request keeps less than half of the slot); what it
        loaded, if anything, is then proven by the ledger (:meth:`Ledger.proven`).
        """
        tokens = list(self.p.tokens)
        sent = tokens[:upto] + [steering.junk_for(tokens, upto)]
        had = policy.common_prefix(self.slot.held, sent) if self.slot.known else 0
        t0 = time.perf_counter()
        told = self.send_step(sent, False)
        self.out.steer_s += time.perf_counter() - t0
        if told > had:
            self.out.restored = min(told, self.slot.settled)

    def send_step(self, sent: list[int], fresh: bool) -> int:
        """One steering request (the real one's prompt head and a junk token); its cache_n."""
        told = self.engine.steer_slot(self.slot, sent, fresh, self.job.session)
        self.out.steps += 1
        return told

    # ---------------------------------------------------------------- the completion

    def complete(self, step: Step | None) -> Outcome:
        """Stream the completion; the reply's text and tokens go to the job."""
        eng, job, slot, out = self.engine, self.job, self.slot, self.out
        prm = job.params
        out.planned = step
        fresh = step is not None and step.fresh
        body: dict[str, Any] = {
            "prompt": list(self.p.tokens), "id_slot": slot.index, "cache_prompt": not fresh,
            "stream": True, "return_progress": True, "return_tokens": True,
            "n_cache_reuse": 0, "n_predict": prm.max_tokens, "temperature": prm.temperature,
            "top_k": prm.top_k, "top_p": prm.top_p, "min_p": prm.min_p,
            "repeat_penalty": prm.repeat_penalty, "repeat_last_n": prm.repeat_last_n,
            "seed": prm.seed, "stop": list(prm.stop),
        }
        if job.cancel.is_set():
            return out
        eng.offer_states(slot, self.p.tokens)
        out.sent = True
        seen_cache: int | None = None
        try:
            for ev in eng._events(job, "/completion", body):
                pp = ev.get("prompt_progress")
                if pp:  # (its "tokens" field is a placeholder, not a generated token)
                    seen_cache = int(pp["cache"])
                    done, total = pp["processed"] - pp["cache"], pp["total"] - pp["cache"]
                    eng.events.publish(Progress(job.id, slot.index, "extend" if pp["cache"]
                                                else "rebuild", done, total))
                    continue
                eng._delta(job, ev.get("content") or "")
                job.generated.extend(ev.get("tokens") or ())
                if job.t_first and ev.get("tokens"):
                    eng.events.publish(Progress(job.id, slot.index, "generate",
                                                len(job.generated), prm.max_tokens))
                if ev.get("stop"):
                    out.final = ev
                    out.finish = {"limit": "length"}.get(ev.get("stop_type", ""), "stop")
                    break
        except BaseException as e:
            out.error = e
            out.finish = "cancelled" if isinstance(e, KeyboardInterrupt) else "error"
        if out.error is None and not out.final and not job.cancel.is_set():
            out.error = IncompleteReplyError(f"{eng.url}/completion: the answer ended without "
                                             f"its final event (the server stopped?)",
                                             job.text)
            out.finish = "error"
        t = out.final.get("timings") or {}
        out.told = int(t["cache_n"]) if "cache_n" in t else seen_cache
        return out

    def judge(self, held: Sequence[int], settled: int) -> None:
        """Whether the reply is proven exact, and the slot's canonical prefix after it.

        ``held``/``settled``: the slot as it was when the completion was sent.
        """
        eng, out = self.engine, self.out
        self.sent_held = list(held)
        rule, step = eng.rule, out.planned
        if rule is None:
            out.exact, out.exact_note = False, eng.why_not_exact
            return
        if out.told is None:
            out.settled = 0
            out.exact = False
            out.exact_note = out.exact_note or "the server did not say what it reused"
            return
        tokens = list(self.p.tokens)
        proven = eng.proven(tokens, out.told, held)
        out.settled, ok = steering.observed(tokens, out.told, held, settled, rule, junk=False,
                                            ubatch=eng.facts.plan_ubatch, proven=proven)
        if step is None:
            out.exact = False
            out.exact_note = out.exact_note or "the request was not steered"
        elif not ok:
            out.exact = False
            out.exact_note = (f"the server reused {out.told} tokens where nbkv steered it to "
                              f"{step.start}; what it kept is not proven canonical")
        elif not out.final:  # cancelled (or failed) before the server's last event
            out.exact = False
            out.exact_note = ("the reply was cut short before the server confirmed what it "
                              "reused (timings.cache_n): a partial reply is not proven")
        else:
            out.exact = True

    def finish(self, plan: policy.Plan, record: RequestRecord, expected: int | None,
               entry: Offered | None, prev: tuple[int, int, int],
               before: Mapping[int, SlotView], other_note: str,
               own: Any = None) -> RequestRecord:
        """The record of the finished request, and what its slot holds now.

        ``prev``: the slot's length, its prompt's length and its canonical prefix before.
        """
        eng, job, out = self.engine, self.job, self.out
        prev_len, prev_prompt_len, settled_before = prev
        now = time.perf_counter()
        told = out.told
        reused = plan.reuse if told is None else told
        source = (eng.ledger.fits(self.p.tokens, told)
                  if told is not None and eng.facts.has_cache is not False else [])
        restored_rows, verified, note, restarted = self._check_told(
            plan, expected, other_note, source)
        restore = self._restore_reason(plan, entry, source, restored_rows, reused, own)
        if not self.alone(before) and eng.rule is not None:
            out.exact = False
            out.exact_note = ("another client's request ran on the server at the same time "
                              "(llama-server computes the slots it serves in one batch)")
        # a request that rebuilt a slot another client had used leaves it known again
        self.record_held(reused, verified or bool(other_note and eng.rule is not None), note)
        absorbed, reread = reply_rows(prev_len, prev_prompt_len, plan.reuse, reused,
                                      settled_before) if told is not None else (0, 0)
        rec = replace(
            record, **self._figures(reused, prev_len, now), rewrite_absorbed=absorbed,
            reprefilled_tokens=reread, verified=verified, note=note, **restore,
            **self._reason_after(record, expected, restarted),
            exact=out.exact, exact_note="" if out.exact else out.exact_note)
        if not verified:
            log.warning("request %d: %s", job.id, note)
        job.record = rec
        if out.error is not None:
            raise out.error
        return rec

    def _check_told(self, plan: policy.Plan, expected: int | None, other_note: str,
                    source: Sequence[Offered]) -> tuple[int, bool, str, bool]:
        """What the server's reused count (``timings.cache_n``) proves against the plan.

        (rows it restored from its --cache-ram, verified, the note, the server restarted).
        """
        eng, slot, told = self.engine, self.slot, self.out.told
        reused = plan.reuse if told is None else told
        verified, note = (False, other_note) if other_note else (True, "")
        has_cache = eng.facts.has_cache
        shared = policy.common_prefix(self.sent_held, self.p.tokens)
        restored_rows = min(self.out.restored, reused)
        restarted = False
        if not restored_rows and told is not None and expected is not None and \
                told > max(expected, shared) and source:
            # the server found a longer prefix of this prompt in its --cache-ram (its host-
            # memory prompt cache, llama-server's parking lot) and loaded it into the slot
            restored_rows = told
        elif told is not None and expected is not None and told > max(expected, shared):
            verified = False
            note = (f"the server reused {told} tokens where nbkv expected {expected}: another "
                    f"client used slot {slot.index}" + ("" if has_cache is False else
                                                        ", or restored a state nbkv "
                                                        "never put there"))
        elif told is not None and expected is not None and told < min(
                expected, plan.reuse) and eng.rule is None:
            seen = eng.watch.read()
            if seen is not None and eng._restarted(seen):
                restarted = True
            else:
                verified = False
                note = (f"the server reused {told} tokens where nbkv expected {expected}: "
                        f"another client used slot {slot.index}, or the server cleared it")
        elif told is not None and expected is None and not other_note:
            note = f"slot {slot.index}'s content was unknown (after an error); now known again"
        return restored_rows, verified, note, restarted

    def _restore_reason(self, plan: policy.Plan, entry: Offered | None,
                        source: Sequence[Offered], restored_rows: int, reused: int,
                        own: Any) -> dict[str, Any]:
        """The record's restore fields and reason (empty where nothing was restored).

        Where a parked conversation was offered, or the server restored one from its
        --cache-ram.
        """
        eng, job, p, slot = self.engine, self.job, self.p, self.slot
        if restored_rows:
            whose = entry.session if entry is not None else source[-1].session
            kept = entry or source[-1]
            why = eng.table.reason(job.id, p, job.session, own, slot.tokens, reuse=reused,
                                   wanted=plan.reuse, restored=admission.Restored(
                                       whose, SERVER_RAM, admission.Cached(
                                           kept.tokens, kept.hashes, kept.msg_ends)))
            return dict(restored_from=SERVER_RAM, restored_tokens=restored_rows,
                        restored_session=whose, reason=why.code,
                        reason_text=f"{why.text} (the server's --cache-ram)",
                        divergence=why.divergence)
        if entry is not None:  # the server no longer had it
            why = eng.table.reason(job.id, p, job.session, own, slot.tokens, reuse=reused,
                                   wanted=plan.reuse)
            return dict(reason=why.code, reason_text=why.text, divergence=why.divergence)
        return {}

    def _reason_after(self, record: RequestRecord, expected: int | None,
                      restarted: bool) -> dict[str, Any]:
        """The reason, where the slot's content was unknown or the server was restarted."""
        eng, job, slot, told = self.engine, self.job, self.slot, self.out.told
        failed = self.failed_before
        if expected is None and record.reason == admission.FIRST and failed:
            if told:
                return dict(reason=admission.CONTINUED, reason_text=(
                    f"slot {slot.index}'s content was not known after its last request "
                    f"failed ({failed}); the server still held {told} tokens of this prompt "
                    f"and reused them"))
            return dict(reason_text=(
                f"slot {slot.index}'s content was not known after its last request "
                f"failed ({failed}), so the conversation was read again"))
        if (record.reason == admission.RELOADED or restarted) and eng.restart_note:
            who = f"session {job.session}" if job.session is not None else "this request"
            return dict(reason=admission.RELOADED, divergence=None,
                        reason_text=f"{eng.restart_note}: {who}'s conversation was read again")
        return {}

    def _figures(self, reused: int, prev_len: int, now: float) -> dict[str, Any]:
        """The record's counts and times, from the server's last event (its timings)."""
        job, p, slot, out = self.job, self.p, self.slot, self.out
        final, error, t = out.final, out.error, out.final.get("timings") or {}
        return dict(
            reused_tokens=reused,
            prefilled_tokens=int(t.get("prompt_n", len(p.tokens) - reused)) if final else 0,
            trimmed_tokens=max(prev_len - reused, 0),
            # (llama-server counts the end-of-generation token it sampled; the kernel does not)
            generated_tokens=max(int(t.get("predicted_n", len(job.generated))) - (
                final.get("stop_type") == "eos"), 0) if final else len(job.generated),
            ttft_s=(job.t_first - job.t_submit) if job.t_first else 0.0,
            prefill_s=float(t.get("prompt_ms", 0.0)) / 1000,
            decode_s=float(t.get("predicted_ms", 0.0)) / 1000 if final else (
                now - job.t_first if job.t_first else 0.0),
            restore_s=out.steer_s, finish_reason=out.finish,
            error=None if error is None else f"{type(error).__name__}: {error}",
            segments=message_segments(p.messages, p.ends, len(p.tokens), reused,
                                      len(slot.tokens) if slot.known else len(p.tokens),
                                      job.text),
        )

    def alone(self, before: Mapping[int, SlotView]) -> bool:
        """No other client's task ran on the server during the request (exact mode).

        Compares ``/slots`` before and after it: a task id that changed, or a slot busy at
        either read. The read after also notes the slot's own task id as nbkv's.
        """
        watch, index = self.engine.watch, self.slot.index
        after = watch.read()
        if after is None:
            return True
        watch.note_own(index, after.get(index))
        for i, v in after.items():
            if i == index:
                continue
            b = before.get(i)
            if v.processing or (b is not None and (b.processing or b.task != v.task)):
                return False
        return True

    def record_held(self, reused: int, verified: bool, note: str) -> None:
        """Record what the slot now holds: the prompt and the reply tokens the server decoded.

        The last sampled token is never decoded into the KV. After an interruption the count
        comes from ``/slots``; after a failure the slot is marked unknown.
        """
        eng, job, p, slot = self.engine, self.job, self.p, self.slot
        final, error, settled = self.out.final, self.out.error, self.out.settled
        if not self.out.sent and error is None:
            return  # cancelled before the completion went out: the slot is as steered
        held = list(p.tokens) + job.generated
        n: int | None = len(held) - 1 if final and job.generated else (
            len(p.tokens) if final else None)
        if not final and error is None and eng.watch.has_slots:  # interrupted
            n = self.server_length()
            if n is None:  # the server has not let it go yet: nothing runs beside it
                with eng._cv:
                    eng.draining.add(slot.index)
            if n is not None and n > len(held):
                # the server decoded a few more tokens before it saw the connection close:
                # they are in its KV but not known here, and match no prompt token (-1)
                held += [UNKNOWN] * (n - len(held))
        with eng._cv:
            if error is not None and not isinstance(error, KeyboardInterrupt) or n is None \
                    or n > len(held):
                eng.lose(slot, job.session, "the last request failed")  # (the lock is reentrant)
                slot.failed = type(error).__name__ if error is not None else "interrupted"
                return
            slot.hold(held[:n], settled)
            slot.failed = ""
            eng.table.replied(slot, p, job.text, n)
            slot.segments = message_segments(p.messages, p.ends, len(p.tokens),
                                              min(reused, n), n, job.text)
            slot.verified, slot.note = verified, note if not verified else ""
            for info in eng.watch.raw:  # what /slots will say, until the next poll
                if info.get("id") == slot.index:
                    info.update(n_prompt_tokens=n, is_processing=False)

    def server_length(self, wait: float = DRAIN_S) -> int | None:
        """The slot's cached token count once the server has let it go (``/slots``).

        It lets go at its next write to the closed connection: a token later, or on a
        loaded machine many seconds later; after ``wait`` s the count is unknown.
        """
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            seen = self.engine.watch.read()
            v = seen.get(self.slot.index) if seen is not None else None
            if v is None:
                return None
            if not v.processing:
                return v.n_tokens
            time.sleep(0.05)
        return None


def reply_rows(prev_len: int, prev_prompt_len: int, reuse_wanted: int, told: int,
               settled_before: int) -> tuple[int, int]:
    """``(absorbed, re-read)``: rows the canonical path read again that were cached.

    Of the rows the slot matched (``reuse_wanted``) but the request did not keep (``told``):
    those of the previous reply (one-row decodes, read again as a batch, like the kernel's
    rewrite absorbed by a request), and the rest (prompt rows re-read so that the new chunk
    starts aligned with enough rows).
    """
    lost = max(reuse_wanted - told, 0)
    reply = max(min(reuse_wanted, prev_len) - max(told, settled_before, prev_prompt_len), 0)
    return reply, max(lost - reply, 0)

