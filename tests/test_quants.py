"""Exact on the weights people download: K-quants and IQ-quants, proven at load.

SmolLM2 re-quantized with ``llama_model_quantize`` (``nbkv.fixtures.quantized``, cached).
Each weight type is calibrated for real (``calibration="fresh"``), then a conversation with
an eviction, a copied prefix and an edit must give the replies of a cache-off engine, and
every slot must verify bit-identical (probe logits against a from-scratch decode). Q4_K_M,
the most downloaded type and the one with the strictest grouping here, gets the long reply,
concurrent sessions, the system prompt cache and an image.
"""

from __future__ import annotations

import pytest

from conftest import SYSTEM, assert_consistent, picture
from nbkv import Engine
from nbkv.fixtures import make_mmproj, quantized
from nbkv.kv import calibrate
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.models import default_model_path
from nbkv.ui.figures import summary

MAX = 12
TYPES = ("Q4_K_M", pytest.param("Q5_K_M", marks=pytest.mark.slow),
         pytest.param("Q6_K", marks=pytest.mark.slow), "IQ4_NL",
         pytest.param("Q4_0", marks=pytest.mark.slow), pytest.param("Q8_0", marks=pytest.mark.slow))


def user(text):
    return {"role": "user", "content": text}


@pytest.fixture(scope="module", params=TYPES)
def path(request):
    return str(quantized(default_model_path(), request.param))


@pytest.fixture(scope="module")
def engine(path):
    with Engine(path, n_slots=2, n_ctx=2048, cache_min_tokens=20, calibration="fresh") as e:
        yield e


def scratch(path, messages, max_tokens=MAX):
    with Engine(path, n_slots=1, n_ctx=2048, cache="off") as e:
        return e.chat(messages, max_tokens=max_tokens, temperature=0).text


def assert_verified(engine):
    results = engine.verify()
    assert results and all(v.identical for v in results), [str(v) for v in results]
    assert_consistent(engine)


def test_calibration_proves_a_grouping_that_explains_its_table(engine):
    rule = engine.prefill_rule
    assert rule.exact, rule.reason
    table = dict(rule.table)
    assert table[rule.threshold] if rule.threshold in table else True
    # every measured size the rule allows was measured equal
    assert all(ok for k, ok in table.items() if k >= rule.threshold and k % rule.align == 0)
    assert engine.model.exactness.startswith("exact: yes")
    # a reply rewritten while it is generated, in a shadow sequence, is exact (mixed steps)
    assert rule.mixed and "mixed steps: yes" in engine.model.exactness
    print(engine.model.path.name, rule.describe(), "gen_rows", rule.gen_rows, table,
          f"{rule.seconds:.2f} s")


def test_back_to_back_replies_rewritten_while_generated_are_exact(path):
    """Mixed steps on this weight type: the reply's rows go into the shadow in canonical
    chunks while it is generated; the next turn re-reads only the last chunk's worth."""
    from nbkv.engine.rewrite import SHADOW_CHUNK

    with Engine(path, n_slots=1, n_ctx=1024, rewrite="mixed") as e:
        msgs = [{"role": "system", "content": SYSTEM}, user("Tell me a story about a CPU.")]
        first = e.chat(msgs, session="m", max_tokens=3 * SHADOW_CHUNK, temperature=0)
        assert first.record.rewrite_mixed >= SHADOW_CHUNK
        msgs += [first.message, user("Give it a title.")]
        second = e.chat(msgs, session="m", max_tokens=MAX, temperature=0)
        assert second.text == scratch(path, msgs)
        rule = e.prefill_rule
        assert second.record.rewrite_absorbed <= SHADOW_CHUNK + rule.threshold + rule.align
        assert_verified(e)


def test_sessions_evictions_copies_and_an_edit_are_exact(engine, path):
    engine.clear()
    convs = {n: [{"role": "system", "content": SYSTEM}] for n in "ABC"}
    evictions = copies = 0
    for rnd, q in enumerate(["What is a CPU?", "And memory?"]):
        for name, msgs in convs.items():
            msgs.append(user(f"{q} ({name})"))
            res = engine.chat(msgs, session=name, max_tokens=MAX, temperature=0)
            assert res.record.exact
            assert res.text == scratch(path, msgs), (name, rnd)
            msgs.append(res.message)
            evictions += res.record.evicted_session is not None
            copies += res.record.donor_slot is not None
    assert evictions and copies
    edited = convs["C"][:2] + [convs["C"][2], user("What does a disk do? (C)")]
    res = engine.chat(edited, session="C", max_tokens=MAX, temperature=0)
    assert res.text == scratch(path, edited)
    assert res.record.reused_tokens > 100
    assert_verified(engine)


def test_a_probe_between_turns_leaves_the_slot_exact(engine, path):
    """verify() puts a slot back by prefilling its tail again: from a canonical start.

    Q4_K_M needs chunks of 8+ rows; a 30-token prompt probed at 24 once re-read rows 24-29
    as a 6-row chunk, and the next turn, reusing them, was no longer exact.
    """
    engine.clear()
    msgs = [{"role": "system", "content": "You are a pirate. Answer in one short sentence."},
            user("What is a CPU?")]
    for follow_up in ("And memory?", None):
        res = engine.chat(msgs, session="p", max_tokens=1, temperature=0)
        assert res.text == scratch(path, msgs, max_tokens=1)
        assert_verified(engine)
        if follow_up:
            msgs += [{"role": "assistant", "content": "A CPU is a computer"}, user(follow_up)]


def q4km(path):
    if "Q4_K_M" not in path:
        pytest.skip("Q4_K_M only")


def test_a_long_reply_after_an_eviction_equals_the_fresh_one(engine, path):
    q4km(path)
    engine.clear()
    story = [{"role": "system", "content": SYSTEM},
             user("Tell me a long story about a librarian who collects forgotten words.")]
    for name in ("x", "y", "z"):  # z evicts x
        engine.chat([{"role": "system", "content": SYSTEM}, user(f"Hello from {name}")],
                    session=name, max_tokens=4, temperature=0)
    res = engine.chat(story, session="x", max_tokens=220, temperature=0)
    assert res.record.generated_tokens >= 200
    assert res.text == scratch(path, story, max_tokens=220)
    follow = story + [res.message, user("Give it a title.")]
    assert engine.chat(follow, session="x", max_tokens=MAX, temperature=0).text == \
        scratch(path, follow)
    assert_verified(engine)


def test_concurrent_sessions_split_generation_where_the_kernels_need_it(path):
    q4km(path)
    convs = [[{"role": "system", "content": f"You are agent {i}. " + SYSTEM},
              user(f"Agent {i}: name one thing about CPUs.")] for i in range(4)]
    with Engine(path, n_slots=4, n_ctx=1024) as e:
        alone = [e.chat(c, session=f"s{i}", max_tokens=MAX, temperature=0).text
                 for i, c in enumerate(convs)]
        e.clear()
        together = [r.text for r in e.chat_many(convs, [f"s{i}" for i in range(4)],
                                                 max_tokens=MAX, temperature=0)]
        assert together == alone
        assert_verified(e)


def test_spc_entries_are_captured_on_the_grid(path):
    q4km(path)
    with Engine(path, n_slots=2, n_ctx=1024, cache="spc", cache_min_tokens=20) as e:
        for q in ("What is a CPU?", "What is a GPU?", "What is RAM?"):
            msgs = [{"role": "system", "content": SYSTEM}, user(q)]
            res = e.chat(msgs, max_tokens=MAX, temperature=0)
            assert res.text == scratch(path, msgs)
        assert res.record.strategy == "spc" and res.record.reused_tokens > 100
        assert_verified(e)


def test_an_image_with_a_k_quant_text_model_is_exact(path):
    q4km(path)
    text = path  # SmolLM2 Q4_K_M: LLaVA-style, with a generated mlp projector
    mmproj = str(make_mmproj(kind="tiny", projector="mlp", text_width=576))
    img = {"type": "image", "image": picture(3)}
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [img, {"type": "text", "text": "What is this?"}]}]
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=1024) as e:
        assert e.prefill_rule.exact
        first = e.chat(msgs, max_tokens=8, temperature=0)
        msgs += [first.message, user("And the colours?")]
        second = e.chat(msgs, max_tokens=8, temperature=0)
        assert second.record.encoder_runs == 0 and second.record.media_reused == 1
        assert_verified(e)
        with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=1024, cache="off") as f:
            assert f.chat(msgs, max_tokens=8, temperature=0).text == second.text


def test_without_a_proven_grouping_records_say_not_exact(monkeypatch):
    failed = PrefillRule(2, 1, exact=False, reason="faked: no grouping reproduced a batch")
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: failed)
    with pytest.warns(UserWarning, match="cannot prove cached replies exact"):
        e = Engine(None, n_slots=1, n_ctx=1024, calibration="fresh")
    with e:
        assert e.model.exactness == "exact: no (faked: no grouping reproduced a batch)"
        res = e.chat([user("Hi")], max_tokens=4, temperature=0)
        assert res.record.exact is False
        assert "not proven exact" in summary(res.record)
        from nbkv.ui.display import status_table

        assert "faked: no grouping" in status_table(e).text()
    # the fake result was cached: measure the real one again for the other tests
    monkeypatch.undo()
    with Engine(None, n_slots=1, n_ctx=1024, calibration="fresh") as e:
        assert e.prefill_rule.exact


def test_verify_finds_the_first_difference_of_a_slot_that_was_not_rewritten(path):
    """exact=False keeps the reply's token-by-token KV: verify() says so, and where."""
    q4km(path)
    with Engine(path, n_slots=1, n_ctx=1024, exact=False) as e:
        msgs = [{"role": "system", "content": SYSTEM}, user("What is a CPU?")]
        res = e.chat(msgs, max_tokens=24, temperature=0)
        (v,) = e.verify()
        assert not v.identical and not v.claimed and v.max_diff > 0
        lo, hi = v.first_diff
        # exact=False takes the lean path: the prompt went in one batch, not canonical chunks,
        # so nothing of the slot is proven and the first difference may lie in the prompt too
        assert res.record.path == "lean" and not res.record.exact
        assert 0 <= lo < hi <= len(e.slots()[0].tokens)
        assert "differs" in str(v)
