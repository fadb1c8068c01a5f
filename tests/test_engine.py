"""The engine on the real SmolLM2 model: cached replies must equal from-scratch replies."""

from __future__ import annotations

import os
import signal
import threading
import warnings

import numpy as np
import pytest

from conftest import MAX_TOKENS, QUESTIONS, SYSTEM, assert_consistent, scratch_reply
from nbkv import Engine
from nbkv.core.errors import ContextOverflowError, InvalidRequestError, NbkvError, TemplateError
from nbkv.core.events import GENERATED, PREFILLED, REUSED, Progress, RequestFinished
from nbkv.kv import policy
from nbkv.ui.figures import summary


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=2048) as e:
        yield e


def user(text):
    return {"role": "user", "content": text}


def test_six_turn_conversation_matches_scratch_and_prefills_only_new_tokens(engine, model_path):
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}]
    records = []
    for q in QUESTIONS:
        msgs.append(user(q))
        res = engine.chat(msgs, session="six", max_tokens=MAX_TOKENS, temperature=0)
        assert res.text == scratch_reply(model_path, msgs), f"turn {len(records) + 1} differs"
        records.append(res.record)
        msgs.append(res.message)
        assert_consistent(engine)
    assert records[0].strategy == policy.MISS and records[0].reused_tokens == 0
    for r, q in zip(records[1:], QUESTIONS[1:]):
        assert r.strategy == policy.HASH_EXTEND
        # new user message + template glue (+ the reply's closing token), never the history
        new = len(engine.model.tokenize(q))
        assert r.prefilled_tokens <= new + 12, (r.prefilled_tokens, new)
        assert r.reply_tokens_cached > 0
        assert r.salvage_pct > 80
    assert records[-1].prompt_tokens > records[1].prompt_tokens
    # the KV map covers the prompt and the reply
    seg = records[-1].segments
    assert seg[0].start == 0 and seg[0].state == REUSED
    assert {s.state for s in seg} == {REUSED, PREFILLED, GENERATED}
    assert all(a.end == b.start for a, b in zip(seg, seg[1:]))


def test_three_sessions_on_two_slots_evict_and_still_match(engine, model_path):
    engine.clear()
    convs = {name: [{"role": "system", "content": f"You are assistant {name}. " + SYSTEM}]
             for name in ("A", "B", "C")}
    evictions = []
    for rnd in range(2):
        for name, msgs in convs.items():
            msgs.append(user(QUESTIONS[rnd]))
            res = engine.chat(msgs, session=name, max_tokens=MAX_TOKENS, temperature=0)
            assert res.text == scratch_reply(model_path, msgs)
            msgs.append(res.message)
            if res.record.evicted_session:
                evictions.append((name, res.record.evicted_session))
            assert_consistent(engine)
    assert evictions, "3 sessions on 2 slots must evict"
    assert all(a != b for a, b in evictions)
    assert len({s.session for s in engine.slots()}) == 2


def test_edited_earlier_message_salvages_the_prefix(engine, model_path):
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}]
    for q in QUESTIONS[:3]:
        msgs.append(user(q))
        msgs.append(engine.chat(msgs, session="edit", max_tokens=MAX_TOKENS, temperature=0).message)
    edited = msgs[:3] + [user("What does a hard disk do?")]
    res = engine.chat(edited, session="edit", max_tokens=MAX_TOKENS, temperature=0)
    assert res.text == scratch_reply(model_path, edited)
    r = res.record
    assert r.strategy == policy.HASH_EXTEND and r.matched_messages == 3
    assert r.trimmed_tokens > 0 and r.reused_tokens > 150
    assert_consistent(engine)


def test_regenerating_the_same_request_is_a_pure_hit(engine, model_path):
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}, user(QUESTIONS[0])]
    first = engine.chat(msgs, session="regen", max_tokens=MAX_TOKENS, temperature=0)
    again = engine.chat(msgs, session="regen", max_tokens=MAX_TOKENS, temperature=0)
    assert again.text == first.text
    assert again.record.strategy == policy.HASH_HIT
    # only the last two prompt tokens: their logits, and never a lone-token prefill
    assert again.record.prefilled_tokens == 2
    assert again.record.trimmed_tokens > 0  # the previous reply was cut off


def test_streaming_deltas_join_to_the_text(engine):
    msgs = [{"role": "system", "content": SYSTEM}, user("Say hello in French.")]
    stream = engine.chat(msgs, stream=True, max_tokens=10, temperature=0)
    deltas = list(stream)
    assert "".join(deltas) == stream.text and stream.record.generated_tokens >= 1
    assert stream.finish_reason in ("stop", "length")


def test_stop_strings_and_max_tokens(engine):
    msgs = [{"role": "system", "content": SYSTEM}, user("Count from 1 to 20, comma separated.")]
    full = engine.chat(msgs, max_tokens=30, temperature=0)
    assert full.record.generated_tokens <= 30
    assert len(full.text) > 4
    stop = full.text[3:5]
    cut = engine.chat(msgs, max_tokens=30, temperature=0, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    one = engine.chat(msgs, max_tokens=1, temperature=0)
    assert one.finish_reason == "length" and one.record.generated_tokens == 1


def test_sampling_with_seed_is_reproducible(engine):
    msgs = [{"role": "system", "content": SYSTEM}, user("Tell me a story.")]
    kw = dict(max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02,
              repeat_penalty=1.1, seed=1234)
    a = engine.chat(msgs, **kw).text
    b = engine.chat(msgs, **kw).text
    assert a == b
    others = {engine.chat(msgs, **{**kw, "seed": s}).text for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_bad_requests_raise_clear_errors_and_change_nothing(engine):
    before, history = engine.slots(), engine.history
    with pytest.raises(InvalidRequestError, match="role"):
        engine.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.chat([])
    with pytest.raises(InvalidRequestError, match="unknown sampling"):
        engine.chat([user("hi")], temprature=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        engine.chat([user("hi")], top_p=0)
    with pytest.raises(InvalidRequestError):
        engine.clear(slot=99)
    # the session names the conversation; the timeout is seconds a request may wait
    for bad, match in ((dict(session=3), "session must be a non-empty str or None, not 3"),
                       (dict(session=""), "session must be a non-empty str"),
                       (dict(timeout=0), "timeout must be a number of seconds > 0"),
                       (dict(timeout=-1.5), "not -1.5"), (dict(timeout="5"), "not '5'"),
                       (dict(timeout=True), "not True")):
        with pytest.raises(InvalidRequestError, match=match):
            engine.chat([user("hi")], **bad)
    # chat_many checks every conversation's before it sends the first
    with pytest.raises(InvalidRequestError, match="session must be"):
        engine.chat_many([[user("hi")], [user("ho")]], sessions=["a", 7])
    with pytest.raises(InvalidRequestError, match="timeout must be"):
        engine.chat_many([[user("hi")], [user("ho")]], timeout=-1)
    for slot in (99, -1, True, "0"):  # probe(slot) names a slot, or says which there are
        with pytest.raises(InvalidRequestError, match="no slot .*: slots are 0..1"):
            engine.probe(slot, 42)
    assert engine.slots() == before and engine.history == history


def test_template_errors(model_path):
    raising = "{{ raise_exception('no system messages allowed') }}"
    with Engine(model_path, n_slots=1, n_ctx=512, template=raising) as e:
        with pytest.raises(TemplateError, match="no system messages allowed"):
            e.chat([user("hi")])
        assert_consistent(e)
    with pytest.raises(TemplateError, match="compile"):
        Engine(model_path, n_slots=1, n_ctx=512, template="{% for %}")


def test_overflow_raises_with_figures_or_slides(model_path):
    long_msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        long_msgs.append(user(f"Question {i}: " + "tell me about the history of computing. " * 4))
        long_msgs.append({"role": "assistant", "content": "Computing started with " * 6})
    long_msgs.append(user("And now?"))
    with Engine(model_path, n_slots=1, n_ctx=256) as e:
        with pytest.raises(ContextOverflowError) as info:
            e.chat(long_msgs)
        assert info.value.capacity == 256 and info.value.prompt_tokens > 256
        assert "256" in str(info.value)
        assert_consistent(e)
        res = e.chat(long_msgs, overflow="slide", max_tokens=8, temperature=0)
        assert res.record.dropped_messages > 0
        assert res.record.prompt_tokens + 8 <= 256
        assert_consistent(e)


def test_interrupt_mid_generation_keeps_the_slot_consistent(engine, model_path):
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}, user("Explain what a compiler does.")]
    stream = engine.chat(msgs, session="int", stream=True, max_tokens=40, temperature=0)
    got = []
    with pytest.raises(KeyboardInterrupt):
        with stream:
            for d in stream:
                got.append(d)
                if len(got) == 3:
                    raise KeyboardInterrupt
    assert stream.record.finish_reason == "cancelled"
    assert_consistent(engine)
    slot = engine.slots()[stream.record.slot]
    assert slot.n_tokens >= stream.record.prompt_tokens  # the prompt and some reply stay cached
    follow = msgs + [{"role": "assistant", "content": stream.text}, user("Shorter please.")]
    res = engine.chat(follow, session="int", max_tokens=MAX_TOKENS, temperature=0)
    assert res.text == scratch_reply(model_path, follow)
    assert res.record.reused_tokens >= stream.record.prompt_tokens


def test_interrupt_mid_prefill_keeps_the_decoded_part(model_path):
    long_sys = SYSTEM + " " + " ".join(f"Rule {i}: be accurate about topic {i}." for i in range(60))
    msgs = [{"role": "system", "content": long_sys}, user("What is a bit?")]
    with Engine(model_path, n_slots=1, n_ctx=2048, n_batch=64) as e:
        fired = threading.Event()

        def interrupt(ev):
            if isinstance(ev, Progress) and ev.phase == "rebuild" and not fired.is_set():
                fired.set()
                os.kill(os.getpid(), signal.SIGINT)  # what a notebook's interrupt button does

        unsub = e.subscribe(interrupt)
        stream = e.chat(msgs, stream=True, max_tokens=8, temperature=0)
        with pytest.raises(KeyboardInterrupt):
            for _ in stream:
                pass
        unsub()
        assert fired.is_set() and stream.record.finish_reason == "cancelled"
        assert_consistent(e)
        partial = e.slots()[0].n_tokens
        assert 0 < partial < stream.record.prompt_tokens
        res = e.chat(msgs, max_tokens=MAX_TOKENS, temperature=0)
        assert res.record.reused_tokens == partial
        assert res.text == scratch_reply(model_path, msgs)
        assert_consistent(e)


def test_events_and_history(engine):
    seen = []
    unsub = engine.subscribe(seen.append)
    engine.subscribe(lambda ev: 1 / 0)  # a broken subscriber must not break the engine
    msgs = [{"role": "system", "content": SYSTEM}, user("What is RAM?")]
    res = engine.chat(msgs, session="ev", max_tokens=4, temperature=0)
    unsub()
    finished = [e for e in seen if isinstance(e, RequestFinished)]
    assert finished and finished[-1].record == res.record
    assert engine.history[-1] == res.record
    r = res.record
    assert r.prompt_tokens == r.reused_tokens + r.prefilled_tokens
    assert r.ttft_s > 0 and r.finish_reason in ("stop", "length")
    assert "reused" in summary(r)
    stats = engine.stats()
    assert stats["requests"] >= 1 and 0 <= stats["salvage_pct"] <= 100


def test_clear_one_slot_and_all(engine):
    engine.chat([user("hello")], session="c1", max_tokens=2)
    idx = next(s.index for s in engine.slots() if s.session == "c1")
    engine.clear(idx)
    assert engine.slots()[idx].empty
    engine.clear()
    assert all(s.empty for s in engine.slots())
    assert_consistent(engine)


def test_spc_and_imc_are_exclusive(model_path):
    with pytest.raises(InvalidRequestError, match="mutually exclusive"):
        Engine(model_path, cache="imc", system_prompt_cache=True)
    with pytest.raises(InvalidRequestError):
        Engine(model_path, cache="both")


@pytest.mark.parametrize("bad, match", [
    (dict(n_batch=1), "n_batch must be an integer >= 2, not 1"),
    (dict(n_batch=True), "n_batch must be an integer >= 2, not True"),  # a bool is no count
    (dict(n_batch=64.0), "n_batch must be an integer"),
    (dict(n_threads=0), "n_threads must be an integer >= 1 or None, not 0"),
    (dict(cache_min_tokens=-1), "cache_min_tokens must be an integer >= 0"),
    (dict(spc_max_entries=0), "spc_max_entries must be an integer >= 1"),
    (dict(max_checkpoints=-1), "max_checkpoints must be an integer >= 0"),
    (dict(wait_timeout=0), "wait_timeout must be a number of seconds > 0, not 0"),
    (dict(wait_timeout=False), "wait_timeout must be a number of seconds > 0, not False"),
    (dict(history_size=0), "history_size must be an integer >= 1"),
    (dict(history_size=None), "history_size must be an integer >= 1, not None"),
    (dict(n_slots=0), "n_slots must be an integer >= 1 or None, not 0"),
    (dict(n_ctx="4096"), "n_ctx must be an integer"),
])
def test_engine_arguments_are_checked_before_the_model_loads(tmp_path, bad, match):
    missing = str(tmp_path / "no-model.gguf")  # loading it would raise ModelNotFoundError
    with pytest.raises(InvalidRequestError, match=match):
        Engine(missing, **bad)


def test_the_least_engine_arguments_work(model_path):
    """The lower bounds are real: the least accepted values serve a request."""
    with warnings.catch_warnings():  # n_batch 2 is too small to prove the cache exact
        warnings.simplefilter("ignore", UserWarning)
        e = Engine(model_path, n_slots=1, n_ctx=256, n_batch=2, cache_min_tokens=0,
                   spc_max_entries=1, max_checkpoints=0, wait_timeout=0.5, history_size=1)
    with e:
        for q in ("hi", "ho"):
            assert e.chat([user(q)], max_tokens=2, temperature=0).record.generated_tokens
        assert len(e.history) == 1


def test_closed_engine_refuses_work(model_path):
    e = Engine(model_path, n_slots=1, n_ctx=256)
    e.close()
    with pytest.raises(NbkvError, match="closed"):
        e.chat([user("hi")])
    e.close()  # idempotent


@pytest.fixture
def idle_rewrite(model_path):
    """An engine that rewrites replies only in idle time (no mixed steps)."""
    with Engine(model_path, n_slots=2, n_ctx=2048, rewrite="idle") as e:
        yield e


def test_a_turn_arriving_before_the_rewrite_reprefills_the_reply_and_stays_exact(
        idle_rewrite, model_path):
    from conftest import fresh_probe
    from nbkv.core.events import SlotRewritten

    engine = idle_rewrite
    msgs = [{"role": "system", "content": SYSTEM}, user(QUESTIONS[0])]
    first, follow, rewrites = [], {}, []

    def on_event(ev):  # on the scheduler thread, before it can go idle and rewrite
        if isinstance(ev, RequestFinished) and ev.record.session == "rush" and not follow:
            reply = first[0]._job.text.text  # the whole reply, known to the engine by now
            follow["msgs"] = msgs + [{"role": "assistant", "content": reply},
                                     user(QUESTIONS[1])]
            follow["stream"] = engine.chat(follow["msgs"], session="rush", stream=True,
                                           max_tokens=MAX_TOKENS, temperature=0)
        if isinstance(ev, SlotRewritten):
            rewrites.append(ev)

    unsubscribe = engine.subscribe(on_event)
    try:
        first.append(engine.chat(msgs, session="rush", stream=True, max_tokens=MAX_TOKENS,
                                 temperature=0))
        first[0].result()
        second = follow["stream"].result()
        engine.settle()
    finally:
        unsubscribe()
    rec = second.record
    assert rec.strategy == policy.HASH_EXTEND
    assert rec.rewrite_absorbed > 0  # the reply was re-prefilled, not served as decoded
    assert second.text == scratch_reply(model_path, follow["msgs"])
    assert [r.request_id for r in rewrites] == [rec.id]  # the first reply's was never needed
    assert rewrites and all(r.tokens >= 2 and r.seconds > 0 for r in rewrites)
    s = next(s for s in engine.slots() if s.session == "rush")
    assert s.settled == s.n_tokens
    assert np.array_equal(np.array(engine.probe(s.index, 42)),
                          fresh_probe(engine.model, s.tokens, 42))


def test_a_reply_longer_than_n_batch_is_rewritten_without_a_lone_token(model_path):
    """The rewrite cuts a reply into chunks of at most n_batch, never leaving one position for
    a last chunk (a one-row decode rounds differently): 5 positions go as 3 + 2."""
    from conftest import fresh_probe

    with Engine(model_path, n_slots=1, n_ctx=1024, n_batch=4, n_threads=1) as e:
        rows = []
        decode = e.ctx.decode

        def logged(batch):  # prompt chunks and rewrites ask no logits until the prompt's end
            raw = batch.raw
            rows.append((batch.n, any(raw.logits[i] for i in range(batch.n))))
            return decode(batch)

        e.ctx.decode = logged
        msgs = [{"role": "system", "content": SYSTEM}, user(QUESTIONS[0])]
        r = e.chat(msgs, max_tokens=6, temperature=0)
        e.settle()
        e.ctx.decode = decode
        assert r.record.finish_reason == "length"  # 5 reply positions in KV to rewrite
        assert (1, False) not in rows
        s = e.slots()[0]
        assert s.settled == s.n_tokens
        assert np.array_equal(np.array(e.probe(s.index, 42)),
                              fresh_probe(e.model, s.tokens, 42))


def test_exact_false_keeps_the_token_by_token_kv(model_path):
    with Engine(model_path, n_slots=1, n_ctx=1024, exact=False) as e:
        msgs = [{"role": "system", "content": SYSTEM}, user(QUESTIONS[0])]
        first = e.chat(msgs, session="x", max_tokens=MAX_TOKENS, temperature=0)
        # the first turn takes the same path with or without the rewrite
        assert first.text == scratch_reply(model_path, msgs)
        e.settle()  # nothing to do: exact=False never rewrites
        s = e.slots()[0]
        assert s.settled < s.n_tokens and s.n_tokens == first.record.prompt_tokens + \
            first.record.generated_tokens - (first.record.finish_reason == "length")
        nxt = msgs + [first.message, user(QUESTIONS[1])]
        second = e.chat(nxt, session="x", max_tokens=MAX_TOKENS, temperature=0)
        assert second.record.rewrite_absorbed == 0
        assert second.record.reused_tokens > first.record.prompt_tokens  # the reply too
        assert_consistent(e)
