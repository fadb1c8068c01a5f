"""Shared fixtures: the embedded model, engines, and the from-scratch oracle."""

from __future__ import annotations

import numpy as np
import pytest

from nbkv.backend import Batch, Context
from nbkv.models import default_model_path

# a system prompt of ~150 tokens, so that salvage thresholds (100 tokens) matter
SYSTEM = (
    "You are a patient tutor who explains how computers work to curious beginners. "
    "Always answer in plain English, in at most three short sentences, and use one concrete "
    "everyday example when it helps. Never use jargon without explaining it first. If the "
    "question is ambiguous, state the interpretation you chose. If you do not know the answer, "
    "say so honestly instead of guessing. Keep a friendly tone, avoid lists unless the user "
    "asks for one, and do not repeat the question back to the user. When numbers are "
    "involved, show the arithmetic in one line so the learner can check it."
)

QUESTIONS = [
    "What is a CPU?",
    "And what does memory do?",
    "Why is a cache faster than memory?",
    "How many bytes are in a kilobyte?",
    "What is a GPU good at?",
    "Summarize our talk in one sentence.",
]

MAX_TOKENS = 12


@pytest.fixture(scope="session")
def model_path():
    return str(default_model_path())


def scratch_reply(model_path, messages, template=None, max_tokens=MAX_TOKENS):
    """The oracle: the same request in a brand-new engine (fresh context, nothing cached)."""
    from nbkv import Engine

    with Engine(model_path, n_slots=1, n_ctx=2048, cache="off", template=template) as e:
        return e.chat(messages, max_tokens=max_tokens, temperature=0).text


def assert_consistent(engine):
    """Every slot's KV holds exactly its recorded tokens, and no slot is left pending.

    Read on the scheduler thread between two steps: the engine rewrites finished replies
    in the background, so a read from this thread could fall between a trim and its record.
    """
    def read():
        return [(s, engine.ctx.seq_pos_min(s.seq_id), engine.ctx.seq_pos_max(s.seq_id))
                for s in engine.slots()]
    for s, lo, hi in engine._call(read):
        assert not s.pending, f"slot {s.index} left pending"
        assert hi + 1 == s.n_tokens - s.rewriting, f"slot {s.index} KV mismatch"
        if s.memory == "plain":
            assert lo == (0 if s.n_tokens else -1)


def fresh_probe(model, tokens, probe):
    """Logits of ``probe`` after ``tokens``, decoded from scratch (never a lone-token batch)."""
    seq = list(tokens) + [probe, probe]
    target = len(tokens)
    cuts = list(range(0, len(seq), 200)) + [len(seq)]
    if cuts[-1] - cuts[-2] == 1:
        cuts[-2] -= 1
    ctx, batch = Context(model, 2048, 1, 256), Batch(256)
    try:
        for a, z in zip(cuts, cuts[1:]):
            batch.clear()
            for j in range(a, z):
                batch.add(seq[j], j, 0, j == target)
            ctx.decode(batch)
            if a <= target < z:
                out = np.array(ctx.logits(target - a))
        return out
    finally:
        batch.close()
        ctx.close()
