"""The parking lot, with states as plain buffers and no model: tiers, budgets, disk checks."""

from __future__ import annotations

import ctypes
import json
import logging

import pytest

from nbkv.core.errors import InvalidRequestError, RestoreError
from nbkv.core.events import Segment
from nbkv.kv.slot_kv import CheckpointSet, KVSnapshot
from nbkv.media.units import MediaKey, MediaUnit
from nbkv.store import blobstore
from nbkv.store.park_disk import ENTRIES, entry_file
from nbkv.store.parking import DISK, RAM, ParkedEntry, ParkingLot, default_ram_budget, parking_stats

IDENTITY = {"model": "f" * 16, "n_ctx": 512, "n_slots": 2, "memory": "plain",
            "kv": {"type_k": "f16", "type_v": "f16"}}


def buf(n, fill=1):
    """A state as llama.cpp hands it out: a ctypes byte array."""
    return (ctypes.c_uint8 * n).from_buffer_copy(bytes([fill % 256]) * n)


def entry(session, n_bytes=1000, tokens=(1, 2, 3, 4), last_used=0, fill=None, cps=()):
    tokens = tuple(tokens)
    return ParkedEntry(session, tokens, ("h1", "h2"), (2, len(tokens)),
                       buf(n_bytes, fill if fill is not None else ord(session[0])), cps,
                       (Segment(0, 2, 0, "system", "reused", "sys"),),
                       last_request=7, last_used=last_used)


def sessions(lot, tier=None):
    return {i.session for i in lot.entries() if tier is None or i.tier == tier}


def files(lot):
    return sorted(p.name for p in (lot.disk.dir / ENTRIES).iterdir())


def blobs(lot):
    return sorted(p.name for p in (lot.disk.dir / blobstore.BLOBS).iterdir())


# ------------------------------------------------------------------ entries


def test_an_entry_counts_the_real_bytes_of_its_buffers():
    e = ParkedEntry("a", (1, 2, 3), (), (), buf(300), ((1, b"x" * 20), (3, bytearray(30))))
    assert e.nbytes == 350
    assert e.settled == e.exact_len == 3  # only proven KV is parked
    cs = CheckpointSet()
    cs.add(2, buf(40), 40)
    snap = KVSnapshot(buf(100), (5, 6, 7), 2, 3, cs)
    e = ParkedEntry.from_snapshot(snap, session="b", hashes=("h",), msg_ends=(2,),
                                  last_used=4)
    assert e.nbytes == 140 and e.checkpoints[0][0] == 2 and (e.settled, e.exact_len) == (2, 3)
    info = e.info(RAM)
    assert (info.session, info.n_tokens, info.nbytes, info.tier) == ("b", 3, 140, RAM)
    with pytest.raises(ValueError):
        ParkedEntry("c", (1, 2), ("h",), (5,), b"")  # a boundary past its tokens


def test_default_ram_budget_is_a_quarter_of_free_ram_at_most_4_gib():
    b = default_ram_budget()
    assert 0 < b <= 4 << 30
    assert ParkingLot().ram_bytes == b
    with pytest.raises(InvalidRequestError):
        ParkingLot(ram_bytes=-1)


# ------------------------------------------------------------------ RAM


def test_ram_keeps_the_most_recent_within_its_bytes_and_drops_the_rest_without_a_disk():
    lot = ParkingLot(ram_bytes=2500)
    for i, s in enumerate("abc"):
        lot.park(entry(s, last_used=i))
    assert sessions(lot) == {"b", "c"}  # a, least recently used, left to make room
    st = lot.stats()
    assert (st["parks"], st["drops"], st["spills"], st["ram_bytes"]) == (3, 1, 0, 2000)
    assert st["entries"] == {RAM: 2, DISK: 0}
    assert [i.session for i in lot.entries()] == ["c", "b"]  # most recent first


def test_lru_is_by_use_not_by_parking_order():
    lot = ParkingLot(ram_bytes=2500)
    lot.park(entry("a", last_used=9))
    lot.park(entry("b", last_used=1))
    lot.park(entry("c", last_used=5))
    assert sessions(lot) == {"a", "c"}


def test_an_entry_larger_than_ram_is_dropped_and_evicts_nothing():
    lot = ParkingLot(ram_bytes=1500)
    lot.park(entry("a"))
    assert lot.park(entry("big", n_bytes=2000)) is None
    assert sessions(lot) == {"a"} and lot.stats()["drops"] == 1


def test_one_entry_per_session():
    lot = ParkingLot(ram_bytes=10_000)
    first = lot.park(entry("a", tokens=(1, 2, 3)))
    second = lot.park(entry("a", tokens=(1, 2, 3, 4, 5)))
    assert first.key != second.key and len(lot) == 1
    assert lot.take(first.key) is None
    got = lot.take(second.key)
    assert got.tokens == (1, 2, 3, 4, 5) and got.tier == RAM and len(lot) == 0
    assert lot.stats()["restores"] == 1


def test_take_drop_and_clear():
    lot = ParkingLot(ram_bytes=10_000)
    keys = [lot.park(entry(s)).key for s in "abc"]
    e = lot.take(keys[0])
    assert e.session == "a" and bytes(e.state) == bytes(buf(1000, ord("a"))) and e.last_request == 7
    assert lot.take(keys[0]) is None
    assert lot.drop(keys[1]) and not lot.drop(keys[1])
    assert lot.drop_session("c") == 1 and len(lot) == 0
    lot.park(entry("d"))
    lot.clear()
    assert lot.entries() == () and lot.find("d") is None


# ------------------------------------------------------------------ disk


def test_entries_leaving_ram_spill_to_disk_and_come_back_exact(tmp_path):
    lot = ParkingLot(ram_bytes=2500, disk_dir=tmp_path, identity=IDENTITY)
    image = MediaKey("ab" * 32, 0, 4, 2)
    tokens = (1, 2, MediaUnit(image, 0), MediaUnit(image, 1), 9)
    cps = ((2, buf(50, 7)), (5, buf(60, 8)))
    infos = [lot.park(entry("a", tokens=tokens, cps=cps, last_used=1)),
             lot.park(entry("b", last_used=2)), lot.park(entry("c", last_used=3))]
    assert infos[0].tier == RAM
    lot.flush()  # a's spill is written by the writer thread
    assert sessions(lot, RAM) == {"b", "c"} and sessions(lot, DISK) == {"a"}
    st = lot.stats()
    assert st["spills"] == 1 and st["drops"] == 0
    assert st["disk_bytes"] == 1000 + 50 + 60  # the blobs' real sizes
    assert len(files(lot)) == 1 and len(blobs(lot)) == 3
    e = lot.take(infos[0].key)
    assert e.tier == DISK and e.tokens == tokens and e.checkpoints[1][0] == 5
    assert bytes(e.checkpoints[1][1]) == bytes(buf(60, 8))
    assert isinstance(e.state, ctypes.Array) and bytes(e.state) == bytes(buf(1000, ord("a")))
    assert e.segments[0].preview == "sys" and e.hashes == ("h1", "h2")
    assert files(lot) == [] and blobs(lot) == []  # taken: deleted from disk


def test_an_entry_larger_than_ram_goes_straight_to_disk(tmp_path):
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY)
    lot.park(entry("a"))
    assert lot.park(entry("big", n_bytes=2000)).tier == DISK
    assert sessions(lot, RAM) == {"a"}


def test_the_disk_budget_deletes_the_oldest_first(tmp_path):
    lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, disk_bytes=2500, identity=IDENTITY)
    for i, s in enumerate("abc"):
        lot.park(entry(s, last_used=i))
    assert sessions(lot, DISK) == {"b", "c"} and len(files(lot)) == 2
    assert lot.park(entry("huge", n_bytes=3000)) is None  # larger than the whole budget
    assert sessions(lot) == {"b", "c"} and lot.stats()["disk_bytes"] == 2000


def test_a_blob_two_entries_share_stays_until_neither_names_it(tmp_path):
    lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    shared = ((2, buf(64, 3)),)  # the same checkpoint (a shared system prompt)
    a = lot.park(entry("a", n_bytes=100, fill=1, cps=shared))
    b = lot.park(entry("b", n_bytes=100, fill=2, cps=shared))
    assert len(blobs(lot)) == 3 and lot.stats()["disk_bytes"] == 264
    assert lot.drop(a.key)
    assert len(blobs(lot)) == 2
    assert bytes(lot.take(b.key).checkpoints[0][1]) == bytes(buf(64, 3))


def test_a_new_process_finds_what_was_parked(tmp_path):
    lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    key = lot.park(entry("a", last_used=3)).key
    lot.close()  # its engine closed (or its process ended): the entries are taken over
    again = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=dict(IDENTITY))
    (info,) = again.entries()
    assert (info.key, info.session, info.tier, info.nbytes) == (key, "a", DISK, 1000)
    assert info.tokens == (1, 2, 3, 4) and info.msg_ends == (2, 4)
    assert again.park(entry("b")).key != key  # keys stay unique
    assert again.take(key).session == "a"


def corrupt_blob(d, how):
    f = max((d / blobstore.BLOBS).iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x10
    f.write_bytes(bytes(data))


def corrupt_manifest(d, how):
    (f,) = (d / ENTRIES).iterdir()
    if how == "manifest":
        f.write_text(f.read_text().replace('"last_used": 0', '"last_used": 1'))
    else:  # valid, checksummed, but parked by another engine
        doc = json.loads(f.read_text())
        doc["body"]["identity"].update(how)
        f.write_text(blobstore.manifest_text(doc["body"]))


@pytest.mark.parametrize("how", ["truncated", "flipped", "manifest", {"n_ctx": 1024},
                                 {"model": "0" * 16}])
def test_a_damaged_or_foreign_disk_entry_is_skipped_named_and_deleted(tmp_path, caplog, how):
    lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    key = lot.park(entry("a")).key
    path = lot.disk.dir / ENTRIES / entry_file(key)
    (corrupt_blob if how in ("truncated", "flipped") else corrupt_manifest)(lot.disk.dir, how)
    with caplog.at_level(logging.WARNING, logger="nbkv"):
        assert lot.take(key) is None
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in msg
    why = {"truncated": "truncated", "flipped": "checksum", "manifest": "checksum"}
    assert why.get(str(how), "parked by another engine") in msg
    if isinstance(how, dict):
        assert next(iter(how)) in msg  # names what differs
    assert lot.stats()["skipped_corrupt"] == 1 and lot.entries() == ()
    assert files(lot) == [] and blobs(lot) == []


def test_another_engines_entries_are_left_alone_and_junk_of_a_closed_one_is_swept(tmp_path,
                                                                                 caplog):
    first = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    first.park(entry("a"))
    kept = files(first)
    first.close()
    (first.disk.dir / ENTRIES / ("0" * 32 + ".json")).write_text("{not json")
    with caplog.at_level(logging.INFO, logger="nbkv"):
        other = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity={**IDENTITY, "n_ctx": 9})
    # another context size: not served, and not deleted either; the junk file is
    assert other.entries() == () and other.stats()["skipped_corrupt"] == 1
    assert "n_ctx: parked with 512, this engine has 9" in caplog.text
    assert files(first) == kept and len(blobs(first)) == 1
    other.close()
    back = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)  # served again
    assert [i.session for i in back.entries()] == ["a"]


# ------------------------------------------------------------------ saves


def test_export_and_import_round_trip_through_the_save_format(tmp_path):
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path / "park", identity=IDENTITY)
    lot.park(entry("a", cps=((3, buf(10, 4)),), last_used=1))
    lot.park(entry("b", last_used=2))  # a spills to disk: both tiers are exported
    saved = blobstore.Blobs()
    items = lot.export(saved)
    assert [d["session"] for d in items] == ["a", "b"]
    save = tmp_path / "save"
    blobstore.write_blobs(save, saved)
    doc = json.loads(json.dumps({"parked": items, "blobs": saved.table()}))  # JSON-able

    fresh = ParkingLot(ram_bytes=10_000)
    fresh.park(entry("old"))
    decoded = fresh.decode(doc["parked"], blobstore.Reader(save, doc["blobs"]))
    placed = fresh.import_(decoded)  # beside what was parked: nothing is lost to a restore
    assert [p.session for p in placed] == ["a", "b"] and sessions(fresh) == {"a", "b", "old"}
    a = fresh.take(fresh.find("a").key)
    assert bytes(a.state) == bytes(buf(1000, ord("a"))) and bytes(a.checkpoints[0][1]) == bytes(
        buf(10, 4))
    assert a.tokens == (1, 2, 3, 4) and a.last_request == 7

    doc["parked"][0]["n_tokens"] = 99
    with pytest.raises(RestoreError):
        fresh.decode(doc["parked"], blobstore.Reader(save, doc["blobs"]))
    with pytest.raises(RestoreError):
        fresh.decode({"not": "a list"}, blobstore.Reader(save, doc["blobs"]))


def test_parking_stats_for_the_stats_table():
    assert parking_stats(None) == {}
    lot = ParkingLot(ram_bytes=1500)
    lot.park(entry("a"))
    lot.park(entry("b"))
    s = parking_stats(lot)
    assert (s["parks"], s["parking_drops"], s["parked_ram_entries"],
            s["parked_ram_bytes"]) == (2, 1, 1, 1000)


def test_the_policy_reads_the_lots_entries():
    from nbkv.kv import policy

    lot = ParkingLot(ram_bytes=10_000)
    key = lot.park(ParkedEntry("alice", tuple(range(300)), ("h1", "h2"), (150, 300),
                               buf(100), last_used=1)).key
    busy = [type("S", (), dict(index=0, tokens=[9] * 10, hashes=["x"], msg_ends=[10],
                                session="bob", last_used=2, pending=False))()]
    plan = policy.select(busy, tuple(range(300)) + (7,), ["h1", "h2", "h3"], "alice",
                         parked=lot.entries())
    assert plan.parked == key and plan.reuse == 300 and plan.evicted == "bob"
