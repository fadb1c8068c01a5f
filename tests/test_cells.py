"""Cells are turns: a ``%%chat`` turn remembers its notebook cell, and re-running the cell
replaces the turn.

The bookkeeping is checked first on a scripted engine (every reply names the history it
was given, so a wrong history shows in the text). Then the real thing: a kernel driven
through ``jupyter_client`` sending ``execute_request`` with ``cellId`` metadata, as
JupyterLab does, on the embedded model; what nbclient and nbval send; a fork's first
request (donor copy, exact probe logits); save and restore of turns.
"""

from __future__ import annotations

import copy
import html
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from IPython.core.error import UsageError

from conftest import assert_consistent, fresh_probe, ipython_shell, scratch_reply
from nbkv.core.errors import InvalidRequestError
from nbkv.core.events import RequestRecord, Segment
from nbkv.notebook.sessions import STORE, CellRef, Session, SessionStore, TurnChange, cut_from
from nbkv.ui.conversation_view import conversation_html, conversation_text

ROOT = Path(__file__).resolve().parents[1]
MAX = 8


# -- a scripted engine: the bookkeeping, with no model --------------------------------------


class Script:
    """A stream whose reply says which questions it was sent: ``re:q1|q2|q3``."""

    ids = itertools.count(1)

    def __init__(self, messages, session):
        asked = [m["content"] for m in messages if m["role"] == "user"]
        self.request_id = next(self.ids)
        self.messages = list(messages)
        self.text = ""
        self.finish_reason = None
        self.record = None
        self._reply = "re:" + "|".join(asked)
        self._session = session

    def __iter__(self):
        return self

    def __next__(self):
        if self.record is not None:
            raise StopIteration
        if not self.text:
            self.text = self._reply
            return self.text
        self.close()
        raise StopIteration

    def close(self):
        if self.record is None:
            self.finish_reason = "stop"
            self.record = RequestRecord(self.request_id, self._session, "miss", 0,
                                        len(self.messages), 0, len(self.messages), 0,
                                        finish_reason="stop")


class ScriptEngine:
    def __init__(self):
        self.sent = []

    def chat(self, messages, session=None, stream=False, **kw):
        self.sent.append(list(messages))
        return Script(messages, session)


def run(session, engine, text, cell=None, count=None):
    ref = CellRef(cell, count) if cell else None
    with session.start(engine, text, cell=ref, max_tokens=MAX, temperature=0) as turn:
        for _ in turn:
            pass
    return turn


def questions(session):
    return [m["content"] for m in session.messages if m["role"] == "user"]


def test_a_rerun_replaces_its_turn_and_later_turns_go_stale():
    store, eng = SessionStore(), ScriptEngine()
    seen = []
    store.subscribe(seen.append)
    s = store.get("alice")
    s.system = "Be brief."
    for i, q in enumerate(("q1", "q2", "q3"), start=1):
        run(s, eng, q, f"c{i}", i)
    assert [t.reply for t in s.turns] == ["re:q1", "re:q1|q2", "re:q1|q2|q3"]
    # re-run cell 2 with new text: answered on turn 1 only; turn 3 kept, stale
    t = run(s, eng, "q2b", "c2", 4)
    assert eng.sent[-1] == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "q1"},
                            {"role": "assistant", "content": "re:q1"},
                            {"role": "user", "content": "q2b"}]
    assert t.change == TurnChange("alice", 2, "replaced", CellRef("c2", 4), (3,),
                                  (0, 1, 1, 2))
    assert [x.state for x in s.turns] == ["live", "live", "stale"]
    assert s.turns[2].stale_since == 2 and s.turns[1].runs == 2
    assert questions(s) == ["q1", "q2b"]  # the live conversation leaves turn 3 out
    assert [r.id for r in s.records] == [s.turns[0].record.id, t.record.id]
    assert "re-ran cell [4]: replaced turn 2 of alice" in t.note
    assert t.note.endswith("turn 3 is now stale")
    # a new cell appends after the stale turn, on the live history
    run(s, eng, "q4", "c4", 5)
    assert s.turns[3].reply == "re:q1|q2b|q4"
    # re-running the stale cell refreshes it on the live history before it; turn 4 goes stale
    t = run(s, eng, "q3", "c3", 6)
    assert t.change.action == "refreshed" and t.change.stale == (4,)
    assert s.turns[2].reply == "re:q1|q2b|q3" and s.turns[2].live
    assert "refreshed turn 3 of alice on the new history" in t.note
    # no cell: appended, as in a terminal
    run(s, eng, "q5")
    assert s.turns[-1].cell is None and s.turns[-1].reply == "re:q1|q2b|q3|q5"
    assert len(seen) >= 7 and seen[-1].session == "alice" and seen[-1].change.action == \
        "appended"


def test_a_cell_moved_to_another_session_leaves_the_first():
    store, eng = SessionStore(), ScriptEngine()
    a, typo = store.get("alice"), store.get("alcie")
    run(a, eng, "q1", "c1", 1)
    run(typo, eng, "q2", "c2", 2)  # a typo in the session's name...
    run(a, eng, "q3", "c3", 3)
    run(a, eng, "q2", "c2", 4)  # ...fixed, and the cell run again
    assert typo.turns == () and [t.cell.id for t in a.turns] == ["c1", "c3", "c2"]
    b = a.fork("bob", at=1)  # a fork's copies keep their cells, and are not released
    run(a, eng, "q1 again", "c1", 5)
    assert [(t.cell.id, t.source) for t in b.turns] == [("c1", "alice")]
    # and in the session that lost a turn, the turns after it are stale
    run(typo, eng, "x", "t1", 6)
    run(typo, eng, "y", "t2", 7)
    run(a, eng, "x", "t1", 8)
    assert [t.state for t in typo.turns] == ["stale"] and typo.turns[0].cell.id == "t2"


def test_a_stale_turn_before_a_rerun_cell_is_left_out_of_its_history():
    s, eng = SessionStore().get("s"), ScriptEngine()
    for i in range(1, 5):
        run(s, eng, f"q{i}", f"c{i}", i)
    run(s, eng, "q2b", "c2", 5)  # turns 3, 4 stale
    t = run(s, eng, "q4", "c4", 6)  # turn 3 is still stale: not in turn 4's history
    assert t.stream.messages[-1] == {"role": "user", "content": "q4"}
    assert [m["content"] for m in t.stream.messages if m["role"] == "user"] == ["q1", "q2b",
                                                                                 "q4"]
    assert t.change.layout == (1, 1, 2, 2, 4)  # the turn of each message sent
    assert [x.state for x in s.turns] == ["live", "live", "stale", "live"]


def test_a_rerun_that_gives_the_same_exchange_keeps_the_later_turns_live():
    """Run All again: each cell's turn comes out the same (a replay), so the turns after it
    were answered on exactly this history and stay live."""
    store, eng = SessionStore(), ScriptEngine()
    s = store.get("s")
    for i in range(1, 4):
        run(s, eng, f"q{i}", f"c{i}", i)
    first = [t.reply for t in s.turns]
    t = run(s, eng, "q1", "c1", 4)
    assert t.change == TurnChange("s", 1, "repeated", CellRef("c1", 4), (), (1,))
    assert [x.state for x in s.turns] == ["live"] * 3 and s.turns[0].runs == 2
    assert t.note == "re-ran cell [4]: turn 1 of s is the same as before, so the turns after " \
                     "it stay"
    for i in (2, 3):  # the rest of the second Run All
        assert run(s, eng, f"q{i}", f"c{i}", 3 + i).change.action == "repeated"
    assert [t.reply for t in s.turns] == first and questions(s) == ["q1", "q2", "q3"]


def test_rewind_and_new_and_messages_edits():
    s, eng = SessionStore().get("r"), ScriptEngine()
    for i in range(1, 4):
        run(s, eng, f"q{i}", f"c{i}", i)
    s.rewind(1)
    assert [t.state for t in s.turns] == ["live", "stale", "stale"] and questions(s) == ["q1"]
    t = run(s, eng, "q2", "c2", 4)  # the rewound cell refreshes on turn 1
    assert t.change.action == "refreshed" and s.turns[1].reply == "re:q1|q2"
    with pytest.raises(InvalidRequestError, match="r has 3 turn"):
        s.rewind(4)
    s.rewind(s.turns[0])
    assert questions(s) == ["q1"]
    # the API way: edit a message in place (the turn keeps its cell)
    s.messages[0]["content"] = "q1 edited"
    assert s.turns[0].question == "q1 edited" and s.turns[0].cell == CellRef("c1", 1)
    # list changes rebuild the turns; turns whose user message stays keep their cell
    msgs = s.messages
    msgs.append({"role": "user", "content": "extra"})
    msgs.append({"role": "assistant", "content": "ok"})
    assert [t.cell.id if t.cell else None for t in s.turns] == ["c1", None]
    del s.messages[-2:]
    assert questions(s) == ["q1 edited"]
    with pytest.raises(InvalidRequestError, match="out of date"):
        msgs.append({"role": "user", "content": "late"})  # read before the deletion
    s.messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert s.system == "sys" and [t.messages for t in s.turns][1] == [
        {"role": "user", "content": "c"}]
    for dup in (copy.copy(s.messages), copy.deepcopy(s.messages)):  # plain lists
        assert type(dup) is list and dup == s.messages
    s.reset()
    assert s.turns == () and s.messages == [{"role": "system", "content": "sys"}]


def alice_with_three_turns():
    """A store whose session alice ran three cells (q1..q3), and the scripted engine."""
    store, eng = SessionStore(), ScriptEngine()
    a = store.get("alice")
    a.system = "S"
    for i in range(1, 4):
        run(a, eng, f"q{i}", f"a{i}", i)
    return store, eng, a


def test_fork_shares_the_first_turns_and_refork_keeps_own_turns_stale():
    store, eng, a = alice_with_three_turns()
    b = a.fork("bob", at=2)
    assert b.parent == ("alice", 2) and questions(b) == ["q1", "q2"]
    assert all(t.source == "alice" and t.record is None for t in b.turns)
    b.messages[1]["content"] = "changed"  # a copy: alice is untouched
    assert questions(a) == ["q1", "q2", "q3"]
    run(b, eng, "b3", "b3", 4)
    assert b.turns[-1].reply == "re:changed|q2|b3"
    b = a.fork("bob", at=1)  # re-running the fork cell: a new base, own turns stale
    assert questions(b) == ["q1"] and [t.state for t in b.turns] == ["live", "stale"]
    with pytest.raises(InvalidRequestError, match="alice has 3 turn"):
        a.fork("carol", at=9)
    with pytest.raises(InvalidRequestError, match="into itself"):
        a.fork("alice")
    with pytest.raises(InvalidRequestError, match="no session store"):
        Session("loose").fork("x")


def test_state_round_trip_and_older_saves():
    store, eng, a = alice_with_three_turns()
    run(a, eng, "q2", "a2", 7)
    a.fork("bob", at=1)
    data = json.loads(json.dumps([s.state_dict() for s in store]))
    fresh = SessionStore()
    for d in data:
        fresh.get(d["name"]).load_state(d)
    for s in store:
        t = fresh[s.name]
        assert t.parent == s.parent and t.messages == s.messages and t.system == s.system
        assert [(x.cell, x.state, x.runs, x.stale_since, x.source, x.messages)
                for x in t.turns] == [(x.cell, x.state, x.runs, x.stale_since, x.source,
                                       x.messages) for x in s.turns]
    old = fresh.get("old")  # a save written before turns existed: messages only
    old.load_state({"name": "old", "messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "yo"}]})
    assert len(old.turns) == 1 and old.turns[0].cell is None
    for bad in ({"turns": "x"}, {"turns": [{"messages": []}]},
                {"turns": [{"messages": [{"role": "user"}], "state": "odd"}]}):
        with pytest.raises(ValueError):
            Session("b").load_state(bad)


def record_with(segments, trimmed=10):
    return RequestRecord(1, "a", "hash-extend", 0, 50, 30, 20, trimmed,
                         segments=tuple(Segment(*s) for s in segments))


def test_where_the_cut_is_told_in_turns():
    sys_u = [(0, 10, 0, "system", "reused"), (10, 20, 1, "user", "reused"),
             (20, 30, 2, "assistant", "reused")]
    # the new user message of turn 2 starts where the reuse ends: cut from its question on
    rec = record_with(sys_u + [(30, 40, 3, "user", "prefilled"),
                               (40, 42, 4, "assistant", "prefilled")])
    assert cut_from(rec, (0, 1, 1, 2)) == "turn 2's question"
    # an edited question: the reuse ends inside it
    rec = record_with(sys_u + [(30, 34, 3, "user", "reused"), (34, 40, 3, "user", "prefilled"),
                               (40, 42, 4, "assistant", "prefilled")])
    assert cut_from(rec, (0, 1, 1, 2)) == "turn 2's question"
    rec = record_with([(0, 10, 0, "system", "reused"), (10, 20, 1, "user", "prefilled"),
                       (20, 22, 2, "assistant", "prefilled")])
    assert cut_from(rec, (0, 1)) == "turn 1's question"
    rec = record_with([(0, 10, 0, "system", "prefilled"), (10, 20, 1, "user", "prefilled")])
    assert cut_from(rec, (0, 1)) == "the system prompt"
    # the question kept whole: the cut begins where its reply did (the old reply, turn 3...)
    rec = record_with(sys_u + [(30, 40, 3, "user", "reused"), (40, 42, 4, "assistant",
                                                               "prefilled")])
    assert cut_from(rec, (0, 1, 1, 2)) == "turn 2's reply"
    change = TurnChange("alice", 2, "replaced", CellRef("c", 3), (3, 4), (0, 1, 1, 2))
    assert change.describe(rec) == ("re-ran cell [3]: replaced turn 2 of alice · trimmed 10 "
                                    "tokens from turn 2's reply onwards · turns 3–4 are now "
                                    "stale")
    assert TurnChange("a", 1, "appended").describe(rec) == ""
    assert TurnChange("a", 2, "repeated", CellRef("c", 5)).describe() == (
        "re-ran cell [5]: turn 2 of a is the same as before, so the turns after it stay")


def test_conversation_view_shows_states_counts_branches_and_forks():
    store, eng = SessionStore(), ScriptEngine()
    a = store.get("alice")
    for i in range(1, 4):
        run(a, eng, f"q{i}", f"a{i}", i + 10)
    run(a, eng, "q2 again", "a2", 20)
    run(a.fork("bob", at=2), eng, "b3", "b3", 21)
    page = conversation_html(list(store))
    assert page.count('data-state="stale"') == 1 and page.count('data-state="live"') == 3
    assert "[11]" in page and "[20]" in page and "[21]" in page
    # each cell beside the request it sent, as the charts number it (#5 [3])
    ids = [t.record.id for t in a.turns if t.record is not None]
    assert ids and all('class="nbkv-request-id"' in page and f">#{n}</span>" in page
                       for n in ids)
    assert "⎇ re-run: turn 3 answered on its earlier version" in page
    # the fork is drawn once, under alice's turn 2, with only its own turn
    assert page.count('class="nbkv-fork"') == 1 and "forked after turn 2" in page
    assert page.index('data-turn="2"') < page.index('class="nbkv-fork"') < page.index(
        'data-turn="3" data-state="stale"')
    assert page.count(">q1</span>") == 1  # the shared turn appears once
    text = conversation_text(list(store))
    assert "turn 3 [stale]" in text and "forked from alice after turn 2" in text
    # alice re-runs turn 2 after the fork: bob now branches after turn 1, and his copy of
    # the earlier turn 2 is drawn in his branch
    run(a, eng, "q2 third", "a2", 22)
    page = conversation_html(list(store))
    assert "forked after turn 1: shares turn 1 with alice; its turn 2 came from an earlier " \
           "version of alice's" in html.unescape(page)
    assert page.index('data-turn="1"') < page.index('class="nbkv-fork"') < page.index(
        ">q2 third</span>")
    assert page.count(">q2 again</span>") == 1 and page.count(">q1</span>") == 1


# -- the magic in an IPython shell: cells through run_cell(cell_id=...) ---------------------


@pytest.fixture(scope="module")
def engine(model_path):
    from nbkv import Engine

    with Engine(model_path, n_slots=2, n_ctx=1024) as e:
        yield e


@pytest.fixture
def shell(engine):
    ip = ipython_shell()
    ip.run_line_magic("load_ext", "nbkv")
    ip.run_line_magic("config", "Nbkv.frontend = 'terminal'")
    ip.run_line_magic("config", f"Nbkv.max_tokens = {MAX}")
    STORE.clear()
    STORE.engine = engine
    yield ip
    STORE.engine = None
    STORE.clear()
    ip.run_line_magic("unload_ext", "nbkv")
    ip.config.pop("Nbkv", None)


def cell(ip, cell_id, source):
    r = ip.run_cell(source, store_history=True, cell_id=cell_id)
    if r.error_before_exec or r.error_in_exec:
        raise r.error_before_exec or r.error_in_exec
    return r


def test_from_forks_in_a_cell_and_bad_specs_are_refused(shell, engine, capsys):
    cell(shell, "a1", '%%chat alice --system "Be brief."\nWhat is a CPU?')
    cell(shell, "a2", "%%chat alice\nAnd what does memory do?")
    cell(shell, "a3", "%%chat alice\nWhy is a cache fast?")
    capsys.readouterr()
    for spec, match in (("alice:9", "alice has 3 turn"), ("nobody:1", "no session 'nobody'"),
                        ("alice:x", "must be a number"), (":2", "SESSION:TURN")):
        with pytest.raises(UsageError, match=match):
            shell.run_cell_magic("chat", f"bob --from {spec}", "And a GPU?")
    with pytest.raises(UsageError, match="give one"):
        shell.run_cell_magic("chat", "bob --from alice:2 --new", "And a GPU?")
    assert "bob" not in STORE or not STORE["bob"].turns
    r = cell(shell, "b3", "%%chat bob --from alice:2\nAnd a GPU?")
    bob = STORE["bob"]
    assert [t.source for t in bob.turns] == ["alice", "alice", None]
    assert bob.turns[2].cell == CellRef("b3", r.execution_count)
    rec = bob.records[-1]
    assert rec.donor_session == "alice" and rec.reason == "copied"
    # running the fork cell again: the same fork, its own turn replaced (not appended)
    first = bob.turns[2].reply
    cell(shell, "b3", "%%chat bob --from alice:2\nAnd a GPU?")
    assert len(bob.turns) == 3 and all(t.live for t in bob.turns)
    assert bob.turns[2].reply == first and bob.turns[2].runs == 2
    out = str(shell.run_line_magic("kvcache", "history -n 2"))
    assert f"[{r.execution_count + 1}]" in out.splitlines()[-1]  # the request's cell
    assert_consistent(engine)


def test_only_a_chat_cell_is_a_turn(shell):
    """A Python cell that chats in a loop has no cell of its own: its turns append."""
    code = "for q in ('Hi.', 'Bye.'):\n    get_ipython().run_cell_magic('chat', 'pat', q)"
    cell(shell, "p1", code)
    cell(shell, "p1", code)
    turns = STORE["pat"].turns
    assert [t.cell for t in turns] == [None] * 4
    assert [t.question for t in turns] == ["Hi.", "Bye."] * 2


# 01_quickstart's chat cells: two sessions in two slots, then a third (seeded) that parks one
QUICKSTART = {
    "q1": '%%chat --system "You are a concise assistant." --max-tokens 8\nWhat is a KV cache?',
    "q2": "%%chat --max-tokens 8\nWhy does reusing it help?",
    "q3": '%%chat bob --system "You answer with short lists." --max-tokens 8\nName red fruits.',
    "q4": "%%chat bob --max-tokens 8\nWhich are the sweetest?",
    "q5": "%%chat sampler --temp 0.8 --seed 42 --max-tokens 8\nInvent a name for a cat.",
}


def test_a_second_run_all_says_replayed_in_every_chart_explain_and_figures_line(
        shell, engine, capsys):
    """Run All twice, as JupyterLab sends it (the same cell ids): every request of the second
    run is replayed, one after a restore of the parked conversation, and the figures lines,
    the charts' bars, ``%kvcache explain`` and the KV map's request row all say so."""
    from nbkv.ui import charts
    from nbkv.ui import vocabulary as vocab
    from nbkv.ui.figures import EXPLAIN_TRIMMED

    engine.clear()
    for c, src in QUICKSTART.items():
        cell(shell, c, src)
    first = len(engine.history)
    capsys.readouterr()
    lines = []
    for c, src in QUICKSTART.items():  # Run All again
        cell(shell, c, src)
        lines.append(capsys.readouterr().out)
    again = list(engine.history)[first:]
    assert [r.reason for r in again] == ["replayed"] * 5, [r.reason_text for r in again]
    assert any(r.restored_from for r in again)  # the parked one came back first
    for r, out in zip(again, lines, strict=True):
        assert f"slot {r.slot}: replayed" in out, out
        assert vocab.bar(r).code == "replayed" and vocab.bar(r).words == "replayed"
    pts = charts.timeline_points(again)
    assert [p.bar for p in pts] == ["replayed"] * 5  # no gold "restored" bar
    for r in again:
        page = shell.run_line_magic("kvcache", f"explain {r.id}")
        assert page.explanation.tail_state == "reused", r.id
        html = page._repr_html_()
        assert "line-through" not in html and EXPLAIN_TRIMMED not in html
        assert ">trimmed</span>" not in html
    engine.settle()
    last = {r.slot: r for r in again}
    m = charts.kvmap_model(engine.slots(), engine.n_ctx, last)
    assert not m.bars.get("trimmed") and not m.bars.get("prefilled")
    assert not m.bars.get("generated") and m.bars.get("reused")


# -- a fork's first request: a donor copy, exact KV -----------------------------------------


PROBE = 42


def test_a_fork_copies_the_shared_turns_and_reads_only_its_new_message(engine):
    engine.clear()
    store = SessionStore()
    a = store.get("ann")
    a.system = "You are a concise assistant. Answer in one short sentence."
    for q in ("What is a CPU?", "And what does memory do?", "Why is a cache fast?"):
        a.chat(q, engine=engine, max_tokens=MAX, temperature=0)
    engine.settle()
    before = next(s for s in engine.slots() if s.session == "ann")
    fork = a.fork("ann2", at=2)
    reply = fork.chat("And a GPU?", engine=engine, max_tokens=MAX, temperature=0)
    rec = reply.record
    shared = engine.tokenize_prompt(fork.messages[:5] + [{"role": "user", "content": "x"}])
    prompt = engine.tokenize_prompt(fork.messages[:6])
    head = next(i for i, (x, y) in enumerate(zip(shared, prompt)) if x != y)
    # the five shared messages (and the template's glue up to the new text) were copied
    assert rec.donor_session == "ann" and rec.slot != before.index and rec.reason == "copied"
    assert rec.reused_tokens == head and rec.prefilled_tokens == len(prompt) - head
    assert rec.prefilled_tokens <= len(engine.tokenize_prompt(
        [{"role": "user", "content": "And a GPU?"}]))
    # ann's conversation was not cut short, and both slots hold exactly their tokens
    engine.settle()
    after = {s.session: s for s in engine.slots()}
    assert after["ann"].tokens == before.tokens
    for s in (after["ann"], after["ann2"]):
        assert np.array_equal(np.array(engine.probe(s.index, PROBE)),
                              fresh_probe(engine.model, s.tokens, PROBE))
    # and the reply is what a brand-new engine says to the same conversation
    assert reply.text == scratch_reply(engine.model.path, fork.messages[:6], max_tokens=MAX)
    assert_consistent(engine)


def test_save_and_restore_keep_turns_cells_and_states(engine, tmp_path):
    from nbkv.store import persist

    engine.clear()
    store = SessionStore()
    a = store.get("keep")
    a.system = "Be brief."
    for i, q in enumerate(("What is a CPU?", "And memory?", "And a disk?"), start=1):
        run(a, engine, q, f"k{i}", i)
    run(a, engine, "And RAM?", "k2", 4)  # turn 3 stale
    a.fork("kept", at=1)
    persist.save(engine, tmp_path, store)
    fresh = SessionStore()
    persist.restore(engine, tmp_path, fresh)
    for name in ("keep", "kept"):
        s, t = store[name], fresh[name]
        assert t.parent == s.parent and t.messages == s.messages
        assert [(x.cell, x.state, x.runs, x.stale_since, x.source) for x in t.turns] == [
            (x.cell, x.state, x.runs, x.stale_since, x.source) for x in s.turns]
    assert [x.state for x in fresh["keep"].turns] == ["live", "live", "stale"]
    # re-running the stale turn's cell after the restore refreshes it from the cache
    t = run(fresh["keep"], engine, "And a disk?", "k3", 5)
    assert t.change.action == "refreshed" and t.record.strategy == "hash-extend"
    assert_consistent(engine)


# -- a real kernel, driven as JupyterLab drives it ------------------------------------------


class Kernel:
    """An IPython kernel of this environment, sent ``execute_request`` s the way a frontend
    sends them: with the cell's id in the metadata (``cellId``), or without."""

    def __init__(self):
        import ipykernel.kernelspec as ks
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        class Here(KernelSpecManager):  # this interpreter, whatever kernels are installed
            def get_kernel_spec(self, kernel_name):
                return self.kernel_spec_class(resource_dir=ks.RESOURCES,
                                              **ks.get_kernel_dict())

        self.km = KernelManager(kernel_name="here", kernel_spec_manager=Here())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code, cell_id=None, timeout=300):
        """Execute ``code``; returns (execute_reply content, text of every output)."""
        content = {"code": code, "silent": False, "store_history": True,
                   "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
        msg = self.kc.session.msg("execute_request", content,
                                  metadata={"cellId": cell_id} if cell_id else {})
        self.kc.shell_channel.send(msg)
        mid, texts = msg["header"]["msg_id"], []
        while True:
            m = self.kc.get_iopub_msg(timeout=timeout)
            if m["parent_header"].get("msg_id") != mid:
                continue
            kind, c = m["msg_type"], m["content"]
            if kind == "stream":
                texts.append(c["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                texts.append(c["data"].get("text/plain", ""))
            elif kind == "error":
                texts.append("\n".join(c["traceback"]))
            elif kind == "status" and c["execution_state"] == "idle":
                break
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == mid:
                break
        assert reply["content"]["status"] == "ok", "\n".join(texts)
        return reply["content"], "\n".join(texts)

    def value(self, expr):
        """``expr`` evaluated in the kernel, through JSON."""
        _, out = self.run(f"import json as _j; print(_j.dumps({expr}))")
        return json.loads(out.strip().splitlines()[-1])

    def restart(self):
        """A kernel restart: a new process, nothing kept in memory."""
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=120)

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


TURNS = ("[dict(cell=t.cell and t.cell.id, count=t.cell and t.cell.count, state=t.state, "
         "q=t.question, a=t.reply, runs=t.runs) for t in nbkv.session({!r}).turns]")
RECORD = ("(lambda r: dict(strategy=r.strategy, reason=r.reason, prompt=r.prompt_tokens, "
          "reused=r.reused_tokens, prefilled=r.prefilled_tokens, trimmed=r.trimmed_tokens, "
          "div=r.divergence and [r.divergence.message, r.divergence.role]))"
          "(nbkv.current_engine().history[-1])")


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        k.run(f"%load_ext nbkv\n%config Nbkv.max_tokens = {MAX}\n"
              "%kvcache load --slots 2 --ctx 1024\nimport nbkv")
        yield k
    finally:
        k.close()


CELLS = {
    "c1": '%%chat alice --system "You are a concise assistant. Answer in one short '
          'sentence."\nWhat is a CPU?',
    "c2": "%%chat alice\nAnd what does memory do?",
    "c3": "%%chat alice\nWhy is a cache faster than memory?",
}


def test_cells_are_turns_in_a_real_kernel(kernel, model_path):
    k = kernel
    counts = {c: k.run(src, cell_id=c)[0]["execution_count"] for c, src in CELLS.items()}
    first = k.value(TURNS.format("alice"))
    assert [(t["cell"], t["count"], t["state"]) for t in first] == [
        (c, counts[c], "live") for c in CELLS]

    # re-run cell 2 with the same text: its reply is replayed from the slot, which keeps
    # turn 3 (nothing read, decoded or cut), and turn 3 stays live
    reply, out = k.run(CELLS["c2"], cell_id="c2")
    n = reply["execution_count"]
    turns, rec = k.value(TURNS.format("alice")), k.value(RECORD)
    assert [t["a"] for t in turns] == [t["a"] for t in first]
    assert [t["state"] for t in turns] == ["live"] * 3 and turns[1]["runs"] == 2
    assert rec["reason"] == "replayed" and rec["reused"] == rec["prompt"]
    assert rec["prefilled"] == 0 and rec["trimmed"] == 0
    assert "slot 0: replayed · reused" in out and "tokens from the cache" in out
    assert (f"why: re-ran cell [{n}]: turn 2 of alice is the same as before, so the turns "
            f"after it stay · the same prompt and settings as request #") in out
    assert k.value("len(nbkv.session('alice').messages)") == 7
    # --fresh decodes it again: the same reply, and the slot is cut after the question
    reply, out = k.run(CELLS["c2"].replace("alice", "alice --fresh"), cell_id="c2")
    n = reply["execution_count"]
    turns, rec = k.value(TURNS.format("alice")), k.value(RECORD)
    assert [t["a"] for t in turns] == [t["a"] for t in first]
    assert [t["state"] for t in turns] == ["live"] * 3 and turns[1]["runs"] == 3
    assert rec["strategy"] == "hash-hit" and rec["reused"] == rec["prompt"] - 2
    assert rec["trimmed"] > 0  # the old reply and turn 3 were cut from the slot
    assert (f"why: re-ran cell [{n}]: turn 2 of alice is the same as before, so the turns "
            f"after it stay · trimmed {rec['trimmed']} tokens from turn 2's reply onwards") in out

    # edit cell 2 and re-run it: the cut lands in the edited message
    edited = "%%chat alice\nAnd what does a hard disk do?"
    reply, out = k.run(edited, cell_id="c2")
    rec = k.value(RECORD)
    assert rec["reason"] == "edited" and rec["div"] == [3, "user"]
    assert 0 < rec["reused"] < rec["prompt"] and rec["trimmed"] > 0
    assert f"re-ran cell [{reply['execution_count']}]: replaced turn 2 of alice" in out
    assert "tokens from turn 2's question onwards · turn 3 is now stale" in out
    live = k.value("nbkv.session('alice').messages")
    assert [m["content"] for m in live if m["role"] == "user"] == [
        "What is a CPU?", "And what does a hard disk do?"]
    assert live[-1]["content"] == scratch_reply(model_path, live[:-1], max_tokens=MAX)

    # re-run cell 3: it refreshes on the new history and is live again
    reply, out = k.run(CELLS["c3"], cell_id="c3")
    turns = k.value(TURNS.format("alice"))
    assert [t["state"] for t in turns] == ["live"] * 3 and turns[2]["runs"] == 2
    assert "refreshed turn 3 of alice on the new history" in out
    live = k.value("nbkv.session('alice').messages")
    assert live[-1]["content"] == scratch_reply(model_path, live[:-1], max_tokens=MAX)

    # %kvcache history names each request's cell
    _, out = k.run("%kvcache history -n 1")
    table = [line for line in out.strip().splitlines() if not line.startswith("timeline:")]
    assert out.strip().splitlines()[-1] == "timeline: 1 request"  # then the chart
    row = table[-1].split()
    assert row[1:3] == ["alice", f"[{reply['execution_count']}]"]


def test_run_all_twice_gives_the_same_conversation(kernel):
    k = kernel
    cells = {f"t{c}": src.replace("alice", "tom") for c, src in CELLS.items()}
    outs = []
    for _ in range(2):
        for c, src in cells.items():
            k.run(src, cell_id=c)
        outs.append((k.value(TURNS.format("tom")), k.value("nbkv.session('tom').messages")))
    (t1, m1), (t2, m2) = outs
    assert m1 == m2 and len(m1) == 7
    assert [t["a"] for t in t1] == [t["a"] for t in t2]
    assert [t["state"] for t in t2] == ["live"] * 3 and [t["runs"] for t in t2] == [2] * 3
    # the second run was served from the cache: each cell's prompt and reply are in the
    # slot, so every reply is replayed (nothing read, nothing decoded, nothing cut)
    recs = k.value("[dict(why=r.reason, read=r.prefilled_tokens, gen=r.generated_tokens, "
                   "cut=r.trimmed_tokens) for r in nbkv.current_engine().history[-3:]]")
    assert recs == [dict(why="replayed", read=0, gen=0, cut=0)] * 3


def test_without_a_cell_id_a_cell_appends_as_in_a_terminal(kernel):
    """What nbval and nbclient send: no ``cellId`` (see the next test)."""
    k = kernel
    for _ in range(2):
        k.run("%%chat tess\nWhat is a CPU?")
    turns = k.value(TURNS.format("tess"))
    assert [(t["cell"], t["q"]) for t in turns] == [(None, "What is a CPU?")] * 2
    assert turns[1]["a"] and turns[0]["state"] == turns[1]["state"] == "live"


NOTEBOOK = {  # cell id -> source: two sessions, interleaved, then a save
    "n1": "%%chat alice --system \"You are a concise assistant.\"\nWhat is a CPU?",
    "n2": "%%chat bob --system \"You answer with short lists.\"\nName three red fruits.",
    "n3": "%%chat alice\nAnd what does memory do?",
    "n4": "%%chat bob\nWhich of them is the sweetest?",
    "n5": "%%chat alice\nWhy is a cache faster than memory?",
    "n6": "%kvcache save",
}
LOAD = f"%load_ext nbkv\n%config Nbkv.max_tokens = {MAX}\n%kvcache load --slots 2 --ctx 1024"


@pytest.mark.slow
def test_run_all_after_a_restart_and_restore_is_served_from_cache(tmp_path, monkeypatch):
    """Save, restart the kernel, ``%kvcache load --restore``, "Run All": every turn is
    served from the cache and the replies are the same."""
    monkeypatch.setenv("NBKV_SAVE_DIR", str(tmp_path))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    k = Kernel()
    turns = "[t.reply for n in ('alice', 'bob') for t in nbkv.session(n).turns]"
    figures = ("[dict(s=r.strategy, why=r.reason, reused=r.reused_tokens, "
               "prompt=r.prompt_tokens, read=r.prefilled_tokens, gen=r.generated_tokens) "
               "for r in nbkv.current_engine().history]")
    try:
        k.run(LOAD + " --restore\nimport nbkv")  # nothing saved yet: a fresh start
        for c, src in NOTEBOOK.items():
            k.run(src, cell_id=c)
        replies, cold = k.value(turns), k.value(figures)
        k.restart()
        _, out = k.run(LOAD + " --restore\nimport nbkv")
        assert "restored the save" in out
        restored = k.value("[(t.cell.id, t.state) for n in ('alice', 'bob') "
                           "for t in nbkv.session(n).turns]")
        assert restored == [[c, "live"] for c in ("n1", "n3", "n5", "n2", "n4")]
        for c, src in NOTEBOOK.items():  # Run All
            k.run(src, cell_id=c)
        assert k.value(turns) == replies
        warm = k.value(figures)
    finally:
        k.close()
    assert [r["s"] for r in cold] == ["miss", "miss", "hash-extend", "hash-extend",
                                      "hash-extend"]
    # the save kept each reply with the KV that holds it: every cell is replayed, nothing
    # is read or decoded
    assert [r["why"] for r in warm] == ["replayed"] * 5
    assert all(r["read"] == 0 and r["gen"] == 0 and r["reused"] == r["prompt"] for r in warm)
    pct = [100 * sum(r["reused"] for r in rs) / sum(r["prompt"] for r in rs)
           for rs in (cold, warm)]
    print(f"Run All after restore: {len(warm)}/{len(warm)} replies replayed, {pct[1]:.0f}% of "
          f"prompt tokens reused (without the save: {pct[0]:.0f}%, "
          f"{sum(r['read'] for r in cold)} read, {sum(r['gen'] for r in cold)} decoded)")


FRONTEND_PROBE = [  # records what each execution says about its cell
    ("hook", "seen = []\nip = get_ipython()\nif not hasattr(ip, '_nbkv_probe'):\n"
             "    ip._nbkv_probe = True\n    ip.events.register('pre_run_cell', lambda info: "
             "seen.append([info.cell_id, info.store_history]))"),
    ("probe", "1 + 1"),
    ("check", "import json, os\nwith open(os.environ['NBKV_SEEN'], 'a') as f:\n"
              "    f.write(json.dumps(seen) + '\\n')"),
]


def probe_notebook(path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src, id=cid) for cid, src in FRONTEND_PROBE]
    nbformat.write(nb, str(path))
    return nb


def test_what_nbclient_and_nbval_send_as_cell_ids(tmp_path, monkeypatch):
    """Neither sends a cell id (jupyter_client's ``execute`` has no metadata), so under
    them ``%%chat`` appends; the test suite's nbval runs send them as JupyterLab does."""
    from nbclient import NotebookClient

    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("NBKV_SEEN", str(seen))
    nb = probe_notebook(tmp_path / "probe.ipynb")
    NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    assert [json.loads(x) for x in seen.read_text().splitlines()] == [
        [[None, True], [None, True]]]  # nbclient: no cell id, history stored
    seen.unlink()
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
            "--nbval-current-env"]
    env = dict(os.environ, NBKV_SEEN=str(seen))
    p = subprocess.run(base + ["-c", os.devnull, "--rootdir", str(tmp_path),
                               str(tmp_path / "probe.ipynb")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [json.loads(x) for x in seen.read_text().splitlines()] == [
        [[None, False], [None, False]]]  # nbval: no cell id, no history
    seen.unlink()
    # through the repository's conftest.py: each notebook twice, cell ids sent (as JupyterLab)
    p = subprocess.run(base + [str(ROOT / "conftest.py"),
                               str(tmp_path / "probe.ipynb")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [json.loads(x) for x in seen.read_text().splitlines()] == [
        [["probe", True], ["check", True]]] * 2
