"""Nothing lost when the levels meet (issue 36 findings 2 and 3, issue 32 items 1 and 3).

Conversations parked in RAM or on disk that used to vanish without a word: taken by another
session's prefix copy, cleared with the slots, never parked when unnamed, dropped by a
restore or a disk budget in silence, evicted in the wrong order after a restart, deleted by
an engine with another slot count, lost at ``close()``. Each on the RAM tier and on the
disk tier where both apply, against a cache-off engine's replies and ``verify()``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_parking_engine import MAX, N_CTX, Oracle, assert_verified, slack

from conftest import run_py
from nbkv import Engine
from nbkv.core.events import ParkingDropped
from nbkv.kv import admission
from nbkv.kv.admission import FIRST, RESTORED
from nbkv.llama.models import default_model_path
from nbkv.ui.figures import summary

SHARED = ("You are a helpful librarian. You recommend one book at a time and explain your "
          "choice in a single short sentence.")
OTHERS = [f"You are a {who}. Answer in one short sentence." for who in
          ("pirate", "chef", "poet", "doctor", "judge", "robot")]
QUESTIONS = ["What should I read?", "Why that one?", "Anything shorter?"]


def user(text):
    return {"role": "user", "content": text}


def say(engine, oracle, msgs, text, session=None):
    msgs.append(user(text))
    r = engine.chat(msgs, session=session, max_tokens=MAX, temperature=0)
    assert r.text == oracle.reply(msgs), f"{session}: reply differs from a cache-off engine's"
    msgs.append(r.message)
    return r.record


def fill_slots(engine, oracle, n=2, start=0):
    """``n`` other conversations, one turn each: they take the slots."""
    for i in range(start, start + n):
        say(engine, oracle, [{"role": "system", "content": OTHERS[i]}], QUESTIONS[0], f"o{i}")


def parked(engine):
    return {i.session: i for i in engine.parked()}


@pytest.fixture(scope="module")
def model():
    return str(default_model_path())


@pytest.fixture(scope="module")
def oracle(model):
    with Engine(model, n_slots=1, n_ctx=N_CTX, cache="off") as e:
        yield Oracle(e)


@pytest.fixture(scope="module", params=["ram", "disk"])
def tier(request):
    return request.param


@pytest.fixture(scope="module")
def engine(model, tier, tmp_path_factory):
    """Two slots; parked conversations stay in RAM, or all go to disk."""
    where = ({} if tier == "ram" else
             {"park_ram": 0, "park_dir": str(tmp_path_factory.mktemp("park"))})
    with Engine(model, n_slots=2, n_ctx=N_CTX, cache_min_tokens=20, **where) as e:
        yield e


@pytest.fixture
def clean(engine):
    engine.clear(parked=True)
    return engine


# ------------------------------------------------------------------ (a) a shared prefix


def test_a_session_that_starts_like_a_parked_one_leaves_it_parked(clean, oracle, tier):
    e = clean
    x = [{"role": "system", "content": SHARED}]
    first = say(e, oracle, x, QUESTIONS[0], "x")
    fill_slots(e, oracle)
    assert parked(e)["x"].tier == tier
    y = [{"role": "system", "content": SHARED}]
    rec = say(e, oracle, y, "Recommend a poem.", "y")
    assert rec.restored_from == tier and rec.restored_session == "x"  # a copy of x's start
    assert "x" in parked(e)  # ... and x's entry is still there
    fill_slots(e, oracle, start=2)
    back = say(e, oracle, x, QUESTIONS[1], "x")
    assert back.reason == RESTORED and back.restored_session == "x"
    assert back.reused_tokens >= first.prompt_tokens - slack(e)
    assert_verified(e)


# ------------------------------------------------------------------ (b) clear


def test_clear_keeps_the_parked_conversations_and_says_so(clean, oracle, tier):
    e = clean
    x = [{"role": "system", "content": SHARED}]
    say(e, oracle, x, QUESTIONS[0], "x")
    fill_slots(e, oracle)
    said = e.clear()
    assert "1 parked conversation kept" in said and "o0" in said and "o1" in said
    assert all(s.empty for s in e.slots()) and list(parked(e)) == ["x"]
    back = say(e, oracle, x, QUESTIONS[1], "x")
    assert back.reason == RESTORED and back.restored_from == tier
    assert_verified(e)
    fill_slots(e, oracle, start=2)  # x parked again
    said = e.clear(parked=True)
    assert "; 1 parked conversation" in said and e.parked() == ()


# ------------------------------------------------------------------ (c) unnamed conversations


def test_an_unnamed_conversation_is_parked_and_comes_back(clean, oracle, tier):
    e = clean
    before = e.stats()
    convs = [[{"role": "system", "content": OTHERS[i]}] for i in range(3)]
    firsts = [say(e, oracle, c, QUESTIONS[0]) for c in convs]
    assert firsts[2].evicted_parked == tier and firsts[2].evicted_session is None
    (info,) = e.parked()
    assert info.session is None and info.tier == tier
    assert firsts[2].evicted_tokens == info.n_tokens  # what was parked, said as such
    st = e.stats()
    assert st["parks"] - before["parks"] == 1 and st["parking_drops"] == before["parking_drops"]
    assert st["evictions"] - before["evictions"] == 1
    back = say(e, oracle, convs[0], QUESTIONS[1])
    assert back.reason == RESTORED and back.restored_from == tier
    assert back.reused_tokens >= firsts[0].prompt_tokens - slack(e)
    assert_verified(e)


# ------------------------------------------------------------------ (d) restore, small lots


def test_a_restore_says_which_parked_conversations_the_lot_could_not_hold(model, oracle,
                                                                         tier, tmp_path):
    with Engine(model, n_slots=2, n_ctx=N_CTX, cache_min_tokens=20) as e:
        for i in range(4):
            say(e, oracle, [{"role": "system", "content": OTHERS[i]}], QUESTIONS[0], f"o{i}")
        assert sorted(parked(e)) == ["o0", "o1"]
        size = max(i.nbytes for i in e.parked())
        e.save(str(tmp_path / "save"))
    small = ({"park_ram": int(1.5 * size)} if tier == "ram" else
             {"park_ram": 0, "park_dir": str(tmp_path / "park"), "park_disk": int(1.5 * size)})
    heard = []
    with Engine(model, n_slots=2, n_ctx=N_CTX, **small) as e:
        unsub = e.subscribe(lambda ev: isinstance(ev, ParkingDropped) and heard.append(ev))
        rep = e.restore(str(tmp_path / "save"))
        unsub()
        assert rep.parked == ("o1",) and list(parked(e)) == ["o1"]
        assert rep.not_parked == ("o0 (over the parking budget)",)
        assert "parked: o1" in str(rep) and "not kept: o0" in str(rep)
        assert [ev.session for ev in heard] == ["o0"] and e.stats()["parking_drops"] == 1
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=0) as e:  # parking off
        rep = e.restore(str(tmp_path / "save"))
        assert rep.parked == () and e.parked() == ()
        assert rep.not_parked == ("o0 (parking is off)", "o1 (parking is off)")
        assert "parked:" not in str(rep)


# ------------------------------------------------------------------ (e) budgets announce


def test_a_budget_eviction_is_counted_announced_and_listed(model, oracle, tier, tmp_path):
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=0) as probe:
        say(probe, oracle, [{"role": "system", "content": OTHERS[0]}], QUESTIONS[0], "p")
        probe.settle()
        size = probe.core.call(lambda: probe.table[0].kv.snapshot().nbytes)
    budget = {"park_ram": int(1.5 * size)} if tier == "ram" else {
        "park_ram": 0, "park_dir": str(tmp_path), "park_disk": int(1.5 * size)}
    heard = []
    with Engine(model, n_slots=2, n_ctx=N_CTX, **budget) as e:
        e.subscribe(lambda ev: isinstance(ev, ParkingDropped) and heard.append(ev))
        fill_slots(e, oracle, n=4)  # o0 parked, then o1: o0 leaves the lot
        assert list(parked(e)) == ["o1"]
        assert [(ev.session, ev.tier) for ev in heard] == [("o0", tier)]
        assert "budget" in heard[0].why and e.stats()["parking_drops"] == 1
        assert [d.session for d in e.parking.dropped] == ["o0"]
        from IPython.core.interactiveshell import InteractiveShell  # noqa: F401 - the magics

        from nbkv.notebook import commands

        class Ws:
            def engine(self):
                return e

        table = commands.parked(Ws(), None)
        assert "dropped: o0" in table.note and "budget" in table.note


# ------------------------------------------------------------------ (f) order across restarts


OPEN_PARK_CLOSE = """
    import json, sys
    from nbkv import Engine
    model, root, budget, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    with Engine(model, n_slots=2, n_ctx=512, park_ram=0, park_dir=root, park_disk=budget) as e:
        for i, s in enumerate(names):
            e.chat([{"role": "system", "content": f"You are agent {s}."},
                    {"role": "user", "content": "Hi"}], session=s, max_tokens=2, temperature=0)
        out = sorted(i.session for i in e.parked())
    print(json.dumps(out))
"""


def test_the_least_recently_used_leaves_first_after_a_restart(model, tmp_path):
    """Entries keep their last use across processes: after a restart, the budget drops
    those used before it, not the one parked a request ago."""
    root = tmp_path / "park"
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=0) as probe:
        probe.chat([{"role": "system", "content": "You are agent p0."}, user("Hi")],
                   session="p0", max_tokens=2, temperature=0)
        size = probe.core.call(lambda: probe.table[0].kv.snapshot().nbytes)
    budget = int(3.5 * size)
    first = run_py(OPEN_PARK_CLOSE, model, root, budget, json.dumps(["p1", "p2", "p3", "p4",
                                                                      "p5"]))
    assert first == ["p1", "p2", "p3"]  # then close() spilled p4 and p5: p1, p2 left
    second = run_py(OPEN_PARK_CLOSE, model, root, budget, json.dumps(["q1", "q2", "q3"]))
    assert second == ["p4", "p5", "q1"]  # the oldest left first: p1, p2, p3


# ------------------------------------------------------------------ (g) another slot count


def test_an_engine_with_another_slot_count_serves_what_a_closed_one_parked(model, oracle,
                                                                           tmp_path):
    convs = {}
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=0, park_dir=str(tmp_path)) as e:
        for i in range(3):
            convs[f"o{i}"] = [{"role": "system", "content": OTHERS[i]}]
            say(e, oracle, convs[f"o{i}"], QUESTIONS[0], f"o{i}")
        held = {s: i.n_tokens for s, i in parked(e).items()}
    with Engine(model, n_slots=3, n_ctx=N_CTX, park_ram=0, park_dir=str(tmp_path)) as e:
        assert sorted(parked(e)) == ["o0", "o1", "o2"]  # the slots were spilled at close
        assert e.stats()["parked_skipped_corrupt"] == 0
        for s in ("o0", "o2"):
            rec = say(e, oracle, convs[s], QUESTIONS[1], s)
            assert rec.reason == RESTORED and rec.restored_from == "disk", s
            if s in held:
                assert rec.reused_tokens >= held[s] - slack(e) - MAX
        assert_verified(e)


# ------------------------------------------------------------------ (h) close spills


def test_close_spills_the_slots_and_ram_to_the_park_dir(model, oracle, tmp_path):
    convs = {}
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_dir=str(tmp_path)) as e:  # RAM first
        for i in range(3):
            convs[f"o{i}"] = [{"role": "system", "content": OTHERS[i]}]
            say(e, oracle, convs[f"o{i}"], QUESTIONS[0], f"o{i}")
        assert {i.tier for i in e.parked()} == {"ram"}
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_dir=str(tmp_path)) as e:
        assert {s: i.tier for s, i in parked(e).items()} == {s: "disk" for s in convs}
        for s, msgs in convs.items():
            rec = say(e, oracle, msgs, QUESTIONS[1], s)
            assert rec.reason == RESTORED and rec.restored_from in ("disk", "ram"), s
        assert_verified(e)


# ------------------------------------------------------------------ 3: counts that agree


def test_the_numbers_said_are_the_numbers_kept(clean, oracle, tier):
    e = clean
    a = [{"role": "system", "content": OTHERS[0]}]
    say(e, oracle, a, QUESTIONS[0], "ann")
    fill_slots(e, oracle, start=1)
    rec = e.history[-1]
    assert rec.evicted_session == "ann"
    assert rec.evicted_tokens == parked(e)["ann"].n_tokens  # "took ann's slot (N parked)"
    assert f"({rec.evicted_tokens} tokens parked)" in summary(rec)
    say(e, oracle, a, QUESTIONS[1], "ann")  # back; its reply not yet rewritten
    n = next(s.n_tokens for s in e.slots() if s.session == "ann")
    said = e.park("ann")
    kept = parked(e)["ann"].n_tokens
    assert f"ann: {kept:,} tokens to {tier}" in said
    if kept < n:
        assert f"{n - kept} token" in said and "not yet rewritten" in said


def test_a_newcomer_that_keeps_a_shared_start_is_not_called_first(model, oracle, tier,
                                                                   tmp_path):
    """The newcomer takes x's slot (the only one) and keeps the system prompt they share."""
    where = {} if tier == "ram" else {"park_ram": 0, "park_dir": str(tmp_path)}
    with Engine(model, n_slots=1, n_ctx=N_CTX, cache_min_tokens=20, **where) as one:
        x = [{"role": "system", "content": SHARED}]
        say(one, oracle, x, QUESTIONS[0], "x")
        rec = say(one, oracle, [{"role": "system", "content": SHARED}], "Recommend a poem.",
                  "newcomer")
        assert rec.reused_tokens > 0 and rec.evicted_session == "x"
        assert rec.reason == admission.SHARED and "x's conversation" in rec.reason_text, \
            rec.reason_text
        assert rec.donor_slot is None and "copied" not in summary(rec)  # no copy ran
        assert "x" in parked(one)
        # x starts over with another system prompt: a new conversation, not an eviction
        x2 = [{"role": "system", "content": OTHERS[0]}]
        rec = say(one, oracle, x2, QUESTIONS[0], "x")
        assert rec.reason in (FIRST, admission.SHARED), rec.reason_text


# ------------------------------------------------------------------ issue 32: the park dir


def test_a_park_dir_deleted_while_the_engine_runs_is_made_again(model, oracle, tmp_path):
    root = tmp_path / "park"
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=0, park_dir=str(root)) as e:
        carol = [{"role": "system", "content": SHARED}]
        say(e, oracle, carol, QUESTIONS[0], "carol")
        shutil.rmtree(root)
        said = e.park("carol")
        assert "carol" in said and "to disk" in said
        back = say(e, oracle, carol, QUESTIONS[1], "carol")
        assert back.reason == RESTORED and back.restored_from == "disk"
        root_file = tmp_path / "park"
        shutil.rmtree(root_file)
        root_file.write_text("not a directory any more")
        said = e.park("carol")
        assert "stays in slot" in said and "gone" in said
        assert any(s.session == "carol" and not s.empty for s in e.slots())
        again = say(e, oracle, carol, QUESTIONS[2], "carol")
        assert again.reason != RESTORED and again.reused_tokens >= back.prompt_tokens
        assert_verified(e)


SIX_SESSIONS_THREE_ROUNDS = """
    import json, sys
    from nbkv import Engine
    model, root, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    convs = {f"{tag}{i}": [{"role": "system", "content": f"You are agent {tag}{i}. Be brief."}]
             for i in range(6)}
    out = []
    with Engine(model, n_slots=2, n_ctx=512, park_ram=0, park_dir=root) as e:
        for rnd, q in enumerate(["Hi.", "And then?", "Why?"]):
            for s, msgs in convs.items():
                msgs.append({"role": "user", "content": q})
                r = e.chat(msgs, session=s, max_tokens=3, temperature=0)
                msgs.append(r.message)
                out.append([rnd, s, r.record.reason, r.record.restored_from,
                            r.record.restored_session])
        st = e.stats()
        out.append([st["parked_skipped_corrupt"], st["parking_drops"],
                    [v.identical for v in e.verify()]])
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_engines_in_two_processes_park_into_one_directory_and_lose_nothing(model,
                                                                                tmp_path):
    """Issue 32: 6 sessions each on 2 slots, 3 rounds; every returning turn restores."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
    procs = [subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SIX_SESSIONS_THREE_ROUNDS), model,
         str(tmp_path), tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=here) for tag in ("p", "q")]
    for p in procs:
        try:
            out, err = p.communicate(timeout=900)
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        *turns, (corrupt, drops, verified) = json.loads(out.strip().splitlines()[-1])
        assert (corrupt, drops) == (0, 0) and all(verified)
        for rnd, s, reason, tier, whose in turns:
            if rnd:  # a returning turn: its own conversation, from disk
                assert (reason, tier, whose) == (RESTORED, "disk", s), (rnd, s, reason)
