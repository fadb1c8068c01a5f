"""Spills to disk written off the parking thread: the park does not wait, nothing is lost.

No model: states are plain buffers, and a write is held on an Event where the test needs it
in flight (never a sleep). Each test first checks that ``park()`` returns while the disk
write of the entry it pushes out of RAM is blocked.
"""

from __future__ import annotations

import errno
import threading

import pytest

from nbkv.store import park_disk, parking
from nbkv.store.parking import DISK, RAM, ParkingLot
from tests.test_parking import IDENTITY, blobs, buf, entry, files, sessions

WAIT = 30.0  # seconds: only ever reached when something is broken


class Gate:
    """Holds the disk tier's writes of blobs (or manifests) until :meth:`open`."""

    def __init__(self, monkeypatch, name="write_blobs", fail=None):
        self.entered = threading.Event()
        self.opened = threading.Event()
        real = getattr(park_disk, name)

        def held(*args, **kwargs):
            self.entered.set()
            assert self.opened.wait(WAIT), "the gate was never opened"
            if fail is not None:
                raise fail
            return real(*args, **kwargs)

        monkeypatch.setattr(park_disk, name, held)

    def open(self):
        self.opened.set()


def park_returns(lot, e, gate):
    """Park ``e`` on another thread; assert the park returns although the write is held."""
    out = []
    t = threading.Thread(target=lambda: out.append(lot.park(e)), daemon=True)
    t.start()
    t.join(WAIT / 3)
    if t.is_alive():  # the park writes itself: let it finish, then fail
        gate.open()
        t.join(WAIT)
        pytest.fail("park() waited for the disk write")
    assert gate.entered.wait(WAIT)  # ... and the writer thread holds the write it handed off
    return out[0]


def spilling_lot(tmp_path, **kw):
    """A lot whose RAM holds one 1,000-byte entry: the second park spills the first."""
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY, **kw)
    a = lot.park(entry("a", last_used=1))
    return lot, a


def test_the_park_returns_while_its_spill_is_written(tmp_path, monkeypatch):
    lot, a = spilling_lot(tmp_path)
    gate = Gate(monkeypatch)
    assert park_returns(lot, entry("b", last_used=2), gate).tier == RAM
    # in flight: still in RAM, served from there, counted there
    assert {(i.session, i.tier) for i in lot.entries()} == {("a", RAM), ("b", RAM)}
    st = lot.stats()
    assert st["writing"] == 1 and st["entries"] == {RAM: 2, DISK: 0} and st["spills"] == 0
    assert bytes(lot.borrow(a.key).state) == bytes(buf(1000, ord("a")))
    assert files(lot) == []  # no manifest yet: a crash now leaves no entry
    gate.open()
    lot.flush()
    assert sessions(lot, DISK) == {"a"} and sessions(lot, RAM) == {"b"}
    assert lot.stats()["spills"] == 1 and lot.stats()["writing"] == 0
    assert len(files(lot)) == 1 and len(blobs(lot)) == 1
    e = lot.take(a.key)
    assert e.tier == DISK and bytes(e.state) == bytes(buf(1000, ord("a")))
    lot.close()


def test_an_entry_taken_back_mid_write_leaves_nothing_on_disk(tmp_path, monkeypatch):
    shared = ((2, buf(64, 3)),)  # a checkpoint an entry already on disk names too
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY)
    old = lot.park(entry("old", n_bytes=2000, cps=shared, last_used=0))  # straight to disk
    assert old.tier == DISK and len(blobs(lot)) == 2
    a = lot.park(entry("a", cps=shared, last_used=1))
    gate = Gate(monkeypatch)
    park_returns(lot, entry("b", last_used=2), gate)
    e = lot.take(a.key)  # its session comes back while its spill is written
    assert e.tier == RAM and bytes(e.state) == bytes(buf(1000, ord("a")))
    assert a.key not in lot
    gate.open()
    lot.flush()
    assert sessions(lot) == {"old", "b"} and lot.stats()["spills"] == 1  # old's only
    assert len(files(lot)) == 1 and len(blobs(lot)) == 2  # a's state deleted, shared kept
    back = lot.take(old.key)
    assert back.tier == DISK and bytes(back.checkpoints[0][1]) == bytes(buf(64, 3))
    assert lot.stats()["drops"] == 0 and not list(lot.dropped)
    lot.close()


def test_a_sweep_during_the_write_keeps_its_files(tmp_path, monkeypatch):
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY)
    other = lot.park(entry("other", n_bytes=2000))  # on disk: dropping it sweeps the blobs
    a = lot.park(entry("a", last_used=1))
    gate = Gate(monkeypatch, "write_file")  # blobs written, the manifest held
    park_returns(lot, entry("b", last_used=2), gate)
    assert lot.drop(other.key)  # sweeps while a's blob is written and not yet named
    gate.open()
    lot.flush()
    e = lot.take(a.key)
    assert e is not None and e.tier == DISK and bytes(e.state) == bytes(buf(1000, ord("a")))
    assert lot.disk.skipped == 0 and files(lot) == []
    lot.close()


def test_close_waits_for_the_writer(tmp_path, monkeypatch):
    lot, a = spilling_lot(tmp_path)
    gate = Gate(monkeypatch)
    park_returns(lot, entry("b", last_used=2), gate)
    with pytest.raises(TimeoutError, match="still being written"):
        lot.flush(timeout=0.05)  # bounded, with a clear error
    closing = threading.Thread(target=lot.close, daemon=True)
    closing.start()
    gate.open()
    closing.join(WAIT)
    assert not closing.is_alive()
    assert lot._writer is None or not lot._writer.is_alive()  # stopped
    again = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY)
    assert sessions(again, DISK) == {"a"}  # a was on disk before the close returned
    assert bytes(again.take(again.find("a").key).state) == bytes(buf(1000, ord("a")))
    again.close()


def test_spill_all_waits_for_the_writer(tmp_path, monkeypatch):
    lot, a = spilling_lot(tmp_path)
    gate = Gate(monkeypatch)
    park_returns(lot, entry("b", last_used=2), gate)
    threading.Timer(0.05, gate.open).start()  # spill_all writes b itself: the gate must open
    assert lot.spill_all() == 1
    assert sessions(lot, DISK) == {"a", "b"} and lot.stats()["writing"] == 0
    lot.close()


def test_a_write_error_is_reported_as_the_synchronous_path_does(tmp_path, monkeypatch):
    heard = []
    lot, a = spilling_lot(tmp_path, on_drop=heard.append)
    gate = Gate(monkeypatch, fail=OSError(errno.ENOSPC, "No space left on device"))
    park_returns(lot, entry("b", last_used=2), gate)
    gate.open()
    lot.flush()
    assert [(d.session, d.tier) for d in heard] == [("a", RAM)]
    assert "could not write it" in heard[0].why and "No space left" in heard[0].why
    assert sessions(lot) == {"b"} and a.key not in lot
    st = lot.stats()
    assert st["drops"] == 1 and st["spills"] == 0 and st["writing"] == 0
    assert files(lot) == [] and blobs(lot) == []  # nothing half written is left
    lot.close()


def test_the_writer_ends_when_idle_and_the_next_spill_starts_another(tmp_path, monkeypatch):
    monkeypatch.setattr(parking, "WRITER_IDLE", 0.01)
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY)
    for i, s in enumerate("abc"):
        lot.park(entry(s, last_used=i))
        lot.flush()
        writer = lot._writer
        if writer is not None:
            writer.join(WAIT)  # idle: it ends, and a lot nobody closes can be collected
        assert lot._writer is None or not lot._writer.is_alive()
    assert sessions(lot, DISK) == {"a", "b"} and sessions(lot, RAM) == {"c"}
    lot.close()


def test_a_restore_mid_write_neither_breaks_the_write_nor_recycles_its_buffer(
        tmp_path, monkeypatch):
    from nbkv.llama.state_buffers import StateBuffers
    pool = StateBuffers()
    lot, a = spilling_lot(tmp_path)
    gate = Gate(monkeypatch)
    park_returns(lot, entry("b", last_used=2), gate)
    e = lot.take(a.key)
    state, e.state = e.state, None  # as the engine does after a restore (placement.start)
    assert not pool.give(state, 1)  # the writer still reads it: not reused by the next park
    gate.open()
    lot.flush()
    assert lot.stats()["writing"] == 0 and files(lot) == [] and not list(lot.dropped)
    lot.close()
