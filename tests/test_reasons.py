"""Every reason a request gives for what it reused, each from a real scenario on the model.

The divergence position is checked against a token comparison done here: the session's slot
as it was before the request, against the prompt the request sent.
"""

from __future__ import annotations

import datetime
from dataclasses import replace

import numpy as np
import pytest

from conftest import SYSTEM
from nbkv import Engine
from nbkv.core.errors import ContextOverflowError, InvalidRequestError
from nbkv.core.events import REASONS
from nbkv.kv import admission
from nbkv.kv.policy import common_prefix
from nbkv.prompt import templates
from nbkv.ui.figures import ExplainReport, Figures, actions, summary

MAX = 3


def user(text):
    return {"role": "user", "content": text}


def ask(engine, session, messages):
    """Send ``messages``; returns (record, what the session's slot held before, prompt)."""
    before = next((s.tokens for s in engine.slots() if s.session == session), ())
    try:
        prompt = engine.tokenize_prompt(messages)
    except ContextOverflowError:  # overflow="slide" drops messages: not this prompt
        prompt = None
    rec = engine.chat(messages, session, max_tokens=MAX, temperature=0).record
    return rec, before, prompt


def check_divergence(rec, before, prompt, message, role):
    d = rec.divergence
    assert d is not None, rec.reason_text
    assert d.position == common_prefix(before, prompt)  # the test's own token comparison
    assert (d.message, d.role) == (message, role)
    assert f"token {d.position}" in rec.reason_text


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=1024) as e:
        yield e


def test_first_continued_copied_edited_system_evicted_cleared(engine):
    alice = [{"role": "system", "content": SYSTEM}, user("What is a CPU?")]
    rec, _, _ = ask(engine, "alice", alice)
    assert rec.reason == admission.FIRST and rec.divergence is None
    assert rec.reason_text == "nothing of session alice was cached"

    alice += [{"role": "assistant", "content": engine.history[-1] and "A processor."},
              user("And memory?")]
    rec, before, prompt = ask(engine, "alice", alice)
    assert rec.reason == admission.CONTINUED and not Figures(rec).why()

    rec, _, _ = ask(engine, "bob", [alice[0], user("What is a GPU?")])
    assert rec.reason == admission.COPIED and rec.donor_session == "alice"
    assert f"first {rec.reused_tokens} tokens" in rec.reason_text
    assert Figures(rec).text().startswith(f"slot {rec.slot}: copied prefix from alice's slot ")

    edited = [alice[0], user("What is a GPU, really?"), *alice[2:]]
    rec, before, prompt = ask(engine, "alice", edited)
    assert rec.reason == admission.EDITED
    check_divergence(rec, before, prompt, 1, "user")
    cached, new = rec.divergence.excerpts(engine.model.detokenize)
    assert "CPU" in cached and "GPU" in new

    changed = [{"role": "system", "content": "Answer like a pirate. " + SYSTEM}, *edited[1:]]
    rec, before, prompt = ask(engine, "alice", changed)
    assert rec.reason == admission.SYSTEM_CHANGED
    check_divergence(rec, before, prompt, 0, "system")

    # two slots, three sessions: carol takes the least recently used one
    rec, _, _ = ask(engine, "carol", [user("Name a colour.")])
    victim = rec.evicted_session
    assert victim in ("alice", "bob")
    if rec.reused_tokens:  # it kept the template's opening it shares with the victim's slot
        assert rec.reason == admission.SHARED and f"held {victim}'s conversation" in \
            rec.reason_text
    else:
        assert rec.reason == admission.FIRST
    assert f"took {victim}'s slot" in Figures(rec).text()
    assert victim in {i.session for i in engine.parked()}  # parked, not lost
    # the victim starts another conversation: its old one being parked does not explain it
    rec, _, _ = ask(engine, victim, [user("Name a shape.")])
    assert rec.reason != admission.EVICTED and "taken" not in rec.reason_text

    slot = next(s.index for s in engine.slots() if s.session == "carol")
    engine.clear(slot)
    rec, _, _ = ask(engine, "carol", [user("Name a colour."), {"role": "assistant",
                                      "content": "Red."}, user("Another?")])
    assert rec.reason == admission.CLEARED and "cleared by the user" in rec.reason_text

    # %kvcache load hands the sessions it knew over: their next turn says so
    engine.carry_over(["erin"])
    rec, _, _ = ask(engine, "erin", [user("Hi."), {"role": "assistant", "content": "Hello."},
                                     user("Again?")])
    assert rec.reason == admission.RELOADED and "loaded again" in rec.reason_text
    assert Figures(rec).text().startswith(f"slot {rec.slot}: engine reloaded · ")
    rec, _, _ = ask(engine, "erin", [user("Hi."), {"role": "assistant", "content": "Hello."},
                                     user("Again?"), {"role": "assistant", "content": "Yes."},
                                     user("More?")])
    assert rec.reason != admission.RELOADED  # only the first turn after the reload


def test_explain_shows_both_renderings_split_at_the_divergence(engine):
    msgs = [user("Tell me about Tuesday 21 Nov.")]
    ask(engine, "dave", msgs)
    msgs2 = [user("Tell me about Wednesday 22 Nov.")]
    rec, before, prompt = ask(engine, "dave", msgs2)
    assert rec.reason == admission.EDITED
    x = engine.explain()
    assert x.record is rec and x.cached_head == x.new_head
    assert x.cached_tail.lstrip().startswith("Tues") and x.new_tail.lstrip().startswith("Wed")
    report = ExplainReport(x)
    text = report.text()
    assert f"request #{rec.id} (dave): edited" in text
    assert "message 0 (user) at token" in text and "⟦ Tuesday" in text and "⟦ Wednesday" in text
    html = report._repr_html_()
    assert html.count('class="nbkv-divergence"') == 2 and "Wednesday" in html
    with pytest.raises(InvalidRequestError, match="no request #9999"):
        engine.explain(9999)


def test_template_drift(model_path, monkeypatch):
    now = {"t": datetime.datetime(2026, 1, 1, 9, 0, 0)}
    monkeypatch.setattr(templates, "_now", lambda: now["t"])
    with Engine(model_path, n_slots=1, n_ctx=1024, template=templates.CLOCK_CHATML) as e:
        msgs = [{"role": "system", "content": SYSTEM}, user("What is a CPU?")]
        ask(e, "s", msgs)
        now["t"] += datetime.timedelta(minutes=1)  # the system turn now renders differently
        msgs += [{"role": "assistant", "content": e.history[-1] and "A chip."}, user("More?")]
        rec, before, prompt = ask(e, "s", msgs)
        assert rec.reason == admission.TEMPLATE_DRIFT
        check_divergence(rec, before, prompt, 0, "system")


def test_overflow_and_uncached_modes(model_path):
    with Engine(model_path, n_slots=1, n_ctx=256, overflow="slide") as e:
        msgs = [{"role": "system", "content": "Be brief."}]
        rec = None
        for i in range(12):
            msgs += [user(f"Question number {i}: what is {i} plus {i}, in words please?")]
            rec, _, _ = ask(e, "s", msgs)
            msgs.append({"role": "assistant", "content": f"{2 * i}."})
            if rec.dropped_messages:
                break
        assert rec.dropped_messages and rec.reason == admission.OVERFLOW
        n = rec.dropped_messages
        assert (f"the {n} oldest messages were dropped" if n > 1
                else "the oldest message was dropped") in rec.reason_text
        assert "(s)" not in rec.reason_text
    with Engine(model_path, n_slots=1, n_ctx=512, cache="off") as e:
        rec, _, _ = ask(e, "s", [user("Hi")])
        assert rec.reason == admission.UNCACHED


def test_a_different_image_at_the_same_place(model_path):
    from nbkv.fixtures import make_mmproj

    def image(seed):
        return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)

    def msg(img, text="What is this?"):
        return {"role": "user", "content": [{"type": "text", "text": text},
                                            {"type": "image", "image": img}]}

    with Engine(model_path, mmproj=str(make_mmproj(kind="tiny")), n_slots=1, n_ctx=1024,
                n_threads=1) as e:
        ask(e, "v", [msg(image(1))])
        rec, before, prompt = ask(e, "v", [msg(image(2))])
        assert rec.reason == admission.IMAGE_CHANGED and rec.encoder_runs == 1
        check_divergence(rec, before, prompt, 0, "user")
        assert "image encoded" in Figures(rec).text()
        # the edit parked v's old branch (its image 1 in KV): w restores it, nothing encoded
        rec, _, _ = ask(e, "w", [msg(image(1))])
        assert rec.restored_tokens > 0 and rec.encoder_runs == 0
        # no KV holds it after other words: image 1, seen before, comes from the embeddings cache
        rec, _, _ = ask(e, "x", [msg(image(1), "Describe the picture below in one word.")])
        assert "image from cache" in Figures(rec).text()


def test_a_checkpoint_restored_before_the_divergence():
    from nbkv.fixtures import make_text_model

    with Engine(str(make_text_model("lfm2")), n_slots=1, n_ctx=1024) as e:
        assert not e.memory.can_trim
        msgs = [{"role": "system", "content": SYSTEM}, user("What is a CPU?")]
        ask(e, "h", msgs)
        rec, before, prompt = ask(e, "h", [msgs[0], user("What is a GPU?")])
        assert rec.reason == admission.CHECKPOINT and rec.checkpoint_pos is not None
        assert rec.checkpoint_pos < rec.divergence.position == common_prefix(before, prompt)
        assert "edited" in rec.reason_text and "checkpoint" in rec.reason_text


# ------------------------------------------------------------------ parking (no model)


def explain(*, session, tokens, hashes, ends, roles, dropped=0, trace=None, own=None,
            cache="imc", kept_from=None, still_parked=False, **decided):
    """The reason's words: the decision of :func:`admission.decide`, put into words."""
    story = admission.Story(session, tokens, hashes, ends, roles, dropped, trace, own, cache,
                            kept_from, still_parked)
    return admission.words(admission.decide(story, **decided))


def _explain(session, trace, restored, tokens, reuse, wanted=None, can_trim=True):
    ends = (3, len(tokens))
    return explain(session=session, trace=trace, own=None, tokens=tokens,
                   hashes=("a", "b"), ends=ends, roles=("system", "user"), reuse=reuse,
                   wanted=reuse if wanted is None else wanted, donor_session=None,
                   can_trim=can_trim, restored=restored)


PARKED_TOKENS = tuple(range(1204))


def test_a_restored_conversation_says_who_took_its_slot_and_from_where():
    trace = admission.Whereabouts(3, admission.PARKED, "bob", 5, slot=0)
    cached = admission.Cached(PARKED_TOKENS, ("a",), (1204,))
    r = _explain("alice", trace, admission.Restored("alice", "ram", cached),
                 PARKED_TOKENS + (7, 8), 1204)
    assert r.code == admission.RESTORED and r.divergence is None
    assert r.text == ("session alice's conversation was parked when bob's request #5 took "
                      "slot 0; restored its 1,204 tokens from RAM")
    r = _explain("alice", None, admission.Restored("alice", "disk", cached),
                 PARKED_TOKENS[:1000] + (9, 9), 1000)
    assert r.text.startswith("session alice's conversation was parked; restored 1,000 of its "
                             "1,204 tokens from disk, then read on from message 1 (user), "
                             "token 1000")
    assert r.divergence.position == 1000


def test_a_restore_of_another_sessions_conversation_and_one_before_a_checkpoint():
    cached = admission.Cached(PARKED_TOKENS, ("a",), (1204,))
    r = _explain("dave", None, admission.Restored("alice", "ram", cached),
                 PARKED_TOKENS + (1,), 1204)
    assert r.code == admission.RESTORED
    assert r.text == ("session dave was not cached; 1,204 tokens of alice's parked "
                      "conversation were restored from RAM")
    r = _explain("alice", None, admission.Restored("alice", "ram", cached),
                 PARKED_TOKENS[:900] + (5,), 800, wanted=900, can_trim=False)
    assert r.code == admission.RESTORED and "a checkpoint 100 tokens earlier" in r.text


def test_a_copy_chosen_over_the_own_slot_says_so():
    """The record says what was done: the own slot still held the conversation, but a copy
    from another slot served more (its own would have gone back to an early checkpoint)."""
    own = admission.Cached(tuple(range(300)), ("a", "b"), (100, 300))
    tokens = tuple(range(200)) + (9, 9)
    r = explain(session="x", trace=None, own=own, tokens=tokens, hashes=("a", "c"),
                ends=(100, 202), roles=("system", "user"), reuse=150, wanted=200,
                donor_session="bob", can_trim=False)
    assert r.code == admission.CHECKPOINT and r.divergence.position == 200
    assert r.text.startswith("session x's own slot served less of this prompt than bob's, "
                             "so its first 150 tokens were copied from there (its own slot "
                             "leaves the prompt in message 1 (user), token 200)")
    assert r.text.endswith("a checkpoint 50 tokens earlier was restored")
    r = explain(session="x", trace=None, own=own, tokens=tuple(range(302)),
                hashes=("a", "b"), ends=(100, 300), roles=("system", "user"),
                reuse=301, wanted=301, donor_session="bob", can_trim=True)
    assert r.code == admission.COPIED and "copied from there" in r.text


def test_a_parked_copy_that_was_gone_is_an_eviction():
    trace = admission.Whereabouts(3, admission.PARKED, "bob", 5, slot=1)
    r = _explain("alice", trace, None, PARKED_TOKENS, 0)
    assert r.code == admission.EVICTED
    assert "parked copy was gone" in r.text and "bob's request #5" in r.text


def test_the_figures_line_says_what_was_restored_from_where_and_how_fast():
    from nbkv.core.events import RequestRecord
    from nbkv.ui import vocabulary

    rec = RequestRecord(9, "alice", "hash-extend", 0, 1210, 1204, 6, 0, reason=admission.RESTORED,
                        reason_text="...", restored_from="ram", restored_tokens=1204,
                        restored_session="alice", restore_s=0.004, evicted_session="carol",
                        evicted_tokens=300, evicted_parked="ram")
    line = summary(rec)
    assert line.startswith("slot 0: restored alice's 1,204 tokens from RAM in 4 ms")
    assert "took carol's slot (300 tokens parked)" in line
    assert vocabulary.bar(rec) is vocabulary.EVENTS["restored"]
    assert vocabulary.event(rec).words == "restored"
    # the restore proper, when the record has it: not the admission and the park around it
    timed = replace(rec, restore_s=0.03, park_s=0.01, unpark_s=0.004)
    assert summary(timed).startswith("slot 0: restored alice's 1,204 tokens from RAM in 4 ms")
    other = RequestRecord(10, "bob", "hash-extend", 0, 10, 5, 5, 0, reason=admission.OVERFLOW,
                          restored_from="disk", restored_tokens=5, restore_s=0.02)
    texts = [t for t, _ in actions(other)]
    assert "restored 5 tokens from disk in 20 ms" in texts
    assert vocabulary.bar(other).code == "restored" != vocabulary.event(other).code
    assert vocabulary.took(RequestRecord(11, "x", "miss", 0, 1, 0, 1, 0, evicted_session="y",
                                         evicted_tokens=4)) == "took y's slot (4 tokens gone)"


#: words each decided code's text must carry (CHECKPOINT: those of its basis, and its own)
SAYS = {admission.UNCACHED: "not kept between requests", admission.OVERFLOW: "outgrew its slot",
        admission.RESTORED: "conversation", admission.COPIED: "copied from",
        admission.SHARED: "so those were kept", admission.FIRST: "nothing of",
        admission.CONTINUED: "everything cached", admission.EDITED: "edited) at token",
        admission.TEMPLATE_DRIFT: "rendered to different tokens",
        admission.IMAGE_CHANGED: "a different image", admission.SYSTEM_CHANGED: "system prompt",
        admission.EVICTED: "slot was taken by", admission.CLEARED: "cleared by the user",
        admission.PROVEN: "proved this model's exact grouping",
        admission.RELOADED: "loaded again", admission.CHECKPOINT: "a checkpoint"}


def test_the_words_say_the_decided_reason():
    """On varied situations, the words carry the code the admission decided, its divergence,
    and a checkpoint note exactly when a checkpoint cost tokens."""
    import random

    rng = random.Random(44)

    def conv():
        toks = tuple(rng.choice([1, 2, 3, "img"]) for _ in range(rng.randint(0, 10)))
        ends = tuple(sorted(rng.sample(range(1, 12), rng.randint(1, 3))))
        return toks, tuple(rng.choice("ab") for _ in ends), ends

    def who():
        return rng.choice([None, "a", "b"])

    seen = set()
    for _ in range(3000):
        tokens, hashes, ends = conv()
        own_t, own_h, own_e = conv()
        own = admission.Cached(tokens[:rng.randint(0, len(tokens))] + own_t[:2], own_h, own_e)
        trace = admission.Whereabouts(1, rng.choice([None, admission.EVICTED, admission.PARKED,
                                                   admission.CLEARED, admission.PROVEN,
                                                   admission.RELOADED]),
                                    who(), 4, rng.choice([None, 0]), rng.choice([None, "a"]))
        rt, rh, re = conv()
        restored = admission.Restored(who(), "ram", admission.Cached(tokens[:3] + rt, rh, re))
        story = admission.Story(
            who(), tokens, hashes, ends, tuple(rng.choice(["system", "user"]) for _ in ends),
            rng.choice([0, 0, 0, 2]), rng.choice([None, trace]), rng.choice([None, own]),
            rng.choice(["imc"] * 6 + ["off"]), who(), rng.random() < 0.5)
        reuse = rng.randint(0, 8)
        d = admission.decide(story, reuse=reuse, wanted=reuse + rng.choice([0, 3]),
                             donor_session=rng.choice([None, "d"]), can_trim=rng.random() < 0.5,
                             restored=rng.choice([None, restored]))
        r = admission.words(d)
        assert (r.code, r.divergence) == (d.code, d.divergence)
        assert SAYS[d.basis or d.code] in r.text, (d, r.text)
        assert ("a checkpoint" in r.text) == (d.shortfall > 0) == (
            f"checkpoint {d.shortfall} tokens earlier" in r.text), (d, r.text)
        seen.add(d.code)
    assert seen == set(SAYS) and set(SAYS) == set(REASONS) - {admission.REPLAYED}


def test_a_record_evolves_as_replace_would():
    from nbkv.core.events import RequestRecord

    rec = RequestRecord(1, "a", "miss", 0, 10, 0, 10, 0)
    new = rec.evolve(ttft_s=0.5, generated_tokens=3)
    assert new == replace(rec, ttft_s=0.5, generated_tokens=3)
    assert (rec.ttft_s, rec.generated_tokens) == (0.0, 0)  # the original stays as it was
    with pytest.raises(TypeError, match="no field nope"):
        rec.evolve(nope=1)
