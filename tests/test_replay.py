"""Replay: the same prompt and deterministic settings again get the reply the cache holds.

The book of replies with no model, then the real SmolLM2: a replayed reply equals a
from-scratch decode, nothing is read, decoded or cut, the later turns' KV stays and is
bit-identical to a fresh prefill; what may not be replayed is not.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import assert_consistent, scratch_reply
from nbkv import Engine
from nbkv.kv.replies import (
    TOKEN_DIGEST,
    ReplyBook,
    ReplyMemo,
    deterministic,
    digest,
    settings_key,
    text_digest,
)
from nbkv.llama.tokens import SamplingParams
from nbkv.media.units import MediaKey, MediaUnit
from nbkv.ui import vocabulary as vocab
from nbkv.ui.figures import ttft_parts

MAX = 8
SYSTEM = {"role": "system", "content": "You are a concise assistant."}


def user(text):
    return {"role": "user", "content": text}


# ------------------------------------------------------------------ the book, no model


def test_only_greedy_or_seeded_sampling_is_deterministic():
    assert deterministic(SamplingParams(temperature=0))
    assert deterministic(SamplingParams(temperature=0.8, seed=42))
    assert not deterministic(SamplingParams(temperature=0.8))  # a new seed every time
    # greedy ignores the sampler's other knobs; the stop conditions always count
    assert settings_key(SamplingParams(seed=1, top_k=5)) == settings_key(SamplingParams())
    assert settings_key(SamplingParams(max_tokens=9)) != settings_key(SamplingParams())
    assert settings_key(SamplingParams(stop=("x",))) != settings_key(SamplingParams())
    assert settings_key(SamplingParams(repeat_penalty=1.1)) != settings_key(SamplingParams())
    seeded = SamplingParams(temperature=0.8, seed=42)
    assert settings_key(seeded) != settings_key(dataclasses.replace(seeded, seed=43))


def memo_for(prompt, reply, held=None, **settings):
    params = SamplingParams(**settings)
    return ReplyMemo(digest(prompt), len(prompt), settings_key(params), tuple(reply),
                     len(reply) if held is None else held, "stop", 1), params


def test_a_reply_is_found_only_where_a_holder_still_holds_it():
    prompt, reply = [1, 2, 3, 4], [7, 8, 9]
    memo, params = memo_for(prompt, reply, held=2)  # the last token was never decoded
    book = ReplyBook()
    book.add(memo)
    later = [*prompt, 7, 8, 5, 6, 7]  # the prompt, the reply as in KV, then later turns
    assert book.find(prompt, params, [later]) == (memo, 2)
    assert book.find(prompt, params, [[9, 9], later]) == (memo, 2)  # any holder will do
    # the prompt alone (the slot was cut after it), or another way on: the same reply
    assert book.find(prompt, params, [prompt]) == (memo, 0)
    assert book.find(prompt, params, [[*prompt, 7, 6]]) == (memo, 1)
    assert book.find(prompt, params, [prompt[:3]]) is None  # the prompt is not all there
    # ... unless what is there is all the cache keeps of a prompt (a parked conversation)
    assert book.find(prompt, params, [prompt[:3]], need=3) == (memo, 0)
    assert book.find(prompt, params, [prompt[:2]], need=3) is None
    assert book.find(prompt, params, [[1, 2, 3, 5, 7, 8]]) is None  # another prompt
    assert book.find(prompt, SamplingParams(max_tokens=9), [later]) is None
    assert book.find(prompt, SamplingParams(temperature=0.5), [later]) is None
    assert book.find([1, 2, 3], params, [later]) is None  # a prefix is another prompt
    assert book.kept_by([prompt[:3], later]) == [memo] and book.kept_by([prompt[:3]]) == []
    # what cutting a holder back loses: a prompt it holds whole that ends after the cut
    assert book.cut_by(later, 3) == [memo] and book.cut_by(later, 4) == []
    assert book.cut_by(prompt[:3], 1) == [] and book.cut_by([1, 2, 3, 5, 7], 2) == []


def test_the_book_keeps_the_latest_replies_and_reads_back_its_json():
    book = ReplyBook(size=2)
    memos = [memo_for([i, i + 1], [i + 2])[0] for i in range(3)]
    for m in memos:
        book.add(m)
    assert len(book) == 2 and book.lookup([0, 1], SamplingParams()) is None
    seeded, params = memo_for([5, 6], [7], temperature=0.7, seed=3, stop=["."])
    assert ReplyMemo.from_json(json.loads(json.dumps(seeded.as_json())), n_vocab=100) == seeded
    assert book.lookup([5, 6], params) is None
    for bad in ({**seeded.as_json(), "held": 5}, {**seeded.as_json(), "tokens": [1, 500]},
                {**seeded.as_json(), "finish_reason": "error"}, {"prompt": "x"}, [1]):
        with pytest.raises(ValueError):
            ReplyMemo.from_json(bad, n_vocab=100)


def test_a_reply_from_an_older_save_hashed_as_text_is_still_found():
    """Saves made before token prompts were hashed as 8-byte integers hash them as text: such
    a memo is kept by the next save and found (then keyed the new way); images stay text."""
    prompt, reply = [1, 2, 3, 4], [7, 8]
    memo, params = memo_for(prompt, reply, held=2)
    assert memo.prompt.startswith(TOKEN_DIGEST) and memo.prompt != text_digest(prompt)
    old = dataclasses.replace(memo, prompt=text_digest(prompt))
    book = ReplyBook()
    book.imported([old])
    later = [*prompt, 7, 8, 5]
    assert book.kept_by([later]) == [old] and book.cut_by(later, 2) == [old]
    assert book.find(prompt, params, [later]) == (memo, 2)  # keyed the new way from now on
    assert book.kept_by([later]) == [memo] and len(book) == 1
    image = [1, MediaUnit(MediaKey("h", 0, 1, 1), 0), 2]
    assert digest(image) == text_digest(image)


# ------------------------------------------------------------------ the real engine


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=1024) as e:
        yield e


def talk(engine, session, questions, **kw):
    """A conversation of ``questions``; returns each turn's (messages sent, result)."""
    msgs, out = [SYSTEM], []
    for q in questions:
        msgs = msgs + [user(q)]
        r = engine.chat(msgs, session=session, max_tokens=MAX, temperature=0, **kw)
        out.append((msgs, r))
        msgs = msgs + [r.message]
    return out


def test_a_rerun_is_replayed_with_nothing_decoded_and_the_later_turns_kept(engine, model_path):
    engine.clear()
    turns = talk(engine, "rita", ["What is a CPU?", "And memory?", "And a disk?"])
    slot = next(s for s in engine.slots() if s.session == "rita")
    held = slot.tokens
    for i, (msgs, first) in enumerate(turns):  # "Run All" again
        again = engine.chat(msgs, session="rita", max_tokens=MAX, temperature=0, replay=True)
        r = again.record
        assert again.text == first.text and again.finish_reason == first.finish_reason
        assert (r.reason, r.prefilled_tokens, r.generated_tokens, r.trimmed_tokens) == (
            "replayed", 0, 0, 0)
        assert r.reused_tokens == r.prompt_tokens and r.slot == slot.index
        assert r.replayed_tokens == first.record.generated_tokens and r.exact
        assert f"request #{first.record.id}" in r.reason_text
        assert engine.slots()[slot.index].tokens == held  # the later turns stay in KV
        if i == 0:  # the map: this request's prompt and reply reused, the later turns kept
            segs = engine.slots()[slot.index].segments
            n = r.prompt_tokens + r.replayed_tokens
            assert {s.state for s in segs if s.end < n} == {"reused"}
            assert {s.state for s in segs if s.start >= n} == {"kept"}
            assert segs[-1].end == len(held)
    # the replies are what a decode from scratch gives, and the kept KV is exact
    msgs, last = turns[-1]
    assert last.text == scratch_reply(model_path, msgs, max_tokens=MAX)
    assert [v.identical for v in engine.verify(slot.index)] == [True]
    assert_consistent(engine)


def test_what_is_not_replayed(engine):
    engine.clear()
    (msgs, first), = talk(engine, "omar", ["Name a colour."])
    settings = dict(session="omar", max_tokens=MAX, temperature=0)
    # not asked for; other stop conditions; a sampler that draws a new seed every time
    for kw in ({}, {"replay": True, "max_tokens": MAX - 1}, {"replay": True, "stop": ["e"]},
               {"replay": True, "temperature": 0.7}):
        r = engine.chat(msgs, **{**settings, **kw}).record
        assert r.reason != "replayed" and r.prefilled_tokens > 0, kw
    # the slot now holds the prompt and a sampled reply: the greedy reply is the same
    # still (it depends on the prompt alone), and the slot keeps what it holds
    held = next(s for s in engine.slots() if s.session == "omar").tokens
    r = engine.chat(msgs, replay=True, **settings)
    assert r.text == first.text and r.record.reason == "replayed"
    assert next(s for s in engine.slots() if s.session == "omar").tokens == held
    # a slot cleared holds nothing to replay
    engine.clear()
    assert engine.chat(msgs, replay=True, **settings).record.reason != "replayed"
    # unproven exactness: never replayed
    rule = engine.res.rule
    engine.res.rule = dataclasses.replace(rule, exact=False, reason="test")
    try:
        r = engine.chat(msgs, replay=True, **settings).record
        assert r.reason != "replayed" and not r.exact
    finally:
        engine.res.rule = rule


def test_a_seeded_reply_is_replayed_too(engine):
    engine.clear()
    msgs = [SYSTEM, user("Invent a name for a cat.")]
    kw = dict(session="sam", max_tokens=MAX, temperature=0.8, seed=42)
    first = engine.chat(msgs, **kw)
    again = engine.chat(msgs, replay=True, **kw)
    assert again.record.reason == "replayed" and again.text == first.text
    other = engine.chat(msgs, replay=True, **{**kw, "seed": 43}).record
    assert other.reason != "replayed"


def test_a_parked_conversation_is_restored_and_replayed(engine):
    engine.clear()
    turns = talk(engine, "pat", ["What is a CPU?", "And memory?"])
    engine.settle()  # the replies rewritten: the parked KV is proven up to the end
    talk(engine, "q1", ["Hi."])
    talk(engine, "q2", ["Hello."])  # two other sessions: pat's slot was taken and parked
    assert any(p.session == "pat" for p in engine.parked())
    msgs, first = turns[0]
    r = engine.chat(msgs, session="pat", max_tokens=MAX, temperature=0, replay=True)
    assert r.text == first.text and r.record.reason == "replayed"
    assert r.record.restored_from == "ram" and r.record.prefilled_tokens == 0
    # its first-token time in parts adds up: the restore is a part of its own, not waited
    assert r.record.restore_s > 0
    assert sum(s for _, s in ttft_parts(r.record)) == pytest.approx(r.record.ttft_s)
    assert vocab.bar(r.record).code == "replayed"  # the charts say replayed, as its figures
    slot = engine.slots()[r.record.slot]  # the restored conversation's messages, and map
    assert slot.session == "pat" and slot.hashes and slot.msg_ends[-1] <= slot.n_tokens
    assert {s.state for s in slot.segments} <= {"reused", "kept"} and slot.segments[0].start == 0
    msgs, second = turns[1]  # the second turn is still in the restored slot
    r = engine.chat(msgs, session="pat", max_tokens=MAX, temperature=0, replay=True)
    assert r.text == second.text and r.record.reason == "replayed" and not r.record.restored_from
    assert_consistent(engine)


def test_an_exact_false_engine_never_replays(model_path):
    with Engine(model_path, n_slots=1, n_ctx=512, exact=False) as e:
        msgs = [SYSTEM, user("Name a fruit.")]
        e.chat(msgs, session="x", max_tokens=4, temperature=0)
        r = e.chat(msgs, session="x", max_tokens=4, temperature=0, replay=True).record
        assert r.reason != "replayed" and len(e.core.replays.replies) == 0


def test_a_parked_conversation_restored_for_another_session_stays_parked(model_path):
    """02's last section sends alice's first prompt as another session: it gets a copy of
    her parked conversation; hers stays parked, and her next turn restores it."""
    with Engine(model_path, n_slots=1, n_ctx=1024) as e:
        (msgs, first), = talk(e, "alice", ["What is a CPU?"])
        talk(e, "bob", ["Hi."])  # alice's slot taken: parked
        assert [p.session for p in e.parked()] == ["alice"]
        r = e.chat(msgs, session="ttft", max_tokens=MAX, temperature=0).record
        assert r.restored_from == "ram" and r.restored_session == "alice"
        assert "alice" in [p.session for p in e.parked()]  # still hers
        again = e.chat(msgs + [first.message, user("And memory?")], session="alice",
                       max_tokens=MAX, temperature=0).record
        assert again.reason == "restored" and again.restored_session == "alice"
        assert_consistent(e)


def test_an_edit_keeps_the_branch_it_cuts_so_run_all_again_replays_every_turn(engine, model_path):
    """02's section 3: a cell edited in its session's own slot cuts the turns after it. The
    old branch is parked first (unnamed), so running every cell again replays them all."""
    engine.clear(parked=True)
    turns = talk(engine, "ed", ["What is a CPU?", "And memory?", "And a disk?"])
    msgs, _ = turns[1]
    edit = msgs[:-1] + [user("And a GPU?")]  # turn 2's cell edited and run again
    kw = dict(session="ed", max_tokens=MAX, temperature=0, replay=True)
    edited = engine.chat(edit, **kw)
    assert edited.record.reason == "edited" and edited.record.trimmed_tokens > 0
    assert [p.session for p in engine.parked()] == [None]  # the old branch, kept
    assert [vocab.parked_name(p) for p in engine.parked()] == ["ed's earlier branch"]
    for msgs, first in turns:  # Run All again: the old cells, then the edit's
        r = engine.chat(msgs, **kw)
        assert r.text == first.text and r.record.reason == "replayed", r.record.reason_text
        assert r.record.generated_tokens == 0 and r.record.prefilled_tokens == 0
    again = engine.chat(edit, **kw)
    assert again.text == edited.text and again.record.reason == "replayed"
    assert len(engine.parked()) == 1  # a branch parked once, not again on every cut
    assert edited.text == scratch_reply(model_path, edit, max_tokens=MAX)
    for s in engine.slots():
        assert [v.identical for v in engine.verify(s.index)] == [True]
    assert_consistent(engine)


def test_an_edit_of_a_parked_conversation_keeps_the_branch_it_cuts(engine):
    """As above, with more sessions than slots: the edited session's conversation was parked,
    so the edit restores it and cuts it. Its old branch stays parked, as in its own slot
    (found by the stateful test's long profile: a conversation held only there was lost)."""
    engine.clear(parked=True)
    turns = talk(engine, "ed", ["What is a CPU?", "And memory?", "And a disk?"])
    engine.settle()
    talk(engine, "q1", ["Hi."])
    talk(engine, "q2", ["Hello."])  # ed's slot taken: parked
    assert "ed" in [p.session for p in engine.parked()]
    msgs, _ = turns[1]
    kw = dict(session="ed", max_tokens=MAX, temperature=0, replay=True)
    edited = engine.chat(msgs[:-1] + [user("And a GPU?")], **kw).record
    assert edited.restored_from == "ram" and edited.restored_session == "ed"
    assert "ed's earlier branch" in [vocab.parked_name(p) for p in engine.parked()]
    msgs, last = turns[2]  # the old last cell run again: replayed from the branch
    r = engine.chat(msgs, **kw)
    assert r.text == last.text and r.record.reason == "replayed", r.record.reason_text
    assert r.record.prefilled_tokens == 0
    assert_consistent(engine)


def test_run_all_again_over_a_parked_conversation_replays_its_own_entry_and_parks_nothing(
        engine):
    """02's second "Run All": a session's cells run again while its conversation is parked.
    The first restores its own entry and is replayed: nothing is cut, so no branch is parked
    (and the later cells replay in place, not from a branch's copy)."""
    engine.clear(parked=True)
    turns = talk(engine, "ed", ["What is a CPU?", "And memory?", "And a disk?"])
    engine.settle()
    talk(engine, "q1", ["Hi."])
    talk(engine, "q2", ["Hello."])  # ed's slot taken: parked
    kw = dict(session="ed", max_tokens=MAX, temperature=0, replay=True)
    for i, (msgs, first) in enumerate(turns):
        r = engine.chat(msgs, **kw)
        assert r.text == first.text and r.record.reason == "replayed", r.record.reason_text
        assert r.record.prefilled_tokens == 0
        assert r.record.restored_session == ("ed" if i == 0 else None), r.record.reason_text
        assert not [p for p in engine.parked() if p.branch_of == "ed"]
    assert_consistent(engine)


def test_going_back_to_an_earlier_turn_of_a_parked_conversation_moves_on_from_there(engine):
    """02's section 6 run again: sessions with no replay asked for (the API's default) send
    their first turn again while their conversations are parked. No edit, no replay: each
    goes on from there as before (no branch parked), and its next turn restores its own
    conversation. An edit that asks for no replay still keeps the branch it cuts."""
    engine.clear(parked=True)
    names = ("d", "e", "f")  # three sessions on two slots: each is parked before it returns
    turns = {n: [[SYSTEM, user(f"I am {n}. Say hi.")]] for n in names}
    kw = dict(max_tokens=MAX, temperature=0)
    for _ in range(2):  # the first run, then the same cells again
        for k in range(2):
            for n in names:
                msgs = turns[n][k]
                r = engine.chat(msgs, session=n, **kw)
                if len(turns[n]) == k + 1:
                    turns[n].append(msgs + [r.message, user("And one more word?")])
                if k:
                    assert r.record.restored_session == n, r.record.reason_text
                assert not [p for p in engine.parked() if p.branch_of is not None]
    msgs = turns["d"][1][:1] + [user("I am d. Say bye.")]  # an edit of d's first turn
    r = engine.chat(msgs, session="d", **kw).record
    assert r.restored_session == "d" and r.trimmed_tokens > 0, r.reason_text
    assert "d's earlier branch" in [vocab.parked_name(p) for p in engine.parked()]
    assert_consistent(engine)
