"""Parking on real models (issue 23): conversations that lose their slot are parked in RAM
or on disk and restored exactly.

More conversations than slots, on every memory class and with an image; RAM and disk
budgets against the states' real sizes; corrupt and foreign disk entries; a request that
arrives while a slot is parked and an interrupt during a restore; parked entries across a
save and a restore in a new process; parking by hand. Replies are compared with a cache-off
engine, and every slot's KV with a from-scratch decode (``engine.verify()``: probe logits,
``np.array_equal``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
import time

import pytest
from test_families import assert_kv_exact, model_for, user

from conftest import assert_consistent, picture, run_py
from nbkv import Engine
from nbkv.core.events import ParkingDropped, RequestStarted
from nbkv.engine.slot_parking import Parker
from nbkv.engine.slots import REPLY_TAIL
from nbkv.kv import policy
from nbkv.kv.admission import EVICTED, RESTORED
from nbkv.llama.models import default_model_path
from nbkv.store.blobstore import BLOBS, manifest_text
from nbkv.store.park_disk import ENTRIES, entry_file

MAX = 5
N_CTX = 512
SYSTEMS = [f"You are a {who}. Answer in one short sentence."
           for who in ("pirate", "chef", "poet", "doctor", "judge", "robot")]
QUESTIONS = ["What is a CPU?", "And memory?", "Why is a cache fast?"]
# every memory class, and K-quant weights (Q4_K_M: grouped prefill, split generation steps)
SLOW_FAMILIES = ("gemma3", "lfm2", "mamba2", "granitehybrid", "smollm2-q4km", "lfm2-q4km")
LOG = "nbkv.store.parking"


def open_conversations(n):
    return {f"s{i}": [{"role": "system", "content": SYSTEMS[i]}] for i in range(n)}


def slack(engine):
    """Positions the prefill grouping may read again after a reused prefix; on memory that
    cannot be cut, back to the checkpoint a few positions before a prompt's end."""
    rule = engine.prefill_rule
    return rule.min_chunk + rule.align + (
        REPLY_TAIL if engine.memory.checkpoints else 0)


def assert_verified(engine):
    """Every slot consistent with its record and bit-identical to a from-scratch decode."""
    engine.settle()
    assert_consistent(engine)
    checks = engine.verify()
    assert checks and all(v.identical for v in checks), [str(v) for v in checks]


def parked_by_session(engine):
    return {i.session: i for i in engine.parked()}


class Oracle:
    """Replies of a cache-off engine (nothing cached: every request read from scratch),
    remembered by conversation: tests here ask the same first turns again and again."""

    def __init__(self, engine):
        self.engine, self.memo = engine, {}

    def reply(self, msgs):
        try:
            key = json.dumps(msgs)
        except TypeError:  # an image: not remembered
            return self.engine.chat(msgs, max_tokens=MAX, temperature=0).text
        if key not in self.memo:
            self.memo[key] = self.engine.chat(msgs, max_tokens=MAX, temperature=0).text
        return self.memo[key]


def say(engine, oracle, msgs, text, session):
    """Append a user turn, chat greedily, check the reply against ``oracle``, append it."""
    msgs.append(user(text))
    r = engine.chat(msgs, session=session, max_tokens=MAX, temperature=0)
    assert r.text == oracle.reply(msgs), (
        f"{session}: {r.record.reason} reply differs from a cache-off engine's")
    msgs.append(r.message)
    return r.record


def state_size(engine, session):
    """Bytes of the state llama.cpp gives for ``session``'s slot (its whole sequence)."""
    slot = next(s.index for s in engine.slots() if s.session == session)
    return engine.core.call(lambda: ctypes.sizeof(engine.ctx.state_get(slot)))


@pytest.fixture(scope="module")
def model():
    return str(default_model_path())


@pytest.fixture(scope="module")
def oracle(model):
    """The reference: the same request with nothing cached."""
    with Engine(model, n_slots=1, n_ctx=N_CTX, cache="off") as e:
        yield Oracle(e)


@pytest.fixture(scope="module")
def engine(model):
    """SmolLM2 on two slots, parking in RAM (the default budget)."""
    with Engine(model, n_slots=2, n_ctx=N_CTX, cache_min_tokens=20) as e:
        yield e


# ------------------------------------------------------------------ more conversations than slots


@pytest.fixture(scope="module", params=["smollm2", *(pytest.param(f, marks=pytest.mark.slow)
                                                     for f in SLOW_FAMILIES)])
def family(request):
    if request.param == "smollm2":  # the module's engines
        engine = request.getfixturevalue("engine")
        engine.clear(parked=True)
        yield "smollm2", engine, request.getfixturevalue("oracle")
        return
    if request.param == "smollm2-q4km":
        from nbkv.fixtures import quantized

        path = str(quantized(model_for("smollm2"), "Q4_K_M"))
    else:
        path = model_for(request.param)
    with Engine(path, n_slots=2, n_ctx=N_CTX, cache_min_tokens=20) as e, \
            Engine(path, n_slots=1, n_ctx=N_CTX, cache="off") as off:
        yield request.param, e, Oracle(off)


def test_six_sessions_on_two_slots_restore_from_ram_exactly(family):
    name, engine, oracle = family
    before = engine.stats()
    convs = open_conversations(6)
    last = {}
    for rnd, q in enumerate(QUESTIONS):
        for i, (s, msgs) in enumerate(convs.items()):
            parked = parked_by_session(engine).get(s)
            rec = say(engine, oracle, msgs, q, s)
            if rnd == 0:
                # the third session on takes the least recently used slot: parked, not lost
                assert (rec.evicted_session is not None) == (i >= 2)
                assert rec.evicted_parked == ("ram" if i >= 2 else "")
                assert rec.restored_from == "" and rec.reason != RESTORED
            else:
                assert parked is not None, f"{name}: {s} was not parked"
                assert rec.evicted_parked == "ram"
                # every memory class: a sliding-window state put back whole goes back to a
                # checkpoint where the prompt leaves it inside the reply (random weights)
                assert rec.reason == RESTORED, (name, s, rnd, rec.reason_text)
                assert (rec.restored_from, rec.restored_session) == ("ram", s)
                assert rec.restored_tokens == rec.reused_tokens <= parked.n_tokens
                # the restore proper is timed apart from the admission and the park around it
                assert 0 < rec.unpark_s <= rec.restore_s - rec.park_s
                # at least the previous prompt: only the unrewritten reply may be read again
                # (sliding-window states are parked where their window puts back exactly)
                swa = policy.SWA_CELLS if engine.memory.kind == "sliding-window" else 0
                assert rec.reused_tokens >= last[s].prompt_tokens - slack(engine) - swa, (
                    name, s, rnd, rec.reused_tokens, last[s].prompt_tokens)
                assert rec.prefilled_tokens == rec.prompt_tokens - rec.reused_tokens
                assert rec.encoder_runs == 0
            last[s] = rec
        assert_verified(engine)
    records = engine.history[-18:]
    restored = sum(r.reason == RESTORED for r in records)
    assert restored == 12, (name, restored)
    st = engine.stats()
    assert st["parks"] - before["parks"] == 16 and st["parking_drops"] == 0
    assert st["restores"] - before["restores"] == restored
    # every session is in a slot or parked; one not restored (a sliding-window state longer
    # than the window) leaves its entry parked beside its slot, until it is parked again
    held = {i.session for i in engine.parked()}
    in_slots = {s.session for s in engine.slots()}
    assert held | in_slots == set(convs)
    assert st["parked_ram_entries"] == 4 + len(held & in_slots)
    assert st["parked_disk_entries"] == 0
    if engine.memory.kind != "sliding-window":
        assert not held & in_slots
    assert_kv_exact(engine)


@pytest.mark.slow
@pytest.mark.parametrize("parked", [False, True])
def test_sliding_window_an_edited_message_goes_back_no_further_than_it_must(parked):
    """An edit behind the window: a live slot cuts there; a state put back from RAM holds
    only the window before its end, so it goes back to the checkpoint before the edit (the
    newest one whose window puts back exactly)."""
    path = model_for("gemma3")
    with Engine(path, n_slots=2, n_ctx=N_CTX, cache_min_tokens=20) as e, \
            Engine(path, n_slots=1, n_ctx=N_CTX, cache="off") as off:
        off = Oracle(off)
        msgs = [{"role": "system", "content": SYSTEMS[0]}]
        say(e, off, msgs, QUESTIONS[0], "s0")
        e.settle()
        before = next(s for s in e.slots() if s.session == "s0")
        if parked:
            e.park("s0")
            held = parked_by_session(e)
            assert set(held["s0"].checkpoints) <= set(before.checkpoints)
        rec = say(e, off, msgs[:1], "What is a disk?", "s0")  # the question edited
        assert_verified(e)
        div = policy.common_prefix(before.tokens, e.tokenize_prompt(msgs[:1] + [
            user("What is a disk?")]))
        if parked:
            info = held["s0"]
            cut = max(c for c in info.checkpoints if c <= div)
            assert rec.restored_from == "ram" and rec.checkpoint_pos == cut > 0
            assert rec.reused_tokens == cut and policy.restorable("sliding-window", 8, cut)
            assert info.n_tokens > div  # parked past the edit: the checkpoint was needed
        else:
            assert rec.checkpoint_pos is None
            assert rec.reused_tokens >= len(e.tokenize_prompt(msgs[:1])) - slack(e)


# ------------------------------------------------------------------ an image in a parked slot


def test_an_image_in_a_parked_conversation_comes_back_without_the_encoder(model):
    from nbkv.fixtures import make_mmproj

    pytest.importorskip("PIL.Image")
    mmproj = str(make_mmproj(kind="tiny"))
    with Engine(model, mmproj=mmproj, n_slots=2, n_ctx=N_CTX, n_threads=1) as e, \
            Engine(model, mmproj=mmproj, n_slots=1, n_ctx=N_CTX, cache="off", n_threads=1) as o:
        off = Oracle(o)
        pics = [{"role": "system", "content": "You describe pictures. Be brief."}]
        pics.append({"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image", "image": picture(5)}]})
        first = e.chat(pics, session="pics", max_tokens=MAX, temperature=0)
        assert first.text == off.reply(pics)
        assert first.record.encoder_runs == 1
        pics.append(first.message)
        others = open_conversations(2)
        for s, msgs in others.items():  # the second one takes the pictures' slot
            rec = say(e, off, msgs, QUESTIONS[0], s)
        assert rec.evicted_session == "pics" and rec.evicted_parked == "ram"
        held = parked_by_session(e)["pics"]
        assert sum(not isinstance(t, int) for t in held.tokens) == 16  # the image's positions
        back = say(e, off, pics, "Describe its colours.", "pics")
        assert back.reason == RESTORED and back.restored_from == "ram"
        assert back.encoder_runs == 0 and back.embedding_cache_hits == 0
        assert back.media_chunks == back.media_reused == 1
        assert back.reused_tokens >= first.record.prompt_tokens - slack(e)
        assert_verified(e)


# ------------------------------------------------------------------ budgets and tiers


@pytest.fixture(scope="module")
def entry_bytes(engine, oracle):
    """The real size of one parked one-turn conversation (measured on the shared engine)."""
    engine.clear(parked=True)
    convs = open_conversations(3)
    for s, msgs in convs.items():
        say(engine, oracle, msgs, QUESTIONS[0], s)
    sizes = [i.nbytes for i in engine.parked()]
    assert len(sizes) == 1 and sizes[0] > 0
    engine.clear(parked=True)
    return sizes[0]


def run_one_turn_each(engine, oracle, convs):
    """Each conversation's first turn; returns their records and each slot state's real
    size, measured settled just after its turn (what parking it later must copy)."""
    records, sizes = {}, {}
    for s, msgs in convs.items():
        records[s] = say(engine, oracle, msgs, QUESTIONS[0], s)
        engine.settle()
        sizes[s] = state_size(engine, s)
    return records, sizes


def test_a_ram_budget_of_two_entries_spills_the_third_to_disk(model, oracle, entry_bytes,
                                                              tmp_path):
    budget = int(2.5 * entry_bytes)
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=budget, park_dir=str(tmp_path)) as e:
        convs = open_conversations(5)
        firsts, sizes = run_one_turn_each(e, oracle, convs)
        assert max(sizes.values()) < 1.2 * min(sizes.values())  # alike: 2 fit, 3 do not
        e.parking.flush()  # s0's spill is written by the writer thread
        parked = parked_by_session(e)
        assert {s: i.tier for s, i in parked.items()} == {"s0": "disk", "s1": "ram",
                                                          "s2": "ram"}
        for s, info in parked.items():  # plain attention: no checkpoints, the state alone
            assert info.nbytes == sizes[s], (s, info.nbytes, sizes[s])
        st = e.stats()
        assert (st["parks"], st["spills"], st["parking_drops"]) == (3, 1, 0)
        assert st["parked_ram_bytes"] == sizes["s1"] + sizes["s2"] <= budget
        ns = e.parking.disk.dir  # this engine's namespace in the directory
        on_disk = sum(p.stat().st_size for p in (ns / BLOBS).iterdir())
        assert st["parked_disk_bytes"] == on_disk == sizes["s0"]
        assert len(list((ns / ENTRIES).iterdir())) == 1

        rec = say(e, oracle, convs["s0"], QUESTIONS[1], "s0")  # back from disk, into s3's slot
        assert rec.reason == RESTORED and rec.restored_from == "disk"
        assert rec.reused_tokens >= firsts["s0"].prompt_tokens - slack(e)
        assert rec.evicted_session == "s3" and rec.evicted_parked == "ram"
        e.parking.flush()
        st = e.stats()
        assert st["restores"] == 1 and st["spills"] == 2  # s3 parked: s1 left RAM for disk
        assert {s: i.tier for s, i in parked_by_session(e).items()} == {
            "s1": "disk", "s2": "ram", "s3": "ram"}
        assert_verified(e)


def test_without_a_disk_tier_what_leaves_ram_is_dropped(model, oracle, entry_bytes):
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=int(1.5 * entry_bytes)) as e:
        convs = open_conversations(4)
        _, sizes = run_one_turn_each(e, oracle, convs)
        parked = parked_by_session(e)
        assert list(parked) == ["s1"] and parked["s1"].tier == "ram"
        assert parked["s1"].nbytes == sizes["s1"]
        st = e.stats()
        assert (st["parks"], st["spills"], st["parking_drops"]) == (2, 0, 1)
        assert st["parked_ram_bytes"] == sizes["s1"] and st["parked_disk_bytes"] == 0
        rec = say(e, oracle, convs["s0"], QUESTIONS[1], "s0")  # dropped: rebuilt
        assert rec.reason == EVICTED and rec.restored_from == ""
        assert "parked copy was gone" in rec.reason_text
        assert_verified(e)


# ------------------------------------------------------------------ bad disk entries


@pytest.fixture(scope="module")
def disk_engine(model, tmp_path_factory):
    """Every parked entry goes straight to disk (no RAM budget)."""
    root = tmp_path_factory.mktemp("parked")
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=0, park_dir=str(root)) as e:
        yield e, root


def park_s0_on_disk(engine, oracle):
    """s0, s1 and s2's first turns: s0 is parked on disk; returns the conversations and
    s0's parked entry."""
    engine.clear(parked=True)
    convs = open_conversations(3)
    for s, msgs in convs.items():
        say(engine, oracle, msgs, QUESTIONS[0], s)
    info = parked_by_session(engine)["s0"]
    assert info.tier == "disk"
    return convs, info


def edit_manifest(path, change):
    """Rewrite a parked entry's manifest with ``change(body)`` applied, checksum recomputed
    (what another engine sharing the directory would have written)."""
    body = json.loads(path.read_text())["body"]
    change(body)
    path.write_text(manifest_text(body))


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def foreign_model(body):
    body["identity"]["model"]["fingerprint"] = "0" * 16


def other_n_ctx(body):
    body["identity"]["n_ctx"] = 2 * N_CTX


@pytest.mark.parametrize("damage, says", [("truncated", "truncated"), ("flipped", "checksum"),
                                          ("model", "another engine: model"),
                                          ("n_ctx", "another engine: n_ctx")])
def test_a_bad_disk_entry_is_skipped_logged_and_rebuilt(disk_engine, oracle, caplog, damage,
                                                        says):
    e, root = disk_engine
    convs, info = park_s0_on_disk(e, oracle)
    ns = e.parking.disk.dir
    manifest = ns / ENTRIES / entry_file(info.key)
    state_blob = ns / BLOBS / json.loads(manifest.read_text())["body"]["entry"]["state"]
    if damage in ("truncated", "flipped"):
        (truncate if damage == "truncated" else flip)(state_blob)
    else:
        edit_manifest(manifest, foreign_model if damage == "model" else other_n_ctx)
    skipped = e.stats()["parked_skipped_corrupt"]
    with caplog.at_level(logging.WARNING, logger=LOG):
        rec = say(e, oracle, convs["s0"], QUESTIONS[1], "s0")
    assert rec.reason != RESTORED and rec.restored_from == ""
    warned = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert any(manifest.name in m and says in m for m in warned), warned
    assert e.stats()["parked_skipped_corrupt"] == skipped + 1
    assert not manifest.exists() and "s0" not in parked_by_session(e)
    assert_verified(e)


def test_a_park_directory_turned_read_only_still_serves_and_admits(disk_engine, oracle):
    """Issue 48: a disk error turns the directory read-only mid-session. The entry parked
    there is served (was: a raw OSError [Errno 30]), and new conversations get in: each
    slot they take is parked nowhere, announced (ParkingDropped), and nothing raises."""
    from tests.test_park_faults import read_only

    e, root = disk_engine
    convs, info = park_s0_on_disk(e, oracle)
    heard = []
    unsub = e.subscribe(lambda ev: isinstance(ev, ParkingDropped) and heard.append(ev))
    mp = pytest.MonkeyPatch()
    read_only(mp, root)
    try:
        rec = say(e, oracle, convs["s0"], QUESTIONS[1], "s0")
        assert rec.restored_from == "disk"
        more = open_conversations(5)
        for s in ("s3", "s4"):  # each takes a slot whose conversation cannot be parked
            say(e, oracle, more[s], QUESTIONS[0], s)
    finally:
        mp.undo()
    e.settle()
    unsub()
    assert heard and all("Read-only" in d.why for d in heard), [d.why for d in heard]
    assert "s0" not in parked_by_session(e)
    assert_verified(e)


def test_an_engine_with_another_n_ctx_on_the_directory_leaves_the_entries_alone(
        model, oracle, disk_engine):
    e, root = disk_engine
    convs, info = park_s0_on_disk(e, oracle)
    manifest = e.parking.disk.dir / ENTRIES / entry_file(info.key)
    with Engine(model, n_slots=2, n_ctx=2 * N_CTX, park_ram=0, park_dir=str(root)) as other:
        assert other.parked() == ()
        assert other.stats()["parked_skipped_corrupt"] == 0
        msgs = convs["s0"]
        msgs.append(user(QUESTIONS[1]))
        r = other.chat(msgs, session="s0", max_tokens=MAX, temperature=0)
        assert r.text == oracle.reply(msgs)
        assert r.record.reason != RESTORED and r.record.reused_tokens == 0
        assert_verified(other)
    assert manifest.exists()  # still the first engine's, and still served by it
    rec = say(e, oracle, convs["s0"][:-1], QUESTIONS[1], "s0")
    assert rec.reason == RESTORED and rec.restored_from == "disk"
    e.clear(parked=True)


# ------------------------------------------------------------------ concurrency, interrupts


def test_a_request_arriving_while_a_slot_is_parked(engine, oracle, monkeypatch):
    """Four sessions at once on two slots, then five: the fifth arrives while a slot is
    being parked (the copy is held back until it is queued)."""
    engine.clear(parked=True)
    real = Parker.park_slot
    convs = open_conversations(5)
    late = convs.pop("s4")
    late.append(user(QUESTIONS[0]))
    arrived, streams = threading.Event(), []

    def slow_park(parker, slot, **kw):  # on the scheduler thread, before the copy
        if not kw and not arrived.is_set() and slot.tokens:  # a displaced slot's park
            threading.Thread(target=lambda: (streams.append(engine.chat(
                late, session="s4", stream=True, max_tokens=MAX, temperature=0)),
                arrived.set())).start()
            assert arrived.wait(10)
            time.sleep(0.05)
        return real(parker, slot, **kw)

    monkeypatch.setattr(Parker, "park_slot", slow_park)
    for q in QUESTIONS[:2]:
        for msgs in convs.values():
            msgs.append(user(q))
        results = engine.chat_many(list(convs.values()), list(convs), max_tokens=MAX,
                                   temperature=0)
        if streams:  # the late request: its reply, then it joins the others
            assert arrived.is_set()
            reply = streams.pop().result()
            assert reply.text == oracle.reply(late)
            late.append(reply.message)
            convs["s4"] = late
        for (s, msgs), r in zip(convs.items(), results):
            assert r.text == oracle.reply(msgs), s
            msgs.append(r.message)
        assert_consistent(engine)
    records = engine.history[-9:]
    assert sum(r.evicted_parked == "ram" for r in records) >= 4
    assert sum(r.reason == RESTORED for r in records) >= 2
    assert_verified(engine)


@pytest.mark.parametrize("how", ["started", "close", "interrupt"])
def test_an_interrupt_during_a_restore_leaves_the_engine_consistent(engine, oracle,
                                                                    monkeypatch, how):
    """Cancelled right after the restoring request started (a subscriber), or while the
    parked state is being copied into the slot: by ``close()`` or by Ctrl-C."""
    engine.clear(parked=True)
    convs = open_conversations(3)
    for s, msgs in convs.items():  # s2 takes s0's slot: s0 is parked
        say(engine, oracle, msgs, QUESTIONS[0], s)
    first = engine.history[-3]
    msgs = convs["s0"]
    msgs.append(user(QUESTIONS[1]))
    holder, ready, restoring = [], threading.Event(), threading.Event()
    real = Parker.restore_into

    def cancelled():
        return ready.wait(10) and holder[0]._job.cancel.is_set()

    def slow_restore(parker, slot, entry):  # on the scheduler thread: the copy waits
        restoring.set()
        if how == "interrupt" and ready.wait(10):
            os.kill(os.getpid(), signal.SIGINT)  # what a notebook's interrupt button does
        deadline = time.monotonic() + 10
        while not cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(parker, slot, entry)

    def on_event(ev):  # on the scheduler thread, before the prefill
        if isinstance(ev, RequestStarted) and ev.record.restored_from and ready.wait(10):
            holder[0]._job.cancel.set()

    if how == "started":
        unsubscribe = engine.subscribe(on_event)
    else:
        monkeypatch.setattr(Parker, "restore_into", slow_restore)
        unsubscribe = lambda: None  # noqa: E731
    try:
        stream = engine.chat(msgs, session="s0", stream=True, max_tokens=MAX, temperature=0)
        holder.append(stream)
        if how == "interrupt":
            with pytest.raises(KeyboardInterrupt):
                try:
                    ready.set()
                    for _ in stream:  # a Ctrl-C while waiting here cancels the request
                        pass
                except KeyboardInterrupt:
                    stream.close()  # ... and one landing just before the loop, too
                    raise
        elif how == "close":
            ready.set()
            assert restoring.wait(10)
            stream.close()
        else:
            ready.set()
            assert list(stream) == []
    finally:
        unsubscribe()
    rec = stream.record
    assert rec.finish_reason == "cancelled" and rec.generated_tokens == 0
    assert rec.restored_from == "ram" and rec.reason == RESTORED
    assert_verified(engine)
    monkeypatch.undo()
    again = engine.chat(msgs, session="s0", max_tokens=MAX, temperature=0)
    assert again.text == oracle.reply(msgs)
    assert again.record.reused_tokens >= first.prompt_tokens - slack(engine)
    assert_verified(engine)


# ------------------------------------------------------------------ saves, parking by hand


RESTORE_INTO_ONE_SLOT = """
    import json, sys
    from conftest import assert_consistent
    from nbkv import Engine

    model, save, convs, most = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    with Engine(model, n_slots=1, n_ctx=512) as e:
        e.restore(save)
        parked = sorted(i.session for i in e.parked())
        out = {"slot": e.slots()[0].session, "parked": parked, "turns": {}}
        for s in ("s0", "s2"):  # parked in the save; in a slot of the save
            r = e.chat(convs[s], session=s, max_tokens=most, temperature=0)
            rec = r.record
            out["turns"][s] = [r.text, rec.reason, rec.restored_from, rec.reused_tokens]
        e.settle()
        assert_consistent(e)
        out["verified"] = [v.identical for v in e.verify()]
        print(json.dumps(out))
"""


def test_parked_entries_survive_a_save_and_a_restore_into_fewer_slots(engine, oracle, model,
                                                                      tmp_path):
    engine.clear(parked=True)
    convs = open_conversations(4)
    for s, msgs in convs.items():  # s0 and s1 parked, s2 and s3 in the slots
        say(engine, oracle, msgs, QUESTIONS[0], s)
    assert sorted(parked_by_session(engine)) == ["s0", "s1"]
    held = {s: i.n_tokens for s, i in parked_by_session(engine).items()}
    held.update({s.session: s.n_tokens for s in engine.slots()})
    engine.save(str(tmp_path / "save"))
    for msgs in convs.values():
        msgs.append(user(QUESTIONS[1]))
    out = run_py(RESTORE_INTO_ONE_SLOT, model, tmp_path / "save", json.dumps(convs), MAX)
    # one slot: the most recently used (s3) is put back, s2 is parked with s0 and s1
    assert out["slot"] == "s3" and out["parked"] == ["s0", "s1", "s2"]
    for s in ("s0", "s2"):
        text, reason, tier, reused = out["turns"][s]
        assert text == oracle.reply(convs[s]), s
        assert (reason, tier) == (RESTORED, "ram"), s
        assert held[s] - slack(engine) - MAX <= reused <= held[s], (s, reused, held[s])
    assert out["verified"] == [True]


def test_parking_a_session_by_hand_then_its_request_restores_it(engine, oracle):
    engine.clear(parked=True)
    alice = [{"role": "system", "content": SYSTEMS[0]}]
    first = say(engine, oracle, alice, QUESTIONS[0], "alice")
    engine.settle()
    n = next(s.n_tokens for s in engine.slots() if s.session == "alice")
    said = engine.park("alice")
    assert "alice" in said and "ram" in said
    assert all(s.session != "alice" or s.empty for s in engine.slots())
    (info,) = engine.parked()
    assert (info.session, info.tier, info.n_tokens) == ("alice", "ram", n)
    rec = say(engine, oracle, alice, QUESTIONS[1], "alice")
    assert rec.reason == RESTORED and (rec.restored_from, rec.restored_session) == ("ram",
                                                                                   "alice")
    assert rec.reused_tokens >= first.prompt_tokens and engine.parked() == ()
    assert_verified(engine)
    engine.park("alice")
    assert "alice" in engine.unpark("alice")
    again = say(engine, oracle, alice, QUESTIONS[2], "alice")  # its own slot again
    assert again.reason != RESTORED and again.restored_from == ""
    assert again.reused_tokens >= rec.prompt_tokens
    assert_verified(engine)


# ------------------------------------------------------------------ parking at memory speed


def idle_passes(engine, n=3):
    """Let the scheduler run a few idle iterations (it copies out the next park there)."""
    for _ in range(n):
        engine.core.call(lambda: None)
        time.sleep(0.05)


def test_the_next_park_is_copied_out_in_idle_time_and_buffers_are_reused(engine, oracle,
                                                                         monkeypatch):
    """Six sessions take turns on two slots: in idle time the slot parked next is copied
    out, so the request that parks it copies nothing; the state buffers restored
    conversations leave are read into again. Every reply and slot stays exact."""
    from nbkv.kv.slot_kv import SlotKV

    engine.clear()
    snapshots, parking = [], []
    real_snapshot, real_park = SlotKV.snapshot, Parker.park_slot

    def snapshot(self):
        snapshots.append(bool(parking))
        return real_snapshot(self)

    def park(parker, slot, **kw):
        if kw:  # not a displaced slot's park (a branch, a park by hand)
            return real_park(parker, slot, **kw)
        parking.append(slot.index)
        try:
            return real_park(parker, slot)
        finally:
            parking.clear()

    monkeypatch.setattr(SlotKV, "snapshot", snapshot)
    monkeypatch.setattr(Parker, "park_slot", park)
    convs = open_conversations(4)
    reused = engine.ctx.buffers.reused
    idle_before = engine.counters()["idle_host_s"].get("parking")
    for q in QUESTIONS[:2]:
        for s, msgs in convs.items():
            engine.settle()
            idle_passes(engine)
            snapshots.clear()
            rec = say(engine, oracle, msgs, q, s)
            assert rec.evicted_parked in ("", "ram")
            if rec.evicted_parked:  # parked without a copy in its request
                assert True not in snapshots, (s, rec.reason_text)
    # the conversations grow, and still the buffers restores free are read into again:
    # every park of the second round after its first restore
    assert engine.ctx.buffers.reused - reused >= 3, engine.ctx.buffers.reused - reused
    assert sum(r.reason == RESTORED for r in engine.history[-4:]) == 4
    # the copies made ahead are idle-time work: counted apart from the requests' host time
    assert engine.counters()["idle_host_s"].get("parking") != idle_before
    assert_verified(engine)
