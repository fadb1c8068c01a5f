"""Prompt-lookup guesses (speculative=True): checked against the sampled token, KV exact."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SYSTEM, assert_consistent, fresh_probe
from nbkv import Engine
from nbkv.ui.figures import summary

# a reply that quotes the conversation: prompt-lookup guesses get accepted
ECHO = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Copy this sentence exactly, nothing else: the quick brown "
                                "fox jumps over the lazy dog near the old stone bridge."},
]


@pytest.fixture(scope="module")
def engines(model_path):
    with Engine(model_path, n_slots=2, n_ctx=1024, speculative=True) as on, \
            Engine(model_path, n_slots=2, n_ctx=1024) as off:
        yield on, off


def two_turns(engine, **sampling):
    msgs = [dict(m) for m in ECHO]
    first = engine.chat(msgs, session="echo", max_tokens=24, **sampling)
    msgs += [first.message, {"role": "user", "content": "Now copy it once more."}]
    second = engine.chat(msgs, session="echo", max_tokens=24, **sampling)
    return [first, second]


def fresh_reply(model_path, messages, **sampling):
    with Engine(model_path, n_slots=1, n_ctx=1024, cache="off", speculative=True) as e:
        return e.chat(messages, max_tokens=24, **sampling).text


def test_cached_replies_with_guesses_equal_fresh_ones_and_guesses_pay(engines, model_path):
    # A token decoded beside its guess is a two-row decode, which llama.cpp's CPU kernels
    # round differently from a one-row decode: replies with guesses are compared with
    # replies with guesses computed from scratch, not with replies without guesses.
    on, off = engines
    on.clear()
    with_guesses = two_turns(on, temperature=0)
    msgs = [dict(m) for m in ECHO]
    assert with_guesses[0].text == fresh_reply(model_path, msgs, temperature=0)
    msgs += [with_guesses[0].message, {"role": "user", "content": "Now copy it once more."}]
    assert with_guesses[1].record.reused_tokens > 100
    assert with_guesses[1].text == fresh_reply(model_path, msgs, temperature=0)
    recs = [r.record for r in with_guesses]
    assert sum(r.draft_accepted for r in recs) >= 5  # the echo is guessed right
    assert all(0 <= r.draft_accepted <= r.draft_tokens for r in recs)
    without = two_turns(off, temperature=0)
    assert all(r.record.draft_tokens == 0 for r in without)
    assert "guessed" in summary(recs[0])
    stats = on.stats()
    assert stats["draft_accepted"] == sum(r.draft_accepted for r in recs)
    assert 0 < stats["draft_acceptance_pct"] <= 100
    for e in engines:
        assert_consistent(e)


def test_seeded_sampling_with_guesses_is_reproducible(engines):
    on, _ = engines
    kw = dict(temperature=0.9, top_k=20, seed=11)
    on.clear()
    first = [r.text for r in two_turns(on, **kw)]
    on.clear()
    assert [r.text for r in two_turns(on, **kw)] == first


def test_kv_after_accepted_guesses_equals_a_fresh_decode(engines):
    on, _ = engines
    on.clear()
    recs = [r.record for r in two_turns(on, temperature=0)]
    assert sum(r.draft_accepted for r in recs) > 0
    assert_consistent(on)
    slot = next(s for s in on.slots() if s.session == "echo")
    cached = np.array(on.probe(slot.index, 42))
    assert np.array_equal(cached, fresh_probe(on.model, on.slots()[slot.index].tokens, 42))
