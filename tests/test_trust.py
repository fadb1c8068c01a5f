"""Signed saves and parked entries (issue 32, item 5): a save that this user's key did not
sign is refused, or restored with ``trust=True`` and every slot recomputed by a full prefill
before it is served. The forgery is the issue's: one conversation's KV relabelled as another's,
with the manifest's (unkeyed) checksum recomputed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
from test_parking import IDENTITY, entry

from conftest import assert_consistent
from nbkv import Engine
from nbkv.core import signing
from nbkv.core.errors import UntrustedSaveError
from nbkv.notebook.sessions import SessionStore
from nbkv.remote import persist as remote_persist
from nbkv.store import blobstore, persist
from nbkv.store.park_disk import ENTRIES, entry_file
from nbkv.store.parking import ParkingLot

MAX = 8
QUESTIONS = {"fruit": "Name a fruit.", "color": "Name a color.", "shape": "Name a shape."}
NEXT = "And another one?"


@pytest.fixture(autouse=True, scope="module")
def own_key(tmp_path_factory):
    """This module signs with a key of its own (the user's is left alone)."""
    path = tmp_path_factory.mktemp("key") / "signing_key"
    old = os.environ.get(signing.KEY_ENV)
    os.environ[signing.KEY_ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(signing.KEY_ENV, None)
    else:
        os.environ[signing.KEY_ENV] = old


def unsigned(d, edit=None):
    """Rewrite the save at ``d`` as someone without the key would: body edited, checksum
    recomputed, no signature."""
    doc = json.loads((d / persist.MANIFEST).read_text())
    if edit is not None:
        edit(doc["body"])
    body = doc["body"]
    (d / persist.MANIFEST).write_text(json.dumps({"checksum": blobstore.body_checksum(body),
                                                  "body": body}))


def relabel(body):
    """The issue's forgery: the slots keep their tokens, but their KV is swapped."""
    a, b = body["slots"][:2]
    assert a["n_tokens"] == b["n_tokens"]  # same template, same length: nothing else gives
    a["state"], b["state"] = b["state"], a["state"]


# -- the key and the signature (no model) ----------------------------------------------------


def test_the_key_is_made_once_for_the_user_alone(tmp_path, monkeypatch):
    path = tmp_path / "data" / "nbkv" / "signing_key"
    monkeypatch.setenv(signing.KEY_ENV, str(path))
    code = ("from nbkv.core import signing; "
            "print(signing.user_key().key_id, signing.user_key().temporary)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(4)]  # at once: one key wins
    ids = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    key = signing.user_key()
    assert ids == {f"{key.key_id} False"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) == 64
    assert [p.name for p in path.parent.iterdir()] == ["signing_key"]  # no temporary left


def test_a_signature_holds_only_for_its_body_and_key(tmp_path, monkeypatch):
    body = {"format": "x", "slots": [1, 2, 3]}
    doc = json.loads(blobstore.manifest_text(body))
    assert blobstore.untrusted(doc) is None
    edited = {**doc, "body": {**body, "slots": [1, 2, 4]}}
    assert "does not match its contents" in blobstore.untrusted(edited)
    assert "not signed" in blobstore.untrusted({"body": body, "checksum": doc["checksum"]})
    assert "malformed" in blobstore.untrusted({**doc, "signature": "x"})
    monkeypatch.setenv(signing.KEY_ENV, str(tmp_path / "another_key"))
    why = blobstore.untrusted(doc)
    assert "signed by another key" in why and doc["signature"]["key"] in why


def test_a_key_others_can_read_is_warned_about(tmp_path, monkeypatch, caplog):
    path = tmp_path / "k"
    path.write_text("ab" * 32)
    path.chmod(0o644)
    monkeypatch.setenv(signing.KEY_ENV, str(path))
    with caplog.at_level(logging.WARNING, logger="nbkv"):
        key = signing.user_key()
    assert not key.temporary and key.secret == b"ab" * 32
    assert "can be read by other users" in caplog.text


def test_a_key_that_cannot_be_made_gives_a_temporary_one(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(signing.KEY_ENV, str(tmp_path / "file" / "key"))
    with caplog.at_level(logging.WARNING, logger="nbkv"):
        doc = json.loads(blobstore.manifest_text({"a": 1}))  # saving still works
    assert signing.user_key().temporary and "temporary key" in caplog.text
    assert blobstore.untrusted(doc) is None


# -- parked entries on disk (no model) ---------------------------------------------------------


def test_an_unsigned_or_foreign_parked_entry_is_never_served(tmp_path, monkeypatch, caplog):
    first = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    key = first.park(entry("a")).key
    first.close()
    # the next engine takes over a closed one's entries: signed by this key, listed
    lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    assert [i.session for i in lot.entries()] == ["a"]
    # relabelled by someone without the key: the checksum is right, the signature is not
    f = lot.disk.dir / ENTRIES / entry_file(key)
    doc = json.loads(f.read_text())
    doc["body"]["entry"]["session"] = "b"
    f.write_text(json.dumps({"checksum": blobstore.body_checksum(doc["body"]),
                             "body": doc["body"]}))
    with caplog.at_level(logging.WARNING, logger="nbkv"):
        assert lot.take(key) is None
    assert "not signed by your nbkv key" in caplog.text and lot.entries() == ()
    # signed, but by another user's key: skipped when another engine takes the directory over
    lot.park(entry("c"))
    lot.close()
    monkeypatch.setenv(signing.KEY_ENV, str(tmp_path / "other_key"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbkv"):
        other = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    assert other.entries() == () and "signed by another key" in caplog.text
    other.close()


def test_a_remote_save_is_signed_and_an_unsigned_one_refused(tmp_path):
    """remote.json (a llama-server engine's table) is refused before the engine is touched."""
    d = tmp_path / "remote"
    d.mkdir()
    body = {"format": remote_persist.FORMAT, "version": 1, "server": {}, "slots": [],
            "sessions": []}
    (d / remote_persist.MANIFEST).write_text(json.dumps(body))  # an nbkv 0.1 save
    no_engine = object()  # nothing of it is used before the refusal
    with pytest.raises(UntrustedSaveError, match="not signed"):
        remote_persist.restore(no_engine, d, SessionStore())
    (d / remote_persist.MANIFEST).write_text(blobstore.manifest_text(
        {**body, "version": remote_persist.VERSION}))
    assert remote_persist._read(d)[1] is None


# -- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=512, n_threads=2) as e:
        yield e


@pytest.fixture(scope="module")
def genuine(engine, tmp_path_factory):
    """Three sessions on two slots (fruit parked), saved; and each one's genuine next reply."""
    d = tmp_path_factory.mktemp("trust") / "save"
    store = SessionStore()
    for name, q in QUESTIONS.items():
        store.get(name).chat(q, engine=engine, max_tokens=MAX, temperature=0)
    assert {i.session for i in engine.parked()} == {"fruit"}
    engine.save(d, store)
    assert persist.read_manifest(d)  # signed: trusted as it is
    want = {}
    for name in ("color", "shape"):  # served from the genuine cache (= cache off, greedy)
        msgs = [*store[name].messages, {"role": "user", "content": NEXT}]
        want[name] = engine.chat(msgs, max_tokens=MAX, temperature=0).text
    engine.clear()
    return d, want


def state_of(e):
    e.settle()
    slots = e.slots()
    probes = [np.array(e.probe(s.index, 42)).tobytes() for s in slots if s.tokens]
    return [(s.session, s.tokens, s.hashes, s.msg_ends) for s in slots], probes, e.parked()


def test_a_forged_save_is_refused_and_the_engine_is_unchanged(engine, genuine, tmp_path):
    d = tmp_path / "forged"
    shutil.copytree(genuine[0], d)
    unsigned(d, relabel)
    persist.open_manifest(d)  # its checksum holds: only the signature gives it away
    SessionStore().get("other").chat("Hello!", engine=engine, max_tokens=4, temperature=0)
    before = state_of(engine)
    store = SessionStore()
    with pytest.raises(UntrustedSaveError, match="not signed.*--trust"):
        engine.restore(d, store)
    assert state_of(engine) == before and len(store) == 0
    assert persist.offer(engine, d) is not None and "--trust" in persist.offer(engine, d)
    assert persist.compatible(engine, d) is None
    engine.clear()


def test_trusting_a_forged_save_recomputes_every_slot_before_serving(engine, genuine,
                                                                     tmp_path):
    d = tmp_path / "forged"
    shutil.copytree(genuine[0], d)
    unsigned(d, relabel)
    engine.clear(parked=True)  # clear() keeps what is parked: nothing is, before the restore
    store = SessionStore()
    rep = engine.restore(d, store, trust=True)
    assert rep.untrusted is not None and "not signed" in rep.untrusted
    assert sorted(r.session for r in rep.recomputed) == ["color", "shape"]
    assert all(r.matched is False and r.max_diff > 0 and not r.error for r in rep.recomputed)
    assert "recomputed by a full prefill" in str(rep) and "differed" in str(rep)
    assert "parked fruit" in rep.left_out and engine.parked() == ()
    assert sorted(s.name for s in store) == ["color", "fruit", "shape"]
    assert all(v.identical for v in engine.verify())  # the slots hold their own KV now
    for name in ("color", "shape"):  # served from the recomputed slot, exactly
        r = store[name].chat(NEXT, engine=engine, max_tokens=MAX, temperature=0)
        assert r.text == genuine[1][name], name
        assert r.record.strategy == "hash-extend" and r.record.reused_tokens > 30
    assert_consistent(engine)
    engine.clear()


def test_trusting_a_genuine_unsigned_save_finds_its_kv_matches(engine, genuine, tmp_path):
    d = tmp_path / "old"
    shutil.copytree(genuine[0], d)
    unsigned(d)  # what an nbkv that did not sign saves wrote: genuine KV
    rep = engine.restore(d, SessionStore(), trust=True)
    assert len(rep.recomputed) == 2 and all(r.matched for r in rep.recomputed), str(rep)
    assert "the saved KV matched it" in str(rep)
    engine.clear()


def test_a_save_signed_by_another_key_is_refused_naming_it(engine, genuine, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv(signing.KEY_ENV, str(tmp_path / "someone_else"))
    with pytest.raises(UntrustedSaveError, match="signed by another key"):
        engine.restore(genuine[0], SessionStore())


def test_magics_restore_trust_and_load_restore_trust(genuine, tmp_path, monkeypatch):
    """%kvcache restore [--trust], load --restore [--trust], and the offer after a load."""
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    from nbkv.notebook.magics import Nbkv

    monkeypatch.setenv("NBKV_SAVE_DIR", str(tmp_path / "saves"))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    d = tmp_path / "saves" / "default"
    shutil.copytree(genuine[0], d)
    unsigned(d, relabel)
    store = SessionStore()
    m = Nbkv(shell=None, store=store, frontend="terminal", max_tokens=4)

    def shown(cap):
        return cap.stdout + "".join(str(o.data) for o in cap.outputs)

    try:
        with pytest.raises(UsageError, match="--trust goes with --restore"):
            m.kvcache("load --slots 2 --ctx 512 --trust")
        assert store.engine is None
        with capture_output() as cap:
            m.kvcache("load --slots 2 --ctx 512")
        assert "not signed" in shown(cap) and "%kvcache restore --trust" in shown(cap)
        with pytest.raises(UsageError, match="not trusted"):
            m.kvcache("restore")
        assert len(store) == 0
        out = str(m.kvcache("restore --trust"))
        assert "recomputed by a full prefill" in out and "differed" in out
        assert sorted(s.name for s in store) == ["color", "fruit", "shape"]
        # the same model and settings: the engine is kept, and --restore still asks for trust
        with capture_output() as cap:
            out = str(m.kvcache("load --slots 2 --ctx 512 --restore"))
        assert "kept the loaded engine" in out
        assert "nothing restored" in shown(cap) + out and "not trusted" in shown(cap) + out
        with capture_output() as cap:  # a fresh engine (--reload), the save trusted
            out = str(m.kvcache("load --slots 2 --ctx 512 --restore --trust --reload"))
        assert "recomputed by a full prefill" in shown(cap) + out
        assert {s.session for s in store.engine.slots()} == {"color", "shape"}
    finally:
        m.kvcache("unload")
