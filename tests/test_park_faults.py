"""Faults of the parking directory (issue 48), no model: each entry kept or announced, never raw.

A directory that turns read-only mid-session, one that vanishes, a full disk, a kill or a
full disk while an engine takes over a dead engine's entries, an ``engines`` entry that is
a file, a session name with a lone surrogate. Read-only is simulated by making the file
system calls under the directory raise ``EROFS`` (``chmod`` does not stop root).
"""

from __future__ import annotations

import builtins
import errno
import gc
import os
import shutil
from pathlib import Path

import pytest

from nbkv.core import api
from nbkv.core.errors import InvalidRequestError
from nbkv.store import blobstore, park_adopt, park_disk, persist
from nbkv.store.park_disk import ENGINES, DiskTier, default_disk_budget
from nbkv.store.parking import DISK, RAM, ParkingLot
from tests.test_parking import IDENTITY, buf, entry, files, sessions

MIB = 1 << 20


def read_only(monkeypatch, root: Path, err: int = errno.EROFS) -> None:
    """Every call that would change a file under ``root`` fails with ``err`` from now on."""
    root = Path(root).resolve()

    def under(p) -> bool:
        try:
            return Path(os.fspath(p)).resolve().is_relative_to(root)
        except (TypeError, ValueError):
            return False

    def refuse(p):
        raise OSError(err, os.strerror(err), os.fspath(p))

    def wrap(obj, name, paths):
        real = getattr(obj, name)

        def fake(*args, **kwargs):
            if any(under(a) for a in paths(args)):
                refuse(paths(args)[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, fake)

    for name in ("unlink", "mkdir", "rmdir", "rename", "replace", "touch"):
        wrap(Path, name, lambda a: a[:1])
    for name in ("replace", "rename", "link", "unlink", "remove", "mkdir"):
        wrap(os, name, lambda a: a[:2])
    real_open, real_os_open = builtins.open, os.open

    def fake_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and under(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)


def on_disk(tmp_path, **kw):
    """A lot whose RAM holds one 1,000-byte entry; ``a`` parked and spilled to disk."""
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY, **kw)
    a = lot.park(entry("a", last_used=1))
    lot.park(entry("b", last_used=2))
    lot.flush()
    assert sessions(lot, DISK) == {"a"}
    return lot, a


# ------------------------------------------------------------------ read-only, vanished


def test_a_read_only_directory_still_serves_its_entries_and_deletes_them_later(
        tmp_path, monkeypatch):
    lot, a = on_disk(tmp_path)
    undo = pytest.MonkeyPatch()
    read_only(undo, tmp_path)
    try:
        e = lot.take(a.key)  # was: OSError [Errno 30] from the unlink, and the entry gone
        assert e is not None and e.tier == DISK
        assert bytes(e.state) == bytes(buf(1000, ord("a")))
        assert a.key not in lot and not lot.dropped  # served, not lost
        assert len(files(lot)) == 1  # its file could not go
    finally:
        undo.undo()
    lot.park(entry("c", last_used=3))  # the next write's sweep deletes it
    lot.flush()
    lot.drop(lot.find("b").key)
    assert a.key not in {i.key for i in lot.entries()}
    assert all(n != park_disk.entry_file(a.key) for n in files(lot))
    lot.close()


def test_a_read_only_directory_admits_new_conversations_and_announces_what_it_drops(tmp_path):
    lot = ParkingLot(ram_bytes=1, disk_dir=tmp_path, identity=IDENTITY)  # park_ram=1
    mp = pytest.MonkeyPatch()
    read_only(mp, tmp_path)
    try:
        for i, s in enumerate("xyz"):  # was: OSError from the error handler's own unlink
            assert lot.park(entry(s, last_used=i)) is None
    finally:
        mp.undo()
    assert [d.session for d in lot.dropped] == ["x", "y", "z"]
    assert all("Read-only" in d.why for d in lot.dropped)
    assert files(lot) == [] and len(lot) == 0
    lot.close()


def test_an_eviction_whose_spill_fails_is_announced_and_the_park_proceeds(tmp_path):
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY)
    lot.park(entry("a", last_used=1))
    mp = pytest.MonkeyPatch()
    read_only(mp, tmp_path)
    try:
        assert lot.park(entry("b", last_used=2)).tier == RAM
        lot.flush()
    finally:
        mp.undo()
    assert sessions(lot) == {"b"} and [d.session for d in lot.dropped] == ["a"]
    lot.close()


def test_a_vanished_directory_that_cannot_be_made_again_announces_its_entries(tmp_path):
    lot, a = on_disk(tmp_path / "park")
    shutil.rmtree(tmp_path / "park")
    mp = pytest.MonkeyPatch()
    read_only(mp, tmp_path)
    try:
        assert lot.take(a.key) is None
        assert [d.session for d in lot.dropped] == ["a"]
        assert "cannot be written" in lot.stats()["disk_gone"]
        assert lot.park(entry("c", n_bytes=2000, last_used=3)) is None  # announced, no raise
    finally:
        mp.undo()
    assert [d.session for d in lot.dropped] == ["a", "c"]
    lot.close()


def test_an_engines_entry_that_is_a_file_is_a_named_error(tmp_path):
    (tmp_path / ENGINES).write_text("not a directory")
    with pytest.raises(InvalidRequestError, match="'engines' entry is a file"):
        ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)  # was: FileExistsError


def test_a_park_dir_that_cannot_be_written_at_open_is_a_named_error(tmp_path, monkeypatch):
    read_only(monkeypatch, tmp_path)
    with pytest.raises(InvalidRequestError, match="cannot be used"):
        DiskTier(tmp_path, identity=IDENTITY)


# ------------------------------------------------------------------ session names


def test_a_session_name_with_a_lone_surrogate_is_refused_at_the_door():
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        api.session_name("bad\udcff")
    assert api.session_name("caf\u00e9 \u2603") == "caf\u00e9 \u2603"


def test_one_bad_entry_never_keeps_the_others_from_disk(tmp_path, monkeypatch):
    lot = ParkingLot(ram_bytes=1 << 20, disk_dir=tmp_path, identity=IDENTITY)
    names = ["s0", "s1", "bad\udcff", "s3", "boom", "s5"]  # 6 conversations, 2 bad ones
    for i, s in enumerate(names):
        lot.park(entry(s, last_used=i))
    real = park_disk.DiskTier.prepare

    def prepare(self, e):
        if e.session == "boom":
            raise RuntimeError("a write that fails unlike any other")
        return real(self, e)

    monkeypatch.setattr(park_disk.DiskTier, "prepare", prepare)
    assert lot.spill_all() == 5  # was: UnicodeEncodeError at the bad name, the rest in RAM
    assert sessions(lot, DISK) == set(names) - {"boom"}
    assert [(d.session, "RuntimeError" in d.why) for d in lot.dropped] == [("boom", True)]
    e = lot.take(lot.find("bad\udcff").key)  # a name that is not UTF-8 still reads back
    assert e.session == "bad\udcff" and bytes(e.state) == bytes(buf(1000, ord("b")))
    lot.close()


# ------------------------------------------------------------------ a full disk


def full_after(monkeypatch, n_entries):
    """The disk holds ``n_entries`` entries' blobs: a write past them fails with ENOSPC."""
    real = park_disk.write_blobs

    def write_blobs(directory, blobs, *a, **kw):
        if len(list((directory / "blobs").glob("*.bin"))) >= n_entries:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(directory, blobs, *a, **kw)

    monkeypatch.setattr(park_disk, "write_blobs", write_blobs)


def test_a_full_disk_deletes_the_oldest_entries_before_the_newest_spill(tmp_path, monkeypatch):
    full_after(monkeypatch, 2)
    lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    for i, s in enumerate("abcd"):
        assert lot.park(entry(s, last_used=i)).tier == DISK  # was: c and d dropped
    assert sessions(lot, DISK) == {"c", "d"}
    assert [(d.session, "disk is full" in d.why) for d in lot.dropped] == [
        ("a", True), ("b", True)]
    lot.close()


def test_a_full_disk_on_the_writer_thread_deletes_the_oldest_too(tmp_path, monkeypatch):
    full_after(monkeypatch, 1)
    lot = ParkingLot(ram_bytes=1500, disk_dir=tmp_path, identity=IDENTITY)
    for i, s in enumerate("abc"):
        lot.park(entry(s, last_used=i))
    lot.flush()
    assert sessions(lot, DISK) == {"b"} and sessions(lot, RAM) == {"c"}
    assert [d.session for d in lot.dropped] == ["a"]
    lot.close()


def test_the_default_disk_budget_holds_an_entry_on_a_small_disk(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: usage._replace(free=600 * MIB))
    assert default_disk_budget(tmp_path) == 300 * MIB  # a quarter would be 150 MiB
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=100 << 30))
    assert default_disk_budget(tmp_path) == 16 << 30


# ------------------------------------------------------------------ taking over a dead engine


class Killed(BaseException):
    """A kill -9 at this point: nothing after it runs."""


def parked_by_a_dead_engine(root):
    """Three entries (two sharing a checkpoint blob) left by an engine that is gone."""
    tier = DiskTier(root, identity=IDENTITY)
    shared = (2, b"checkpoint" * 10)
    for i, s in enumerate("abc"):
        e = entry(s, last_used=i, cps=(shared,) if s != "c" else ())
        e.key = f"{s}#{i + 1}"
        assert tier.put(e).written
    tier.close()


def steps(monkeypatch, at, fault):
    """Count the adoption's steps; the ``at``-th raises ``fault`` (none: count only)."""
    seen = [0]

    def counted(obj, name):
        real = getattr(obj, name, None)
        if real is None:
            return

        def step(*args, **kwargs):
            seen[0] += 1
            if seen[0] == at:
                raise fault
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, step)

    for name in ("copy_blob", "write_file", "unlink", "fsync_dir"):
        counted(park_adopt, name)
    for name in ("replace", "link"):  # the renames inside copy_blob and write_file
        counted(os, name)
    return seen


def adopted(root):
    """What a healthy engine opening ``root`` serves: session -> state bytes."""
    tier = DiskTier(root, identity=IDENTITY)
    try:
        out = {}
        for key in [i.key for i in tier.infos()]:
            e = tier.read(key)
            assert e is not None, key
            assert e.session not in out or bytes(e.state) == out[e.session]  # a copy, at most
            out[e.session] = bytes(e.state)
        return out
    finally:
        tier.close()


def test_a_kill_at_any_step_of_a_take_over_loses_no_entry(tmp_path):
    parked_by_a_dead_engine(tmp_path / "src")
    with pytest.MonkeyPatch.context() as mp:
        n = steps(mp, 0, Killed())
        shutil.copytree(tmp_path / "src", tmp_path / "count")
        DiskTier(tmp_path / "count", identity=IDENTITY).close()
    total = n[0]
    assert total >= 8
    want = {s: bytes(buf(1000, ord(s))) for s in "abc"}
    for at in range(1, total + 1):
        root = tmp_path / f"kill{at}"
        shutil.copytree(tmp_path / "src", root)
        try:
            with pytest.MonkeyPatch.context() as mp:
                steps(mp, at, Killed())
                DiskTier(root, identity=IDENTITY)
        except Killed:
            pass
        gc.collect()  # the killed engine's lock goes with it
        assert adopted(root) == want, f"killed at step {at} of {total}"


@pytest.mark.parametrize("link", [True, False], ids=["linked", "copied"])
def test_a_full_disk_during_a_take_over_loses_no_entry(tmp_path, link):
    parked_by_a_dead_engine(tmp_path / "src")
    want = {s: bytes(buf(1000, ord(s))) for s in "abc"}
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for at in range(1, 12):
        root = tmp_path / f"full{at}"
        shutil.copytree(tmp_path / "src", root)
        with pytest.MonkeyPatch.context() as mp:
            if not link:
                mp.setattr(os, "link", lambda *a: (_ for _ in ()).throw(
                    OSError(errno.EXDEV, "cross-device link")))
            seen = [0]
            real_copy, real_write = shutil.copyfile, park_adopt.write_file

            def fail(real, seen=seen, at=at):
                def call(*a, **kw):
                    seen[0] += 1
                    if seen[0] == at:
                        raise enospc
                    return real(*a, **kw)
                return call

            mp.setattr(shutil, "copyfile", fail(real_copy))
            mp.setattr(park_adopt, "write_file", fail(real_write))
            tier = DiskTier(root, identity=IDENTITY)  # the disk fills up while it takes over
            here = {i.key: bytes(tier.read(i.key).state) for i in tier.infos()}
            named = {n for i in tier.infos() for n in tier._index[i.key].blobs}
            assert {p.name for p in (tier.dir / "blobs").iterdir()} == named  # no copy left over
            tier.close()
        assert len(here) <= 3
        assert adopted(root) == want, f"disk full at write {at}"


def test_a_disk_filled_by_someone_else_loses_no_more_than_the_entry_needs(tmp_path, monkeypatch):
    lot = ParkingLot(ram_bytes=0, disk_dir=tmp_path, identity=IDENTITY)
    for i, s in enumerate("abcde"):
        lot.park(entry(s, last_used=i))
    full_after(monkeypatch, 0)  # deleting entries frees nothing that helps
    assert lot.park(entry("f", last_used=9)) is None
    gone = [d.session for d in lot.dropped]
    assert gone == ["a", "b", "f"]  # two freed more than f needs: then f is dropped
    assert sessions(lot, DISK) == {"c", "d", "e"}
    lot.close()


# ------------------------------------------------------------------ two writers of one save


def test_a_save_over_one_another_process_wrote_since_is_warned(tmp_path, recwarn):
    from nbkv.core.errors import SaveOverwrittenWarning
    from nbkv.store import save_checks as persist
    from nbkv.store.blobstore import write_file
    from nbkv.store.save_checks import MANIFEST

    write_file(tmp_path / MANIFEST, [b'{"mine": 1}'])
    persist.warn_if_overwritten(tmp_path)  # never seen here: an old save, replaced quietly
    persist.seen(tmp_path)  # ... this process wrote (or restored) it
    persist.warn_if_overwritten(tmp_path)
    assert not recwarn.list
    write_file(tmp_path / MANIFEST, [b'{"theirs": 2}'])  # another process's save, renamed in
    with pytest.warns(SaveOverwrittenWarning, match="another process"):
        persist.warn_if_overwritten(tmp_path)
    persist.seen(tmp_path)
    persist.warn_if_overwritten(tmp_path)
    assert not [w for w in recwarn.list if w.category is SaveOverwrittenWarning]


# ------------------------------------------------------------------ a save's unnamed entries


def test_a_restore_does_not_park_an_unnamed_entry_beside_an_identical_one(tmp_path):
    from dataclasses import replace

    from nbkv.store import blobstore

    lot = ParkingLot(ram_bytes=1 << 20)
    for tokens, last_used in (((1, 2, 3, 4), 1), ((1, 2, 3, 5), 2)):
        e = entry("x", tokens=tokens, last_used=last_used)
        e.conversation = replace(e.conversation, session=None)
        lot.park(e)
    lot.park(entry("named", last_used=3))
    saved = blobstore.Blobs()
    items = lot.export(saved)
    blobstore.write_blobs(tmp_path, saved)
    again = lot.decode(items, blobstore.Reader(tmp_path, saved.table()))
    placed = lot.import_(again)  # the same save restored into the lot it came from
    assert len(lot) == 3  # was: 5, the two unnamed ones twice
    assert sorted(p.session or "-" for p in placed) == ["-", "-", "named"]
    assert all(e.key in lot for e in again)


def test_an_engines_entry_made_a_file_mid_session_is_announced_not_raised(tmp_path):
    lot, a = on_disk(tmp_path)
    shutil.rmtree(tmp_path / ENGINES)
    (tmp_path / ENGINES).write_text("not a directory")
    assert lot.take(a.key) is None  # was: InvalidRequestError out of a request
    assert [d.session for d in lot.dropped] == ["a"]
    assert "is a file" in lot.stats()["disk_gone"]
    lot.close()


def test_a_temporary_file_gone_while_a_save_cleans_up_is_not_stale(tmp_path):
    """Another writer renamed its temporary file away between the listing and the check."""
    gone = tmp_path / ".manifest.json.1.2.tmp"  # a writer that is not a live process here
    assert blobstore.stale_by_age(gone) is False  # was: FileNotFoundError out of the save
    assert persist._dead_writer(gone) is False
