"""%kvcache save / restore (nbkv.store.persist) on the real model: continuity across a real restart,
bad saves refused with the engine unchanged, atomicity under SIGKILL, hybrid checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import QUESTIONS, SYSTEM, assert_consistent, fresh_probe, picture, run_py
from nbkv import Engine
from nbkv.core.errors import EngineBusy, RestoreError, SaveError
from nbkv.kv import policy
from nbkv.kv.oracle import scratch_logits
from nbkv.notebook.sessions import SessionStore
from nbkv.store import autosave, blobstore, persist

PIL = pytest.importorskip("PIL.Image")
MAX = 8
PROBE = 42
CFG = dict(n_slots=2, n_ctx=1024, n_threads=2)
VISION_SYSTEM = "You describe pictures for a blind user. Be brief and concrete."
TURNS_A = [("What is in this picture?", 1), "Describe its colours.", "Is it bright?"]
TURNS_B = QUESTIONS[:3]
NEXT_A, NEXT_B = "Name one shape in it.", QUESTIONS[3]
HERE = Path(__file__).parent
ROOT = HERE.parent


def content(turn):
    if isinstance(turn, tuple):
        return [{"type": "text", "text": turn[0]}, {"type": "image", "image": picture(turn[1])}]
    return turn


def scratch_probe(model, projector, units, probe, images):
    """Logits of ``probe`` after ``units`` decoded from scratch in a fresh context.

    Text in batched runs (never a lone-token batch), each image from a fresh encode by
    ``projector`` (give it its own embedding cache).
    """
    return scratch_logits(model, units, probe, projector=projector, images=images)


# -- continuity across a real restart ---------------------------------------------------------


@pytest.fixture(scope="module")
def mmproj():
    from nbkv.fixtures import make_mmproj

    return str(make_mmproj(kind="tiny"))


@pytest.fixture(scope="module")
def vision_run(model_path, mmproj, tmp_path_factory):
    """Three turns in two sessions (an image in one), a save, then the uninterrupted 4th turn."""
    save_dir = tmp_path_factory.mktemp("persist") / "save"
    store = SessionStore()
    with Engine(model_path, mmproj=mmproj, **CFG) as e:
        alice, bob = store.get("alice"), store.get("bob")
        alice.system, bob.system = VISION_SYSTEM, SYSTEM
        for ta, tb in zip(TURNS_A, TURNS_B):
            alice.chat(content(ta), engine=e, max_tokens=MAX, temperature=0)
            bob.chat(tb, engine=e, max_tokens=MAX, temperature=0)
        report = e.save(save_dir, store)
        assert e.last_save is report
        held = {s.session: s.tokens for s in e.slots()}
        ra = alice.chat(NEXT_A, engine=e, max_tokens=MAX, temperature=0)
        rb = bob.chat(NEXT_B, engine=e, max_tokens=MAX, temperature=0)
        assert ra.record.strategy == rb.record.strategy == policy.HASH_EXTEND
        yield {"dir": save_dir, "report": report, "next": [ra.text, rb.text], "held": held,
               "engine": e, "store": store}


RESTART = """
    import json, sys
    import numpy as np
    from nbkv import Engine
    from nbkv.media.embeddings import EmbeddingCache
    from nbkv.media.images import Image
    from nbkv.media.projector import Projector
    from nbkv.notebook.sessions import SessionStore
    from test_persist import CFG, MAX, NEXT_A, NEXT_B, PROBE, scratch_probe

    model_path, mmproj, save = sys.argv[1:4]
    store = SessionStore()
    out = {}
    with Engine(model_path, mmproj=mmproj, **CFG) as e:
        rep = e.restore(save, store)
        out["dropped"] = list(rep.dropped)
        proj = e.projector
        images = {p["image"].hash: p["image"] for s in store for m in s.messages
                  if isinstance(m["content"], list) for p in m["content"]
                  if isinstance(p.get("image"), Image)}
        out["images"] = len(images)
        out["slots"] = [(s.session, s.n_tokens, s.n_media, len(s.segments)) for s in e.slots()]
        # configured as the engine's (flash attention off): its own, empty embedding cache
        oracle = Projector(mmproj, e.model, cache=EmbeddingCache(), n_threads=2,
                           flash_attn=0)
        out["equal"], out["emb_equal"] = [], []
        for s in e.slots():
            got = np.array(e.probe(s.index, PROBE))
            out["equal"].append(bool(np.array_equal(
                got, scratch_probe(e.model, oracle, s.tokens, PROBE, images))))
        for h, img in images.items():
            cached = proj.cache.peek((proj.identity, h))
            fresh = oracle.embedding(img)
            out["emb_equal"].append(cached is not None and all(
                np.array_equal(a, b) for a, b in zip(cached.arrays, fresh.arrays)))
        oracle.close()
        ra = store["alice"].chat(NEXT_A, engine=e, max_tokens=MAX, temperature=0)
        rb = store["bob"].chat(NEXT_B, engine=e, max_tokens=MAX, temperature=0)
        out["next"] = [ra.text, rb.text]
        out["records"] = [(r.record.strategy, r.record.encoder_runs, r.record.media_reused)
                          for r in (ra, rb)]
        out["encoder_runs"] = proj.stats.encoder_runs
    print(json.dumps(out))
"""


def test_continuity_across_a_real_restart(vision_run, model_path, mmproj):
    rep = vision_run["report"]
    assert len(rep.slots) == 2 and rep.embeddings == 1 and set(rep.sessions) == {"alice", "bob"}
    assert all(s.nbytes > 0 for s in rep.slots)
    out = run_py(RESTART, model_path, mmproj, vision_run["dir"])
    assert out["dropped"] == [] and out["images"] == 1
    sessions = {s[0]: s for s in out["slots"]}
    assert sessions["alice"][1] == len(vision_run["held"]["alice"]) and sessions["alice"][2] == 1
    assert sessions["bob"][1] == len(vision_run["held"]["bob"])
    assert all(s[3] > 0 for s in out["slots"])  # the KV map is back before any request
    assert out["equal"] == [True, True]  # every slot's KV == a from-scratch decode
    assert out["emb_equal"] == [True]
    assert out["next"] == vision_run["next"]  # bit for bit, as if never restarted
    for strategy, encoder_runs, _ in out["records"]:
        assert strategy == policy.HASH_EXTEND and encoder_runs == 0
    assert out["records"][0][2] == 1  # alice's picture was reused from the restored KV
    assert out["encoder_runs"] == 0


def test_missing_embedding_blob_is_refused(vision_run, tmp_path):
    e = vision_run["engine"]
    d = copy_save(vision_run["dir"], tmp_path)
    body = json.loads((d / persist.MANIFEST).read_text())["body"]
    blob = body["embeddings"][0]["arrays"][0]["blob"]
    (d / persist.BLOBS / blob).unlink()
    before = state_of(e)
    with pytest.raises(RestoreError, match=f"blob {blob} is missing"):
        e.restore(d, SessionStore())
    assert state_of(e) == before


# -- bad saves --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=512, n_threads=2) as e:
        yield e


@pytest.fixture(scope="module")
def good_save(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("good") / "save"
    store = SessionStore()
    s = store.get("saved")
    s.system = SYSTEM
    for q in QUESTIONS[:2]:
        s.chat(q, engine=engine, max_tokens=MAX, temperature=0)
    engine.save(d, store)
    # the engine then holds another conversation: what a failed restore must leave alone
    engine.clear()
    other = SessionStore().get("other")
    for q in QUESTIONS[2:4]:
        other.chat(q, engine=engine, max_tokens=MAX, temperature=0)
    return d


def copy_save(src, tmp_path):
    d = tmp_path / "save"
    shutil.copytree(src, d)
    return d


def state_of(e):
    """Everything a failed restore must not change: slots, their KV (probe logits)."""
    e.settle()  # an idle rewrite is not a change
    slots = e.slots()
    probes = [np.array(e.probe(s.index, PROBE)).tobytes() for s in slots if s.tokens]
    return [(s.session, s.tokens, s.hashes, s.msg_ends, s.settled) for s in slots], probes


def rewrite_manifest(d, edit):
    doc = json.loads((d / persist.MANIFEST).read_text())
    edit(doc["body"])
    (d / persist.MANIFEST).write_text(blobstore.manifest_text(doc["body"]))


def biggest_blob(d):
    return max((d / persist.BLOBS).iterdir(), key=lambda f: f.stat().st_size)


def _truncate_blob(d):
    f = biggest_blob(d)
    f.write_bytes(f.read_bytes()[:1000])


def _truncate_manifest(d):
    f = d / persist.MANIFEST
    f.write_bytes(f.read_bytes()[:-200])


def _flip_blob(d):
    f = biggest_blob(d)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))


def _flip_manifest(d):
    f = d / persist.MANIFEST
    text = f.read_text()
    i = text.index('"settled": ') + len('"settled": ')
    f.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])


def _newer(d):
    rewrite_manifest(d, lambda b: b.update(version=persist.VERSION + 1))


def _traversal(d):
    (d.parent / "outside.bin").write_bytes(b"x" * 10)
    def edit(b):
        b["slots"][0]["state"] = "../../outside.bin"
        b["blobs"]["../../outside.bin"] = {"sha256": hashlib.sha256(b"x" * 10).hexdigest(),
                                           "size": 10}
    rewrite_manifest(d, edit)


def _traversal_in_session(d):
    def edit(b):
        b["sessions"][0]["messages"].append({"role": "user", "content": [
            {"type": "image", "image": {"$nbkv_image": {
                "blob": "/etc/passwd", "width": 1, "height": 1, "hash": "0"}}}]})
    rewrite_manifest(d, edit)


@pytest.mark.parametrize("damage, error", [
    (_truncate_blob, "truncated"),
    (_truncate_manifest, "unreadable"),
    (_flip_blob, "fails its checksum"),
    (_flip_manifest, "manifest .* fails its checksum"),
    (_newer, "newer than this nbkv reads"),
    (_traversal, "invalid blob '../../outside.bin'"),
    (_traversal_in_session, "invalid blob '/etc/passwd'"),
])
def test_bad_saves_are_refused_and_the_engine_is_unchanged(engine, good_save, tmp_path,
                                                           damage, error):
    d = copy_save(good_save, tmp_path)
    damage(d)
    store = SessionStore()
    before = state_of(engine)
    with pytest.raises(RestoreError, match=error):
        engine.restore(d, store)
    assert state_of(engine) == before
    assert len(store) == 0
    assert_consistent(engine)


def test_the_good_save_restores(engine, good_save, tmp_path):
    """The control for the test above: the undamaged copy restores."""
    d = copy_save(good_save, tmp_path)
    store = SessionStore()
    rep = engine.restore(d, store)
    assert [s.session for s in rep.slots] == ["saved"] and rep.dropped == ()
    assert len(store["saved"].turns) == 2
    s = next(s for s in engine.slots() if s.session == "saved")
    assert np.array_equal(np.array(engine.probe(s.index, PROBE)),
                          fresh_probe(engine.model, s.tokens, PROBE))
    r = store["saved"].chat(QUESTIONS[2], engine=engine, max_tokens=MAX, temperature=0)
    assert r.record.strategy == policy.HASH_EXTEND
    assert_consistent(engine)


def test_a_save_from_another_model_is_refused(engine, good_save, tmp_path):
    from nbkv.fixtures import make_text_model

    d = tmp_path / "other-model"
    with Engine(str(make_text_model("gemma3")), n_slots=1, n_ctx=512) as other:
        other.chat([{"role": "user", "content": "Hello there"}], max_tokens=4, temperature=0)
        other.save(d, SessionStore())
    before = state_of(engine)
    with pytest.raises(RestoreError, match="model: saved with .*gemma3.*this engine has"):
        engine.restore(d, SessionStore())
    assert state_of(engine) == before


def test_a_different_n_ctx_is_refused(model_path, good_save):
    with Engine(model_path, n_slots=2, n_ctx=768, n_threads=2) as e:
        e.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
        before = state_of(e)
        with pytest.raises(RestoreError, match=r"n_ctx\): saved with 512, this engine has 768"):
            e.restore(good_save, SessionStore())
        assert state_of(e) == before


def test_fewer_slots_keep_the_most_recently_used(model_path, tmp_path):
    store = SessionStore()
    with Engine(model_path, n_slots=2, n_ctx=512, n_threads=2) as e:
        for name in ("old", "new"):
            store.get(name).chat(QUESTIONS[0], engine=e, max_tokens=4, temperature=0)
        e.save(tmp_path / "s", store)
    with Engine(model_path, n_slots=1, n_ctx=512, n_threads=2, park_ram=0) as e:
        rep = e.restore(tmp_path / "s", SessionStore())
        assert [s.session for s in rep.slots] == ["new"] and rep.dropped == ("old",)
        assert "dropped the least recently used: old" in str(rep)
        s = e.slots()[0]  # re-addressed from 2 KV streams to 1, still exact
        assert np.array_equal(np.array(e.probe(0, PROBE)),
                              fresh_probe(e.model, s.tokens, PROBE))
        assert_consistent(e)
    with Engine(model_path, n_slots=1, n_ctx=512, n_threads=2) as e:  # parking on: parked
        rep = e.restore(tmp_path / "s", SessionStore())
        assert rep.dropped == () and rep.parked == ("old",) and "parked: old" in str(rep)
        assert [p.session for p in e.parked()] == ["old"]


def test_an_unwritable_directory_fails_the_save_and_keeps_everything(engine, good_save,
                                                                     tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    before = state_of(engine)
    with pytest.raises(SaveError, match="cannot create the save directory"):
        engine.save(blocker / "save", SessionStore())
    assert state_of(engine) == before
    if os.geteuid() != 0:  # root writes anywhere
        d = copy_save(good_save, tmp_path)
        manifest = (d / persist.MANIFEST).read_bytes()
        os.chmod(d / persist.BLOBS, 0o500)
        os.chmod(d, 0o500)
        try:
            with pytest.raises(SaveError, match="not writable"):
                engine.save(d, SessionStore())
        finally:
            os.chmod(d, 0o700)
            os.chmod(d / persist.BLOBS, 0o700)
        assert (d / persist.MANIFEST).read_bytes() == manifest


def test_remote_engines_say_plainly_it_is_not_supported():
    class RemoteEngine:
        pass

    with pytest.raises(SaveError, match="not supported for RemoteEngine"):
        persist.save(RemoteEngine(), "/nonexistent")
    with pytest.raises(RestoreError, match="not supported for RemoteEngine"):
        persist.restore(RemoteEngine(), "/nonexistent")


def test_system_prompt_cache_entries_are_restored(model_path, tmp_path):
    kw = dict(n_slots=2, n_ctx=512, n_threads=2, cache="spc")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    with Engine(model_path, **kw) as a:
        a.chat(first, max_tokens=MAX, temperature=0)
        assert a.stats()["spc_entries"] == 1
        rep = a.save(tmp_path / "s", SessionStore())
        want = a.chat(other, max_tokens=MAX, temperature=0)
    assert rep.spc_entries == 1
    with Engine(model_path, n_slots=1, n_ctx=512, n_threads=2, cache="spc") as b:
        assert b.restore(tmp_path / "s", SessionStore()).spc_entries == 1  # 2 streams -> 1
        got = b.chat(other, max_tokens=MAX, temperature=0)
        assert got.record.strategy == want.record.strategy == "spc"
        assert got.record.reused_tokens == want.record.reused_tokens > 100
        assert got.text == want.text
        assert_consistent(b)


class Deferrals(threading.Event):
    """An autosaver's stop event that counts its waits: each is a save put off for now."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.cv = threading.Condition()

    def wait(self, timeout=None):
        with self.cv:
            self.count += 1
            self.cv.notify_all()
        return super().wait(timeout)

    def reach(self, n, timeout=30.0):
        """Wait until ``n`` saves were put off in all (False if that took ``timeout``)."""
        with self.cv:
            return self.cv.wait_for(lambda: self.count >= n, timeout)


def test_autosave_is_bounded_and_gives_way_to_requests(engine, tmp_path):
    import time

    msgs = [{"role": "user", "content": QUESTIONS[4]}]
    stream = engine.chat(msgs, stream=True, max_tokens=32, temperature=0)
    next(stream)  # a request is generating: an opportunistic save must not run
    with pytest.raises(EngineBusy):
        persist.save(engine, tmp_path / "busy", SessionStore(), only_if_idle=True)
    stream.close()
    assert not (tmp_path / "busy" / persist.MANIFEST).exists()
    saver = autosave.Autosaver(engine, tmp_path / "auto", SessionStore(), interval=60, quiet=0.2)
    deferred = saver._stop = Deferrals()  # before any request: it has not waited on it yet
    try:
        engine.chat(msgs, max_tokens=4, temperature=0)
        deadline = time.monotonic() + 20
        while saver.saves == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert saver.saves == 1 and saver.last_error is None
        for q in QUESTIONS[:2]:  # within the interval: no second save
            engine.chat([{"role": "user", "content": q}], max_tokens=4, temperature=0)
        # it looked again after these requests (twice: the second look began after them)
        # and put the save off each time
        assert deferred.reach(deferred.count + 2), "no longer put off: it saved, or stopped"
        assert saver.saves == 1
    finally:
        saver.stop()
    _, body = persist.read_manifest(tmp_path / "auto")
    assert body["slots"]


# -- atomicity --------------------------------------------------------------------------------


KILLED = """
    import json, sys, time
    from nbkv import Engine
    from nbkv.store import blobstore, persist
    from nbkv.notebook.sessions import SessionStore

    model_path, save, phase = sys.argv[1:4]
    store = SessionStore()
    with Engine(model_path, n_slots=1, n_ctx=512, n_threads=2) as e:
        store.get("a").chat("What is a CPU?", engine=e, max_tokens=8, temperature=0)
        first = e.save(save, store)
        print(json.dumps({"tokens": first.slots[0].tokens}), flush=True)
        store.get("a").chat("And memory?", engine=e, max_tokens=8, temperature=0)
        real = blobstore.write_file

        def hang(target, chunks):
            if phase == "manifest" and target.name != persist.MANIFEST:
                return real(target, chunks)
            tmp = target.with_name("." + target.name + ".killed.tmp")
            data = b"".join(bytes(c) for c in chunks)
            with open(tmp, "wb") as f:  # half the file written, then the kill
                f.write(data[: len(data) // 2])
                f.flush()
            print("writing", flush=True)
            time.sleep(120)

        persist.write_file = blobstore.write_file = hang
        e.save(save, store)
"""


@pytest.mark.parametrize("phase", ["blob", "manifest"])
def test_sigkill_mid_save_leaves_the_previous_save(engine, model_path, tmp_path, phase):
    save = tmp_path / "save"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]))
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED), model_path, str(save),
                          phase], stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
    try:
        first = json.loads(p.stdout.readline())
        assert p.stdout.readline().strip() == "writing"
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert any(f.name.endswith(".tmp") for f in (save / persist.BLOBS).iterdir()) or \
        any(f.name.endswith(".tmp") for f in save.iterdir())
    store = SessionStore()
    rep = engine.restore(save, store)
    assert [s.tokens for s in rep.slots] == [first["tokens"]]
    assert len(store["a"].turns) == 1
    s = next(s for s in engine.slots() if s.session == "a")
    assert np.array_equal(np.array(engine.probe(s.index, PROBE)),
                          fresh_probe(engine.model, s.tokens, PROBE))
    assert_consistent(engine)


# -- other memory classes: checkpoints are saved too ------------------------------------------


@pytest.mark.parametrize("family", ["lfm2", "mamba2", "gemma3"])
def test_round_trip_on_other_memory_classes(family, tmp_path):
    """Hybrid (lfm2), recurrent (mamba2) and sliding-window (gemma3) memory."""
    from nbkv.fixtures import make_text_model

    path = str(make_text_model(family))
    kw = dict(n_slots=2, n_ctx=512, n_threads=2)
    store = SessionStore()
    with Engine(path, **kw) as a, Engine(path, **kw) as b:
        checkpointed = a.memory.checkpoints
        s = store.get("h")
        s.system = SYSTEM
        for q in QUESTIONS[:2]:
            s.chat(q, engine=a, max_tokens=MAX, temperature=0)
        a.settle()
        held = next(x for x in a.slots() if x.session == "h")
        assert not checkpointed or len(held.checkpoints) >= 2
        want_probe = np.array(a.probe(held.index, PROBE))
        rep = a.save(tmp_path / "s", store)
        assert rep.slots[0].nbytes > 0
        restored = SessionStore()
        b.restore(tmp_path / "s", restored)
        got = next(x for x in b.slots() if x.session == "h")
        assert got.tokens == held.tokens and got.checkpoints == held.checkpoints
        assert np.array_equal(np.array(b.probe(got.index, PROBE)), want_probe)
        # the next turn, and an edited last question (back to a restored checkpoint)
        msgs = restored["h"].messages
        for edit, m in enumerate((
                msgs + [{"role": "user", "content": QUESTIONS[2]}],
                msgs[:-2] + [{"role": "user", "content": "Tell me about disks."}])):
            ra = a.chat(m, session="h", max_tokens=MAX, temperature=0)
            rb = b.chat(m, session="h", max_tokens=MAX, temperature=0)
            assert ra.text == rb.text
            if edit and a.memory.kind == "sliding-window":
                # llama.cpp saves only the window of the SWA layers: a restored slot extends
                # exactly, but cannot go back further than the window, so it rebuilds
                assert rb.record.reused_tokens == 0 < ra.record.reused_tokens
                continue
            assert rb.record.reused_tokens == ra.record.reused_tokens > 0
            assert rb.record.checkpoint_pos == ra.record.checkpoint_pos
        if checkpointed:
            assert rb.record.checkpoint_pos is not None  # the edit went back to a checkpoint
        assert_consistent(b)
    # these states hold more than one KV stream's section: only the same slot count fits
    with Engine(path, n_slots=1, n_ctx=512, n_threads=2) as c:
        with pytest.raises(RestoreError, match="slots: saved with 2, this engine has 1"):
            c.restore(tmp_path / "s", SessionStore())
        assert c.slots()[0].empty


# -- the magics --------------------------------------------------------------------------------


def test_magics_save_restore_offer_and_autosave(tmp_path, monkeypatch):
    """%kvcache save / restore / load --restore and Nbkv.autosave, on a magics instance of
    its own (its own session store; no shared shell state)."""
    import time

    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    from nbkv.notebook.magics import Nbkv

    monkeypatch.setenv("NBKV_SAVE_DIR", str(tmp_path / "saves"))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    store = SessionStore()

    def shown(cap):
        return cap.stdout + "".join(str(o.data) for o in cap.outputs)

    m = Nbkv(shell=None, store=store, frontend="terminal", max_tokens=6)
    try:
        m.kvcache("load --slots 2 --ctx 512")
        with capture_output():
            m.chat("alice --system 'Be brief.'", "What is a CPU?")
        out = m.kvcache("save")
        assert "saved 1 slot(s)" in str(out) and "alice" in str(out)
        assert (tmp_path / "saves" / "default" / persist.MANIFEST).is_file()
        assert "last save" in str(m.kvcache("status"))
        want = store["alice"].messages
        m.kvcache("unload")  # a restart: the engine and the sessions are gone
        store.clear()
        with capture_output() as cap:  # ... and the fitting save is offered
            m.kvcache("load --slots 2 --ctx 512")
        assert "%kvcache restore" in shown(cap)
        out = m.kvcache("restore")
        assert "restored" in str(out) and store["alice"].messages == want
        status = str(m.kvcache("status"))
        assert "last restore" in status and "slot 0" in status
        with capture_output():
            m.chat("alice", "And memory?")
        assert store["alice"].records[-1].strategy == policy.HASH_EXTEND
        with pytest.raises(UsageError, match="no save at"):
            m.kvcache(f"restore {tmp_path / 'nothing'}")
        # autosave: after a request, in the background
        saved = tmp_path / "saves" / "default" / persist.MANIFEST
        before = saved.stat().st_mtime_ns
        m.autosave_interval = 1.0
        m.autosave = True
        with capture_output():
            m.chat("alice", "And a disk?")
        deadline = time.monotonic() + 30
        while saved.stat().st_mtime_ns == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert saved.stat().st_mtime_ns != before
        _, body = persist.read_manifest(saved.parent)
        assert [s["name"] for s in body["sessions"]] == ["alice"]
        assert len(body["sessions"][0]["messages"]) == 7
        m.autosave = False
        assert store.autosaver is None
        with capture_output() as cap:  # load --restore: the autosaved conversation is back
            m.kvcache("load --slots 2 --ctx 512 --restore")
        assert "restored the save" in shown(cap)
        assert store.engine.slots()[0].session == "alice" and len(store["alice"].turns) == 3
    finally:
        m.kvcache("unload")
