"""The sequences the stateful simulation (``tests/test_stateful.py``) shrank to, kept as
plain tests named for what they show (each failed on the code before its fix)."""

from __future__ import annotations

import pytest
from test_parking_engine import N_CTX

from nbkv import Engine
from nbkv.core.events import ParkingDropped
from nbkv.llama.models import default_model_path


@pytest.fixture(scope="module")
def model():
    return str(default_model_path())


def test_close_announces_what_it_could_not_spill(model, tmp_path):
    """Found: start with a disk budget smaller than one conversation, chat once (unnamed),
    reopen. ``close()`` could not write the slot's conversation to disk: a listener must
    hear it (a ``ParkingDropped``), else the conversation is lost without a word."""
    heard = []
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=40 << 10, park_dir=str(tmp_path),
                park_disk=400 << 10) as e:
        e.subscribe(lambda ev: isinstance(ev, ParkingDropped) and heard.append(ev))
        e.chat([{"role": "system", "content": "You are a chef."},
                {"role": "user", "content": "And memory?"}], max_tokens=3, temperature=0)
    assert [(ev.session, ev.tier) for ev in heard] == [(None, "ram")]
    assert "larger than the whole disk budget" in heard[0].why
    with Engine(model, n_slots=3, n_ctx=N_CTX, park_ram=0, park_dir=str(tmp_path)) as again:
        assert again.parked() == ()


# ------------------------------------------------------------------ sliding window (gemma3)


@pytest.fixture(scope="module")
def gemma3():
    from test_families import model_for

    path = model_for("gemma3")
    with Engine(path, n_slots=2, n_ctx=N_CTX, cache_min_tokens=20) as e, \
            Engine(path, n_slots=1, n_ctx=N_CTX, cache="off") as off:
        yield e, off


def consistent(rec):
    """A record's reason agrees with its figures."""
    if rec.reason == "first":
        assert rec.reused_tokens == 0, rec.reason_text
    if rec.reason in ("copied", "shared", "continued"):
        assert rec.reused_tokens > 0, rec.reason_text
    if rec.reason == "restored":
        assert rec.restored_from in ("ram", "disk") and rec.reused_tokens > 0, rec.reason_text
    assert "None's" not in rec.reason_text


WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon").split() * 3


def twenty_seven_words(e):
    """A conversation whose restored state extended inexactly (see below)."""
    msgs = [{"role": "system", "content": " ".join(WORDS[:27])},
            {"role": "user", "content": "hi"}]
    r = e.chat(msgs, session="a", max_tokens=2, temperature=0)
    e.settle()
    return [*msgs, r.message, {"role": "user", "content": "more words here please"}]


def test_a_parked_sliding_window_state_longer_than_the_window_is_served_exactly(gemma3):
    """Found (gemma3): a conversation parked, then back for its next turn. llama.cpp saves
    only the window's cells of the SWA layers; restored, they sit packed at the start of the
    stream, and the extended slot's logits differed from a prefill's (max 0.001) for some
    lengths: 27 words of system prompt here."""
    e, off = gemma3
    e.clear(parked=True)
    msgs = twenty_seven_words(e)
    e.park("a")
    assert e.parked()[0].n_tokens > e.memory.n_swa
    back = e.chat(msgs, session="a", max_tokens=2, temperature=0)
    assert back.text == off.chat(msgs, max_tokens=2, temperature=0).text
    consistent(back.record)
    # restored only where its window continues exactly (nbkv.kv.policy: a checkpoint, or a
    # point where the put-back cells line up), else rebuilt: either way what is served is
    # a prefill's KV
    assert e.verify()[0].identical if not back.record.restored_from else True
    e.settle()
    assert all(v.identical for v in e.verify()), [str(v) for v in e.verify()]


def test_a_restored_sliding_window_slot_is_unproven_until_prefilled_again(gemma3, tmp_path):
    """The same packed cells through a save and a restore: served as unproven until the
    idle rewrite has prefilled the slot again in place; then exact."""
    e, off = gemma3
    e.clear(parked=True)
    msgs = twenty_seven_words(e)
    e.save(str(tmp_path / "s"), sessions=())
    e.clear(parked=True)
    e.restore(str(tmp_path / "s"), sessions=())
    back = e.chat(msgs, session="a", max_tokens=2, temperature=0)
    assert back.text == off.chat(msgs, max_tokens=2, temperature=0).text
    consistent(back.record)
    e.settle()
    assert all(v.identical for v in e.verify()), [str(v) for v in e.verify()]


@pytest.mark.parametrize("cancelled", [False, True])
def test_reasons_say_what_was_done_after_a_rerun_of_a_parked_unnamed_conversation(gemma3,
                                                                                  cancelled):
    """Found (gemma3): an unnamed conversation parked by hand, then its turn re-run. The
    restore kept nothing, and the record said "restored: 0 tokens of a parked conversation";
    with a stream of the next turn cancelled at its first word before the re-run, "copied:
    its first 0 tokens"."""
    e, off = gemma3
    e.clear(parked=True)
    msgs = [{"role": "system", "content": "You are a chef. Answer in one short sentence."},
            {"role": "user", "content": "What is a CPU?"}]
    first = e.chat(msgs, max_tokens=2, temperature=0)
    e.settle()
    e.park(all=True)
    if cancelled:
        s = e.chat([*msgs, first.message, {"role": "user", "content": "What is a CPU?"}],
                   stream=True, max_tokens=6, temperature=0)
        next(iter(s), None)
        s.close()
        e.settle()
    r = e.chat(msgs, max_tokens=2, temperature=0)
    assert r.text == off.chat(msgs, max_tokens=2, temperature=0).text
    consistent(r.record)
    e.settle()
    assert all(v.identical for v in e.verify())


def test_reason_words_for_a_copy_of_nothing_and_an_unnamed_evictor():
    from nbkv.kv import admission

    def explain(trace, still_parked=False, **decided):
        story = admission.Story("s", (1, 2, 3, 4), ("h1", "h2"), (2, 4), ("system", "user"),
                                trace=trace, still_parked=still_parked)
        return admission.words(admission.decide(story, reuse=0, wanted=0, **decided))

    why = explain(None, donor_session="x")
    assert why.code == admission.FIRST
    gone = admission.Whereabouts(3, admission.PARKED, None, 7, 0, "h1")
    why = explain(gone, still_parked=True)
    assert why.code == admission.EVICTED and "an unnamed request #7" in why.text
    assert "could not serve this prompt" in why.text and "gone" not in why.text



def test_unparking_an_older_conversation_of_an_edited_session_loses_nothing(gemma3):
    """Found (gemma3): c2 forks an unnamed conversation, everything is parked, c2 edits its
    last turn (its old conversation stays parked), ``unpark("c2")`` brings the old one back
    into the other slot, ``park(all=True)``: the old one, parked last, replaced c2's newer
    conversation in the lot: lost without a word."""
    from nbkv.kv.policy import common_prefix

    e, off = gemma3
    e.clear(parked=True)
    c1 = [{"role": "system", "content": "You are a chef. Answer in one short sentence."},
          {"role": "user", "content": "What is a CPU?"}]
    c1.append(e.chat(c1, max_tokens=2, temperature=0).message)
    c2 = [*c1, {"role": "user", "content": "Name a fruit."}]
    e.chat(c2, session="c2", max_tokens=2, temperature=0)
    e.park(all=True)
    edited = [*c1[:-2], {"role": "user", "content": "What is a CPU? Briefly."}]
    r = e.chat(edited, session="c2", max_tokens=2, temperature=0)
    assert r.text == off.chat(edited, max_tokens=2, temperature=0).text
    latest = e.tokenize_prompt(edited)
    if any(i.session == "c2" for i in e.parked()):  # restored as a copy: the old one stays
        e.unpark("c2")
    e.park(all=True)
    held = [i.tokens for i in e.parked() if i.session == "c2"]
    # c2's newer conversation is the one parked, never the older (whose tokens leave the
    # newer's): whole, or (sliding window) cut back where its window is put back exactly
    assert held and all(common_prefix(t, latest) == len(t) for t in held), held


# ------------------------------------------------------------------ hybrid (lfm2)


def test_an_unnamed_conversation_held_by_another_ones_entry_goes_back_to_its_checkpoint():
    """Found (lfm2, the long profile): three unnamed conversations share the system prompt
    and first question; c3's own parked entry is dropped (announced: over the RAM budget)
    and c1's 121-token entry, which shares c3's 42-token prompt and the first 2 of its 3
    reply tokens, is the only holder left. Hybrid memory goes back only to a checkpoint: c1's
    are at its messages' ends and the newest (8 at most), none between 28 and 44, so the
    engine restores 28, the best it holds. The simulation's model counted the 44 shared
    tokens as servable and asked for 35: it now counts what a holder can go back to."""
    import test_stateful as T

    from nbkv.kv.policy import common_prefix

    pool = T.Pool("lfm2")
    m = type("M", (T.EngineMachine,), {"pool": pool})()
    try:
        def step(rule, **kw):
            getattr(m, rule)(**kw)
            m.nothing_silently_lost()
            m.the_views_agree()

        q = "What is a CPU?"
        step("start", config=(2, 150, False, None))
        step("new_conversation", n=2, named=False, q=q, shared=True)
        step("next_turn", i=0, n=2, q=q)
        step("next_turn", i=0, n=6, q=q)
        step("several_in_one_pass", n=2, picks=[0, 0], q=q)
        step("several_in_one_pass", n=2, picks=[0, 1], q=q)
        step("several_in_one_pass", n=3, picks=[0, 1], q=q)
        step("park_all")
        step("rerun", i=0, n=2)
        step("park_all")
        c3 = m.convs["c3"]
        prompt = m.e.tokenize_prompt([*c3.messages, T.user(q)])
        (entry,) = m.e.parked()  # c1's, the only holder of c3's start
        shared = common_prefix(entry.tokens, prompt)
        best = max(x for x in entry.checkpoints if x <= shared)
        assert shared >= len(c3.prompt) > best
        assert m.own_held(c3, tuple(prompt)) == best  # the model: what can be gone back to
        (r,) = m.chat([(c3, [*c3.messages, T.user(q)])], 2)  # checks the reply and verify()
        rec = r.record
        assert (rec.reason, rec.restored_from, rec.reused_tokens) == ("restored", "ram", best)
        assert f"{best} tokens of a parked conversation were restored" in rec.reason_text
    finally:
        m.teardown()
        pool.shutdown()


# ------------------------------------------------------------------ sliding window, put back


def librarian(e):
    """Session "a": a shared-looking system prompt, one short turn."""
    a = [{"role": "system", "content": "You are a helpful librarian. You recommend one book "
          "at a time and explain your choice in a single short sentence."},
         {"role": "user", "content": "What is a CPU?"}]
    a.append(e.chat(a, session="a", max_tokens=3, temperature=0).message)
    e.settle()
    return a


def pirate(e):
    """Session "b", one short turn (33 positions: its window does not continue exactly when
    put back whole); returns its next turn's messages."""
    b = [{"role": "system", "content": "You are a pirate. Answer in one short sentence."},
         {"role": "user", "content": "Name a fruit."}]
    b.append(e.chat(b, session="b", max_tokens=5, temperature=0).message)
    e.settle()
    return [*b, {"role": "user", "content": "And memory?"}]


def test_a_slot_displaced_by_a_restore_is_parked_where_it_is_put_back_exactly(gemma3,
                                                                             tmp_path):
    """Found (gemma3, the long profile's "the parked state of c1 did not restore;
    rebuilding"): ``restore()`` parks what the slots held, but parked each sliding-window
    slot whole, at any length. Put back, a window that does not start a multiple of
    SWA_CELLS cells in does not continue exactly, so the returning conversation was read
    again from 0 ("first: nothing of session b was cached"). It is now parked where its
    next turn resumes (as ``park()`` does), and restored from there."""
    from nbkv.kv.policy import restorable

    e, off = gemma3
    e.clear(parked=True)
    librarian(e)
    e.save(str(tmp_path / "s"), sessions=())
    b = pirate(e)
    e.restore(str(tmp_path / "s"), sessions=())
    mem = e.memory
    (held,) = [i for i in e.parked() if i.session == "b"]
    assert restorable(mem.kind, mem.n_swa, held.n_tokens), held.n_tokens
    r = e.chat(b, session="b", max_tokens=3, temperature=0)
    assert r.text == off.chat(b, max_tokens=3, temperature=0).text
    rec = r.record
    consistent(rec)
    assert (rec.reason, rec.restored_from, rec.reused_tokens) == (
        "restored", "ram", held.n_tokens), rec.reason_text
    e.settle()
    assert all(v.identical for v in e.verify()), [str(v) for v in e.verify()]


def test_a_sliding_window_state_parked_whole_goes_back_to_its_checkpoint(gemma3):
    """A sliding-window state parked whole at a length where its window does not continue
    exactly (as a restore parked displaced slots, and as a save's extra slots are) goes
    back to its newest checkpoint that does, as the placement counted on: it was thrown
    away ("did not restore; rebuilding") and the conversation read again from 0."""
    from nbkv.kv.policy import restorable
    from nbkv.store.parked import ParkedEntry

    e, off = gemma3
    e.clear(parked=True)
    librarian(e)
    b = pirate(e)
    core = e.scheduler.core
    (slot,) = [s for s in core.table if s.session == "b"]
    mem, n = e.memory, len(slot.kv)
    cps = [c for c in slot.kv.checkpoints.positions if restorable(mem.kind, mem.n_swa, c)]
    assert not restorable(mem.kind, mem.n_swa, n) and cps, (n, cps)

    def park_whole():
        k = sum(1 for x in slot.msg_ends if x <= n)
        core.parking.park(ParkedEntry.from_snapshot(
            slot.kv.snapshot(), session="b", hashes=slot.hashes[:k],
            msg_ends=slot.msg_ends[:k], segments=slot.segments))
        core.table.reset(slot)

    core.call(park_whole)
    r = e.chat(b, session="b", max_tokens=3, temperature=0)
    assert r.text == off.chat(b, max_tokens=3, temperature=0).text
    rec = r.record
    consistent(rec)
    assert (rec.reason, rec.reused_tokens) == ("restored", max(cps)), rec.reason_text
    assert f"restored {max(cps)} of its {n} tokens" in rec.reason_text
    e.settle()
    assert all(v.identical for v in e.verify()), [str(v) for v in e.verify()]


def test_a_restored_session_is_parked_when_displaced_though_its_later_one_was_parked(model,
                                                                                     tmp_path):
    """Found (lfm2, a long-profile-like run; the same on every memory class): session c
    saved, then carried on and parked; ``restore()`` put the saved conversation back in a
    slot. Displaced later, it was not parked (the lot keeps a session's most recently used
    conversation: the one parked since) and nothing was announced, so c's next turn from
    the restored conversation found only the start it shares with the other. The one c had
    since now stays parked as an unnamed branch."""
    heard = []
    with Engine(model, n_slots=2, n_ctx=N_CTX, cache_min_tokens=20) as e:
        e.subscribe(lambda ev: isinstance(ev, ParkingDropped) and heard.append(ev))
        c = [{"role": "system", "content": "You are a chef. Answer in one short sentence."},
             {"role": "user", "content": "What is a CPU?"}]
        c.append(e.chat(c, session="c", max_tokens=3, temperature=0).message)
        e.settle()
        (saved,) = [s.tokens for s in e.slots() if s.session == "c"]
        e.save(str(tmp_path / "s"), sessions=())
        later = [*c, {"role": "user", "content": "Name a fruit."}]
        e.chat(later, session="c", max_tokens=3, temperature=0)
        e.settle()
        e.park(all=True)
        e.restore(str(tmp_path / "s"), sessions=())
        for who in ("x", "y"):  # two other sessions take both slots
            e.chat([{"role": "system", "content": f"You are {who}."},
                    {"role": "user", "content": "Hi"}], session=who, max_tokens=2,
                   temperature=0)
        nxt = [*c, {"role": "user", "content": "And memory?"}]
        (mine,) = [i for i in e.parked() if i.session == "c"]
        assert tuple(mine.tokens) == tuple(saved), mine  # the restored conversation
        assert any(i.session is None and i.n_tokens > mine.n_tokens for i in e.parked())
        assert heard == []
        r = e.chat(nxt, session="c", max_tokens=2, temperature=0)
        rule = e.prefill_rule  # at least all of it, less the canonical cut
        assert r.record.reason == "restored", r.record.reason_text
        assert r.record.reused_tokens >= mine.n_tokens - rule.min_chunk - rule.align
        e.settle()
        assert all(v.identical for v in e.verify())


def test_a_cut_back_to_a_checkpoint_runs_a_copy_queued_from_its_slot_first():
    """Found by the long profile (gemma3, sliding window): a shared system prompt copied
    out of slot 0 waits for the next decode, and in the same admission pass slot 0 is cut
    back to a checkpoint (a state write into the copy's source). It raised ``KVOrderError``
    to the caller; the copy now runs first, in the order the admissions were made."""
    import test_stateful as machine

    pool = machine.Pool("gemma3")
    m = type("Machine_gemma3", (machine.EngineMachine,), {"pool": pool})()
    try:
        m.start(config=(2, None, False, None))
        m.park_all()
        m.new_conversation(n=2, named=False, q="And memory?", shared=True)
        m.park_all()
        m.cancel_halfway(after=0, i=0, q="What is a CPU?")
        m.several_in_one_pass(n=2, picks=[0, 0], q="What is a CPU?")  # raised KVOrderError
        m.nothing_silently_lost()
        m.the_views_agree()
    finally:
        m.teardown()
        pool.shutdown()
