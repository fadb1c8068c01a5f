"""The parking lot's rules, with states as plain buffers and no model (issues 36 and 32).

An entry leaves the lot only when its own session takes it back, when a budget evicts it
(announced), or when the user clears it; least recently used leaves first across restarts;
engines sharing a directory never destroy each other's entries; a deleted directory is made
again; a killed writer's temporary files are swept, a live writer's never.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time

import pytest

from nbkv.kv import policy
from nbkv.store import blobstore
from nbkv.store.park_disk import ENGINES, ENTRIES, DiskTier
from nbkv.store.parking import DISK, RAM, ParkedEntry, ParkingLot

IDENTITY = {"model": "f" * 16, "n_ctx": 512, "n_slots": 2, "memory": "plain",
            "kv": {"type_k": "f16", "type_v": "f16"}}


def buf(n, fill=1):
    return (ctypes.c_uint8 * n).from_buffer_copy(bytes([fill % 256]) * n)


def entry(session, n_bytes=1000, tokens=(1, 2, 3, 4), used_at=0.0, last_used=0, state=None,
          fill=None):
    """A parked conversation; its state's bytes differ by session (blobs are by content)."""
    if state is None:
        fill = fill if fill is not None else sum(map(ord, session or "-"))
        state = buf(n_bytes, fill)
    return ParkedEntry(session, tuple(tokens), ("h1", "h2"), (2, len(tokens)), state,
                       last_used=last_used, used_at=used_at)


def names(lot, tier=None):
    return sorted(i.session or "-" for i in lot.entries() if tier is None or i.tier == tier)


@pytest.fixture(params=["ram", "disk"])
def lot(request, tmp_path):
    """A lot whose entries stay in one tier: RAM, or disk (no RAM budget)."""
    if request.param == "ram":
        lot = ParkingLot(ram_bytes=10_000)
    else:
        lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    yield lot
    lot.close()


# ------------------------------------------------------------------ who takes an entry


def test_a_copy_for_another_session_leaves_the_entry_parked(lot):
    key = lot.park(entry("x")).key
    copy = lot.borrow(key)
    assert copy.session == "x" and bytes(copy.state) == bytes(buf(1000, ord("x")))
    assert names(lot) == ["x"] and lot.borrow(key) is not None
    assert lot.take(key).session == "x" and names(lot) == []


def test_only_its_own_session_takes_an_entry_back():
    named = ParkedEntry("x", tuple(range(10)), ("h",), (8,), b"s").info(RAM)
    prompt = tuple(range(12))
    assert policy.takes_parked(named, "x", prompt)
    assert not policy.takes_parked(named, "y", prompt)
    assert not policy.takes_parked(named, None, prompt)
    unnamed = ParkedEntry(None, tuple(range(10)), ("h",), (8,), b"s").info(RAM)
    assert policy.takes_parked(unnamed, None, prompt)  # an unnamed request carrying it on
    assert not policy.takes_parked(unnamed, None, (0, 1, 2, 9))  # ... not one leaving it
    assert not policy.takes_parked(unnamed, "y", prompt)


# ------------------------------------------------------------------ evictions are announced


def test_every_eviction_is_announced(tmp_path):
    heard = []
    lot = ParkingLot(ram_bytes=2500, disk_dir=tmp_path, disk_bytes=2500, identity=IDENTITY,
                     on_drop=heard.append)
    for i, s in enumerate("abcde"):
        lot.park(entry(s, used_at=100.0 + i))
    lot.flush()  # the spills are written by the writer thread
    # RAM holds d and e; c and b spilled; a was deleted by the disk budget
    assert names(lot, RAM) == ["d", "e"] and names(lot, DISK) == ["b", "c"]
    assert [(d.session, d.tier) for d in heard] == [("a", DISK)]
    assert "over the disk budget" in heard[0].why and heard[0].n_tokens == 4
    assert list(lot.dropped) == heard and lot.stats()["drops"] == 1
    lot.close()
    ram_only = ParkingLot(ram_bytes=1500, on_drop=heard.append)
    ram_only.park(entry("f", used_at=1.0))
    ram_only.park(entry("g", used_at=2.0))
    assert heard[-1].session == "f" and "RAM budget" in heard[-1].why
    assert ram_only.stats()["drops"] == 1


def test_clear_says_how_many_it_forgot(lot):
    for s in "ab":
        lot.park(entry(s))
    assert lot.clear() == 2 and lot.entries() == ()


# ------------------------------------------------------------------ LRU across restarts


def test_least_recently_used_leaves_first_across_a_restart(tmp_path):
    """p5 was used before the restart, q1 just after it: the budget drops p5."""
    before = ParkingLot(ram_bytes=0, disk_dir=tmp_path, disk_bytes=2500, identity=IDENTITY)
    before.park(entry("p5", used_at=time.time() - 60, last_used=50))
    before.close()
    after = ParkingLot(ram_bytes=0, disk_dir=tmp_path, disk_bytes=2500, identity=IDENTITY)
    assert names(after) == ["p5"] and after.stats()["adopted"] == 1
    after.park(entry("q1", used_at=time.time(), last_used=1))  # a new process: clock at 1
    after.park(entry("q2", used_at=time.time(), last_used=2))
    assert names(after) == ["q1", "q2"]
    assert [d.session for d in after.dropped] == ["p5"]


# ------------------------------------------------------------------ a shared directory


def test_two_engines_in_one_process_never_delete_each_others_entries(tmp_path):
    a = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    b = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity={**IDENTITY, "n_slots": 3})
    ka = [a.park(entry(f"a{i}", fill=i)).key for i in range(3)]
    kb = [b.park(entry(f"b{i}", fill=10 + i)).key for i in range(3)]
    a.take(ka[0])
    b.take(kb[0])  # each take sweeps blobs: only its own namespace's
    assert names(a) == ["a1", "a2"] and names(b) == ["b1", "b2"]
    assert a.take(ka[1]) is not None and b.take(kb[1]) is not None
    assert a.stats()["skipped_corrupt"] == b.stats()["skipped_corrupt"] == 0
    c = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)  # a and b are open
    assert c.entries() == () and names(a) == ["a2"] and names(b) == ["b2"]
    for lot in (a, b, c):
        lot.close()


def restream_state(n_streams, own, payload):
    """A plain-attention sequence state as llama.cpp writes it: a stream count, then one
    section per stream, empty (a zero cell count) but the sequence's own."""
    u32 = 4
    body = n_streams.to_bytes(u32, "little")
    for s in range(n_streams):
        body += payload if s == own else bytes(u32)
    return (ctypes.c_uint8 * len(body)).from_buffer_copy(body)


def test_entries_of_another_slot_count_are_served_readdressed(tmp_path):
    payload = (3).to_bytes(4, "little") + bytes(range(40))
    two = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    two.park(entry("a", state=restream_state(2, 1, payload)))
    two.close()
    three = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity={**IDENTITY, "n_slots": 3})
    (info,) = three.entries()
    got = three.take(info.key)
    assert bytes(got.state) == bytes(restream_state(3, 0, payload)[:4]) + payload + bytes(8)
    three.close()
    hybrid = {**IDENTITY, "memory": "hybrid"}
    h2 = ParkingLot(ram_bytes=0, disk_dir=tmp_path / "h", identity=hybrid)
    h2.park(entry("b"))
    h2.close()
    h3 = ParkingLot(ram_bytes=0, disk_dir=tmp_path / "h", identity={**hybrid, "n_slots": 3})
    assert h3.entries() == ()  # not servable: left alone, not deleted
    assert len(list((h2.disk.dir / ENTRIES).iterdir())) == 1
    h3.close()


PARK_IN_A_PROCESS = """
import ctypes, sys, time
from nbkv.store.parking import ParkedEntry, ParkingLot
root, tag = sys.argv[1], sys.argv[2]
lot = ParkingLot(ram_bytes=0, disk_dir=root, identity={"model": "m", "n_slots": 2})
for rnd in range(3):
    for i in range(6):
        s = f"{tag}{i}"
        info = lot.find(s)
        if rnd:
            assert info is not None, (s, rnd)
            got = lot.take(info.key)
            assert got is not None and bytes(got.state) == bytes([i + rnd]) * 2000, (s, rnd)
        lot.park(ParkedEntry(s, (1, 2, 3), ("h",), (3,),
                             (ctypes.c_uint8 * 2000).from_buffer_copy(bytes([i + rnd + 1]) * 2000)))
        time.sleep(0.01)
print(len(lot), lot.stats()["skipped_corrupt"], lot.stats()["drops"])
"""


def test_two_engines_in_two_processes_share_a_directory_and_lose_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", PARK_IN_A_PROCESS, str(tmp_path), tag],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for tag in "pq"]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        assert out.split() == ["6", "0", "0"]


# ------------------------------------------------------------------ a deleted directory


def test_a_deleted_directory_is_made_again_and_its_entries_reported_lost(tmp_path):
    root = tmp_path / "park"
    heard = []
    lot = ParkingLot(ram_bytes=0, disk_dir=root, identity=IDENTITY, on_drop=heard.append)
    lot.park(entry("a"))
    shutil.rmtree(root)
    assert lot.park(entry("b")).tier == DISK  # made again
    assert names(lot) == ["b"] and [d.session for d in heard] == ["a"]
    assert "deleted" in heard[0].why and lot.stats()["disk_gone"] is None
    assert lot.take(lot.find("b").key) is not None
    lot.close()


def test_a_directory_that_cannot_be_made_again_says_it_is_gone(tmp_path):
    root = tmp_path / "park"
    lot = ParkingLot(ram_bytes=0, disk_dir=root, identity=IDENTITY)
    shutil.rmtree(root)
    root.write_text("a file where the directory was")
    kept = entry("c")
    assert lot.park(kept, drop=False) is None  # handed back: the caller keeps it
    assert lot.stats()["disk_gone"] and lot.stats()["drops"] == 0
    assert lot.park(entry("d")) is None  # dropped, and announced
    assert lot.stats()["drops"] == 1 and "gone" in lot.dropped[-1].why
    lot.close()


# ------------------------------------------------------------------ temporary files


def test_a_killed_writers_temporary_files_are_swept_a_live_writers_never(tmp_path):
    live = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    dead = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity={**IDENTITY, "n_ctx": 9})
    dead.park(entry("x"))
    for ns in (live.disk.dir, dead.disk.dir):
        (ns / blobstore.BLOBS / ".partial.bin.1.2.tmp").write_bytes(b"\0" * 5000)
    dead.close()  # as if killed mid-write: its lock is released
    ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY).close()
    assert (live.disk.dir / blobstore.BLOBS / ".partial.bin.1.2.tmp").exists()
    assert not (dead.disk.dir / blobstore.BLOBS / ".partial.bin.1.2.tmp").exists()
    assert len(list((dead.disk.dir / ENTRIES).iterdir())) == 1  # its entry: left alone
    live.close()


def test_a_namespace_is_never_seen_unlocked(tmp_path):
    tier = DiskTier(tmp_path, identity=IDENTITY)
    (d,) = (tmp_path / ENGINES).iterdir()
    assert d == tier.dir and not d.name.startswith(".")
    other = DiskTier(tmp_path, identity=IDENTITY)
    assert tier.dir.is_dir()  # the second engine found it locked: left alone
    tier.close()
    other.close()


def test_entries_sharing_a_blob_are_both_taken_over(tmp_path):
    """Found by the stateful test (lfm2): two entries with the same checkpoint (a shared
    system prompt) share its blob; the first one taken over moved it, and the second was
    then deleted as corrupt ("blob missing"): lost without a word."""
    shared = ((2, buf(64, 3)),)
    first = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    for s, fill in (("a", 1), ("b", 2)):
        first.park(ParkedEntry(s, (1, 2, 3, 4), ("h1", "h2"), (2, 4), buf(100, fill), shared))
    first.close()
    again = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    assert names(again) == ["a", "b"] and again.stats()["skipped_corrupt"] == 0
    for info in again.entries():
        assert bytes(again.take(info.key).checkpoints[0][1]) == bytes(buf(64, 3))
    again.close()


def test_a_sessions_newer_conversation_is_never_replaced_by_an_older_one(lot):
    """Found by the stateful test (gemma3): an edit, then an unpark of the session's older
    parked conversation into a second slot, then park(all=True): the older one, parked
    last, replaced the newer one."""
    newer = lot.park(entry("c2", used_at=20.0, fill=1))
    kept = lot.park(entry("c2", used_at=10.0, fill=2))
    assert kept.key == newer.key and len(lot) == 1
    assert bytes(lot.borrow(newer.key).state) == bytes(buf(1000, 1))
    again = lot.park(entry("c2", used_at=30.0, fill=3))  # newer still: it replaces
    assert again.key != newer.key and len(lot) == 1
    forced = lot.import_([entry("c2", used_at=5.0, fill=4)])  # a restore asks by name
    assert forced[0].key not in (newer.key, again.key) and len(lot) == 1
