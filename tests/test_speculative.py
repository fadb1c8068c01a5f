"""Guesses in the second decode position (exact mode): same replies, two tokens per decode."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SYSTEM, assert_consistent, fresh_probe
from nbkv import Engine

# a reply that quotes the conversation: prompt-lookup guesses get accepted
ECHO = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Copy this sentence exactly, nothing else: the quick brown "
                                "fox jumps over the lazy dog near the old stone bridge."},
]


@pytest.fixture(scope="module")
def engines(model_path):
    with Engine(model_path, n_slots=2, n_ctx=1024) as on, \
            Engine(model_path, n_slots=2, n_ctx=1024, speculative=False) as off:
        yield on, off


def two_turns(engine, **sampling):
    msgs = [dict(m) for m in ECHO]
    first = engine.chat(msgs, session="echo", max_tokens=24, **sampling)
    msgs += [first.message, {"role": "user", "content": "Now copy it once more."}]
    second = engine.chat(msgs, session="echo", max_tokens=24, **sampling)
    return [first, second]


def test_greedy_replies_equal_without_guesses_and_guesses_pay(engines):
    on, off = engines
    with_guesses, without = two_turns(on, temperature=0), two_turns(off, temperature=0)
    assert [r.text for r in with_guesses] == [r.text for r in without]
    recs = [r.record for r in with_guesses]
    assert sum(r.draft_accepted for r in recs) >= 5  # the echo is guessed right
    assert all(0 <= r.draft_accepted <= r.draft_tokens for r in recs)
    assert all(r.draft_tokens == 0 for r in (r.record for r in without))
    assert "guesses" in recs[0].summary()
    stats = on.stats()
    assert stats["draft_accepted"] == sum(r.draft_accepted for r in recs)
    assert 0 < stats["draft_acceptance_pct"] <= 100
    for e in engines:
        assert_consistent(e)


def test_seeded_sampling_is_unchanged_by_guesses(engines):
    on, off = engines
    kw = dict(temperature=0.9, top_k=20, seed=11)
    assert [r.text for r in two_turns(on, **kw)] == [r.text for r in two_turns(off, **kw)]


def test_kv_after_accepted_guesses_equals_a_fresh_decode(engines):
    on, _ = engines
    on.clear()
    recs = [r.record for r in two_turns(on, temperature=0)]
    assert sum(r.draft_accepted for r in recs) > 0
    assert_consistent(on)
    slot = next(s for s in on.slots() if s.session == "echo")
    cached = np.array(on.probe(slot.index, 42))
    assert np.array_equal(cached, fresh_probe(on.model, slot.tokens, 42))
