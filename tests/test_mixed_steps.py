"""Back-to-back turns in exact mode, on the embedded Q4_1: mixed steps and the rewrite's yield.

A reply is decoded one row per step (as plain llama.cpp does) and its KV rewritten as a
batch before a cached request may serve it. With mixed steps the rewrite runs while the
reply is generated, in a shadow sequence (nbkv.engine.rewrite); in idle time it runs in
chunks a new request preempts. Either way replies must equal cache-off replies and every
slot must verify bit-identical.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import SYSTEM, assert_consistent, scratch_reply
from nbkv import Engine
from nbkv.core.events import RequestFinished, SlotRewritten
from nbkv.engine import rewrite
from nbkv.engine.rewrite import SHADOW_CHUNK
from nbkv.kv import calibrate, invariance
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.backend import Batch, Context, Model
from nbkv.ui import figures

REPLY = 24  # tokens: a few shadow chunks


def user(text):
    return {"role": "user", "content": text}


def first_turn(q="Tell me about the sea."):
    return [{"role": "system", "content": SYSTEM}, user(q)]


def back_to_back(engine, turns, session="b2b", max_tokens=REPLY):
    """Play ``turns`` (user texts), each sent from the previous reply's RequestFinished,
    on the scheduler thread: before it can go idle, so no reply gets idle time."""
    msgs = first_turn(turns[0])
    results, done, errors = [], threading.Event(), []

    def send(messages):
        results.append((messages, engine.chat(messages, session=session, stream=True,
                                              max_tokens=max_tokens, temperature=0)))

    def on_event(ev):
        if not isinstance(ev, RequestFinished) or ev.record.session != session:
            return
        try:
            k = len(results)
            if k == len(turns):
                done.set()
                return
            messages, stream = results[-1]
            reply = stream._job.text.text  # the whole reply, known to the engine by now
            send([*messages, {"role": "assistant", "content": reply}, user(turns[k])])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            done.set()

    unsubscribe = engine.subscribe(on_event)
    try:
        send(msgs)
        assert done.wait(600)
    finally:
        unsubscribe()
    assert not errors, errors
    return [(m, s.result()) for m, s in results]


@pytest.fixture(scope="module")
def mixed(model_path):
    with Engine(model_path, n_slots=2, n_ctx=1024, rewrite="mixed") as e:
        yield e


def test_the_calibration_proves_mixed_steps_and_the_engine_keeps_a_shadow(mixed):
    rule = mixed.prefill_rule
    assert rule.exact and rule.mixed and not rule.single_row
    assert "mixed steps: yes" in mixed.model.exactness
    assert mixed.ctx.n_seq_max == mixed.n_slots + 1  # the shadow sequence
    assert mixed.plan.shadow == 1 and "+1 for the reply rewrite" in mixed.plan.describe()


def test_back_to_back_turns_reuse_replies_rewritten_while_generated(mixed, model_path):
    mixed.clear()
    rewrites = []
    unsubscribe = mixed.subscribe(
        lambda ev: rewrites.append(ev) if isinstance(ev, SlotRewritten) else None)
    try:
        turns = back_to_back(mixed, ["List ten fruits, one per line.",
                                     "Now ten vegetables, one per line.",
                                     "Now ten trees, one per line."])
        mixed.settle()  # the last reply's rewrite: what its shadow did not reach
    finally:
        unsubscribe()
    for k, (msgs, res) in enumerate(turns):
        rec = res.record
        assert res.text == scratch_reply(model_path, msgs, max_tokens=REPLY), k
        if rec.generated_tokens >= 2 * SHADOW_CHUNK:
            assert rec.rewrite_mixed >= SHADOW_CHUNK, k
            assert "while replying" in figures.summary(rec)
        if k:  # re-reads at most what the shadow's last chunk had not reached
            prev = turns[k - 1][1].record
            assert rec.rewrite_absorbed < SHADOW_CHUNK + mixed.prefill_rule.threshold
            assert rec.reused_tokens >= prev.prompt_tokens + prev.rewrite_mixed - 2
    assert any(ev.mixed for ev in rewrites)
    assert all(ev.mixed <= ev.tokens for ev in rewrites)
    results = mixed.verify()
    assert results and all(v.identical for v in results), [str(v) for v in results]
    assert_consistent(mixed)


def test_a_cancelled_reply_hands_over_what_the_shadow_rewrote(mixed, model_path):
    mixed.clear()
    msgs = first_turn("List twenty fruits, one per line, numbered.")
    stream = mixed.chat(msgs, session="cut", stream=True, max_tokens=200, temperature=0)
    for seen, _ in enumerate(stream, 1):
        if seen >= 3 * SHADOW_CHUNK:
            break
    stream.close()  # cancels the request
    rec = stream.record
    assert rec.finish_reason == "cancelled" and rec.generated_tokens < 200
    assert rec.rewrite_mixed >= SHADOW_CHUNK
    results = mixed.verify()
    assert results and all(v.identical for v in results), [str(v) for v in results]
    assert_consistent(mixed)


def test_the_calibration_says_no_when_shadow_rows_are_not_canonical(model_path, monkeypatch):
    """The mixed-step proof can fail: one-row shadow chunks round like one-row decodes."""
    model = Model(model_path)
    ctx = Context(model, 512, 2, calibrate.N_ROWS, n_threads=2)
    batch = Batch(calibrate.N_ROWS)
    try:
        rng = np.random.default_rng(7)
        tokens = [int(t) for t in rng.integers(100, model.n_vocab - 100, calibrate.N_ROWS)]
        rule = PrefillRule(2, 1)  # Q4_1 on CPU: chunks of 2+ rows
        assert calibrate._mixed_steps(rule, ctx, batch, tokens, 0, 1)
        monkeypatch.setattr(invariance, "block_chunk",
                            lambda units, pos, r, cap: 1 if pos < len(units) else 0)
        assert not calibrate._mixed_steps(rule, ctx, batch, tokens, 0, 1)
    finally:
        batch.close()
        ctx.close()
        model.close()


def test_auto_rewrites_while_generating_only_when_requests_come_back_to_back(model_path):
    with Engine(model_path, n_slots=1, n_ctx=1024) as e:  # rewrite="auto"
        assert e.settings.exactness.rewrite == "auto" and e.ctx.n_seq_max == 2
        msgs = first_turn()
        # a fresh engine assumes no idle time (a notebook's Run All, an agent loop)
        first = e.chat(msgs, session="a", max_tokens=REPLY, temperature=0)
        assert first.record.rewrite_mixed > 0
        e.settle()  # the caller gives the engine time: replies are rewritten in idle time
        msgs += [first.message, user("And the sky?")]
        second = e.chat(msgs, session="a", max_tokens=REPLY, temperature=0)
        assert second.record.rewrite_mixed == 0
        # the next turn comes the moment the reply ends: its own reply is then rewritten
        # while generated
        turns = back_to_back(e, ["List ten rivers, one per line.",
                                 "Now list ten lakes, one per line."], session="b")
        assert turns[1][1].record.rewrite_mixed > 0
        for m, res in turns:
            assert res.text == scratch_reply(model_path, m, max_tokens=REPLY)
        assert all(v.identical for v in e.verify())


def test_rewrite_idle_keeps_no_shadow(model_path):
    with Engine(model_path, n_slots=1, n_ctx=1024, rewrite="idle") as e:
        assert e.ctx.n_seq_max == 1 and e.plan.shadow == 0
        turns = back_to_back(e, ["List ten fruits, one per line.",
                                 "Now ten vegetables, one per line."])
        assert all(res.record.rewrite_mixed == 0 for _, res in turns)
        assert turns[1][1].record.rewrite_absorbed > 0  # the reply was re-read
    with pytest.raises(Exception, match="rewrite must be one of"):
        Engine(model_path, n_slots=1, n_ctx=256, rewrite="sometimes")


def test_back_to_back_the_idle_rewrite_waits_for_the_next_request(model_path, monkeypatch):
    """While requests come back to back, a reply's idle rewrite waits (``GRACE_S``): the next
    request reads the reply in its own prefill, and waits for no rewrite chunk begun in the
    instant between the two. Once the caller gives the engine time, it rewrites at once."""
    monkeypatch.setattr(rewrite, "GRACE_S", 600.0)
    rewrites = []
    with Engine(model_path, n_slots=1, n_ctx=1024, rewrite="idle") as e:
        e.subscribe(lambda ev: rewrites.append(ev) if isinstance(ev, SlotRewritten) else None)
        msgs = first_turn()
        first = e.chat(msgs, session="g", max_tokens=REPLY, temperature=0)
        time.sleep(0.5)  # idle, but within the grace: nothing rewritten
        slot = e.slots()[0]
        assert not rewrites and slot.settled < len(slot.tokens)
        msgs += [first.message, user("And the sky?")]
        second = e.chat(msgs, session="g", max_tokens=REPLY, temperature=0)
        assert second.record.rewrite_absorbed > 0 and not rewrites
        assert second.text == scratch_reply(model_path, msgs, max_tokens=REPLY)
        e.settle()  # the caller gives the engine time: no more back to back
        assert len(rewrites) == 1
        msgs += [second.message, user("And the stars?")]
        e.chat(msgs, session="g", max_tokens=REPLY, temperature=0)
        deadline = time.monotonic() + 120
        while len(rewrites) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(rewrites) == 2  # rewritten in idle time, with no grace
        assert all(v.identical for v in e.verify())


def test_a_request_preempts_the_idle_rewrite_between_chunks(model_path, monkeypatch):
    """The idle rewrite runs in chunks of REWRITE_CHUNK; a request arriving during one waits
    for that chunk only, keeps what is rewritten and re-reads only the rest."""
    paused, release = threading.Event(), threading.Event()
    chunks = []
    settle = rewrite.Rewriter.settle

    def one_chunk_then_wait(rewriter, slot):
        before = len(slot.kv) + len(slot.redo)
        settle(rewriter, slot)
        chunks.append(before - len(slot.redo))
        if len(chunks) == 1:  # the scheduler sits between two rewrite chunks
            paused.set()
            assert release.wait(600)

    monkeypatch.setattr(rewrite.Rewriter, "settle", one_chunk_then_wait)
    with Engine(model_path, n_slots=1, n_ctx=1024, rewrite="idle") as e:
        msgs = first_turn("List twenty fruits, one per line, numbered.")
        first = e.chat(msgs, session="p", max_tokens=48, temperature=0)
        assert first.record.generated_tokens > 2 * rewrite.REWRITE_CHUNK
        assert paused.wait(600)
        slot = e.slots()[0]
        assert slot.rewriting > rewrite.REWRITE_CHUNK  # what the first chunk did not reach
        msgs += [first.message, user("Now twenty vegetables.")]
        stream = e.chat(msgs, session="p", stream=True, max_tokens=8, temperature=0)
        release.set()
        second = stream.result()
        rec = second.record
        assert 0 < rec.rewrite_absorbed <= slot.rewriting  # the rest, not the whole reply
        assert rec.reused_tokens >= slot.settled
        assert second.text == scratch_reply(model_path, msgs, max_tokens=8)
        assert all(v.identical for v in e.verify())
        assert_consistent(e)


def test_a_calibration_grouping_that_differs_stops_at_its_first_chunk(model_path):
    """One-row chunks of the embedded Q4_1 differ from a batch within a few rows: the
    grouping test stops at the first that differs (a few decodes, not 48); a grouping that
    holds is still compared row by row to its last chunk, where a difference is found."""
    model = Model(model_path)
    ctx = Context(model, 256, 1, calibrate.N_ROWS, n_threads=1)  # thread-invariant
    batch = Batch(calibrate.N_ROWS)
    try:
        rng = np.random.default_rng(3)
        tokens = [int(t) for t in rng.integers(100, model.n_vocab - 100, calibrate.N_ROWS)]
        probe = calibrate._Probe(ctx, batch, tokens, 0)
        p, n = calibrate.PREFIX, calibrate.N_ROWS
        ref = probe.run([(0, p), (p, n)])[p:]
        decodes = []
        real = ctx.decode
        ctx.decode = lambda b: (decodes.append(b.n), real(b))[1]
        assert not probe.matches([(q, q + 1) for q in range(p, n)], ref, keep=p)
        assert 1 <= len(decodes) < 8 and set(decodes) == {1}, decodes
        twos = [(q, q + 2) for q in range(p, n, 2)]  # Q4_1 on CPU: chunks of 2+ rows are exact
        decodes.clear()
        assert probe.matches(twos, ref, keep=p)
        assert decodes == [2] * len(twos)
        bad = ref.copy()
        bad[-1, 0] += 1.0
        assert not probe.matches(twos, bad, keep=p)
    finally:
        batch.close()
        ctx.close()
        model.close()
