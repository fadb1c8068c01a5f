"""The disk tier of the parking lot: parked conversations in the save format, per engine.

A parking directory may be shared by several engines, in one process or in several. Each
engine writes only under its own namespace::

    engines/<id>/lock                   held (``flock``) by the engine while it is open
    engines/<id>/entries/<32 hex>.json  one checksummed manifest per parked conversation:
                                        its engine, record and blob checksums
    engines/<id>/blobs/<sha256>.bin     its state and checkpoints, named by content

Writes are atomic (temp file, fsync, rename; blobs first) and nothing is pickled.

Opening a directory makes the engine's namespace (renamed into place once its lock is held)
and looks at the others. A namespace whose lock nobody holds is orphaned: its entries this
engine can serve (signed by this user's key, same model, context, KV layout and build; on
plain attention another slot count too) are adopted in their order of use, copied and
committed before their old manifests go (:mod:`nbkv.store.park_adopt`: a kill or a full disk
meanwhile loses nothing); others are left alone, and files no manifest names (a killed
writer's) are deleted. A namespace whose lock is held is never touched; nbkv 0.1's layout
(no ``engines/``) counts as orphaned.

An entry that fails a check when read is never served. A read-only directory still serves
what it holds; on a full disk the oldest entries make room.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkv.core.errors import InvalidRequestError, RestoreError, UntrustedSaveError
from nbkv.store.blobstore import (
    BLOB_NAME,
    BLOBS,
    Blobs,
    Reader,
    fsync_dir,
    manifest_text,
    read_manifest,
    sweep,
    write_blobs,
    write_file,
)
from nbkv.store.park_adopt import (
    ENGINES,
    ENTRIES,
    LOCK,
    adopt_orphans,
    entry_file,
    flock,
    unlink,
)
from nbkv.store.parked import (
    DISK,
    ParkedEntry,
    ParkedInfo,
    entry_from_json,
    entry_json,
)
from nbkv.store.save_checks import restream

log = logging.getLogger("nbkv.store.parking")

FORMAT = "nbkv-parked"
VERSION = 1
GIB = 1 << 30


def default_disk_budget(root: Path) -> int:
    """A quarter of the free space where ``root`` is, at most 16 GiB.

    At least half of it up to 1 GiB: on a small disk a quarter would refuse every entry as
    larger than the whole budget (a disk that fills up deletes the oldest entries).
    """
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = 4 * GIB
    return max(min(free // 4, 16 * GIB), min(free // 2, GIB))


def _canon(identity: Mapping[str, Any]) -> dict[str, Any]:
    """``identity`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(dict(identity), sort_keys=True))


def servable(parked: Any, mine: Mapping[str, Any]) -> tuple[list[str], int | None]:
    """What keeps an entry parked under identity ``parked`` from this engine, if anything.

    Returns the differences (none: servable) and, when the entry was parked with another
    number of slots on plain attention (its state is then re-addressed when read), that
    number.
    """
    if not isinstance(parked, dict):
        return ["no engine identity"], None
    theirs, ours = parked.get("n_slots"), mine.get("n_slots")
    moves = ("n_slots", "kv_streams")  # a slot each, and the exact mode's shadow sequence
    diffs = [f"{k}: parked with {parked.get(k)!r}, this engine has {mine.get(k)!r}"
             for k in sorted(set(parked) | set(mine))
             if k not in moves and parked.get(k) != mine.get(k)]
    if diffs or all(parked.get(k) == mine.get(k) for k in moves):
        return diffs, None
    if mine.get("memory") == "plain" and isinstance(theirs, int) and theirs > 0:
        return [], theirs
    if theirs == ours:
        return [f"KV streams: parked with {parked.get('kv_streams')!r}, this engine has "
                f"{mine.get('kv_streams')!r} (only plain attention states are re-addressed)"], None
    return [f"n_slots: parked with {theirs!r}, this engine has {ours!r} (only plain "
            "attention states move between slot counts)"], None


@dataclass(frozen=True)
class _Record:
    info: ParkedInfo
    path: Path
    blobs: dict[str, int]  # name -> size
    slots_from: int | None = None  # parked with this many slots: re-addressed when read


@dataclass(frozen=True)
class Put:
    """What :meth:`DiskTier.put` did: whether it wrote the entry (what it evicted is told)."""

    written: bool
    why: str = ""  # why it was not written
    full: bool = False  # not written because the disk (or the user's quota) is full


@dataclass(frozen=True)
class Staged:
    """A write :meth:`DiskTier.prepare` did, for :meth:`DiskTier.commit` to make an entry."""

    key: str
    info: ParkedInfo
    dir: Path  # the namespace it was written under
    path: Path  # the manifest's name once committed
    staged: Path  # the manifest, written and fsynced under a temporary name
    sizes: dict[str, int]  # its blobs: name -> size
    names: frozenset[str]  # what the sweep keeps until it is committed or discarded


#: ``on_lost(info, why, corrupt)``: an entry left the disk other than by take or delete
LostCallback = Callable[[ParkedInfo, str, bool], None]


class DiskTier:
    """An engine's parked entries under ``root``, at most ``budget`` bytes of blobs.

    ``identity`` describes the engine (model fingerprint, n_ctx per slot, number of slots,
    memory class, KV types, llama.cpp build...): written into every entry and compared on
    every read. ``n_vocab`` bounds the token ids an entry may hold. ``on_lost`` hears of
    every entry that leaves other than by :meth:`take` or :meth:`delete` (the budget, a
    deleted directory); call :meth:`close` to release the namespace for others to adopt.
    """

    def __init__(self, root: str | Path, budget: int | None = None,
                 identity: Mapping[str, Any] | None = None, n_vocab: int = 1 << 31,
                 on_lost: LostCallback | None = None) -> None:
        self.root = Path(root).expanduser()
        self.budget = default_disk_budget(self.root) if budget is None else int(budget)
        self.identity = _canon(identity or {})
        self.n_vocab = n_vocab
        self.on_lost = on_lost
        self.skipped = 0  # entries found corrupt, and deleted
        self.adopted = 0  # entries taken over from engines that were closed
        self.gone: str | None = None  # why the directory cannot be written, if it cannot
        self.undeleted: set[Path] = set()  # manifests the file system would not delete yet
        self._index: dict[str, _Record] = {}
        self._pending: set[str] = set()  # files of writes prepared, not yet committed
        self._pending_lock = threading.Lock()
        self._fd: int | None = None
        try:
            self.dir = self._make_namespace()
        except OSError as e:  # (a directory the door found writable, turned read-only)
            raise InvalidRequestError(f"park_dir {str(self.root)!r} cannot be used: {e}") from e
        self._closer = weakref.finalize(self, _close_fd, self._fd)
        adopt_orphans(self)
        self._sweep()  # the copies of an adoption cut short (a full disk): no manifest names them
        self._fit_budget()

    # ------------------------------------------------------------------ what is there

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def infos(self) -> list[ParkedInfo]:
        """Every entry's light view (entries of a deleted directory are announced lost)."""
        if self._index and not (self.dir / ENTRIES).is_dir():
            self._usable()
        return [r.info for r in self._index.values()]

    @property
    def used(self) -> int:
        """Bytes of blobs the entries take (a blob shared by two entries counted once)."""
        sizes: dict[str, int] = {}
        for r in self._index.values():
            sizes.update(r.blobs)
        return sum(sizes.values())

    def close(self) -> None:
        """Release the namespace: another engine opening the directory may adopt it."""
        self._closer()

    # ------------------------------------------------------------------ writing

    def put(self, entry: ParkedEntry) -> Put:
        """Write ``entry``, then delete the oldest entries to stay within the budget.

        Not written (a :class:`Put` saying why): an entry larger than the whole budget, one
        the file system refuses, or any while the directory is :attr:`gone`. On a full disk,
        older entries are deleted first (:meth:`make_room`). The same as :meth:`stage`
        then :meth:`commit`, in one call.
        """
        if not self._usable():
            return Put(False, why=f"the disk tier is gone: {self.gone}")
        staged = self.stage(entry)
        return self.commit(staged) if isinstance(staged, Staged) else staged

    def stage(self, entry: ParkedEntry, room: Callable[[], int] | None = None
              ) -> Staged | Put:
        """:meth:`prepare`; on a full disk, ``room()`` frees older entries and it tries again.

        ``room`` defaults to :meth:`make_room`; it returns the bytes freed (0: give up). A
        writer stops making room once it freed more than its entry needs (the disk is then
        filled by someone else). Any error of the write is a :class:`Put` saying so.
        """
        freed = 0
        while True:
            try:
                staged = self.prepare(entry)
            except Exception as e:  # noqa: BLE001 - one entry's failure never stops the others
                log.exception("parking: writing entry %s to disk failed", entry.key)
                return Put(False, why=f"could not write it to disk: {e!r}")
            if not (isinstance(staged, Put) and staged.full) or freed > entry.nbytes:
                return staged
            n = self.make_room(entry.info(DISK)) if room is None else room()
            if not n:
                return staged
            freed += n

    def make_room(self, newer: ParkedInfo) -> int:
        """The disk is full: delete the least recently used entry older than ``newer``.

        Announced (``on_lost``). Returns its bytes, 0 when no entry here is older. The
        newest entries stay, as the budget keeps them.
        """
        older = [r for k, r in self._index.items() if k != newer.key
                 and r.info.recency <= newer.recency]
        if not older:
            return 0
        victim = min(older, key=lambda r: r.info.recency).info
        log.info("disk full: parked entry %s (%s) deleted to make room for %s", victim.key,
                 victim.session or "-", newer.key)
        self.delete(victim.key)
        self.tell(victim, f"the disk is full: deleted to make room for a newer entry "
                          f"({newer.session or 'an unnamed conversation'})")
        return max(victim.nbytes, 1)

    def prepare(self, entry: ParkedEntry) -> Staged | Put:
        """The write phase of :meth:`put`, safe outside the caller's lock (one at a time).

        Writes the entry's blobs and its manifest under a temporary name (fsynced), touching
        no index: the entry is not on disk until :meth:`commit` renames the manifest into
        place, so a crash before leaves no entry. Until then :meth:`_sweep` keeps its files.
        ``entry``'s buffers must stay unwritten meanwhile. A :class:`Put` when not written.
        """
        blobs = Blobs()
        record = entry_json(entry, blobs)
        sizes = {n: len(mv) for n, mv in blobs.data.items()}
        if sum(sizes.values()) > self.budget:
            return Put(False, why=f"larger than the whole disk budget "
                                  f"({sum(sizes.values()):,} > {self.budget:,} bytes)")
        directory = self.dir
        body = {"format": FORMAT, "version": VERSION, "identity": self.identity,
                "created": time.time(), "entry": record, "blobs": blobs.table()}
        path = directory / ENTRIES / entry_file(entry.key)
        staged = path.with_name(f".{path.name}.staged.tmp")
        names = {*sizes, path.name}
        with self._pending_lock:  # a sweep keeps these files from now on
            self._pending |= names
        try:
            write_blobs(directory, blobs)
            write_file(staged, [manifest_text(body).encode()])
        except OSError as e:  # a full disk, a directory turned read-only or deleted
            unlink(staged)
            self.release(names)
            return Put(False, why=f"could not write it to {path.parent}: {e}",
                       full=e.errno in (errno.ENOSPC, errno.EDQUOT))
        return Staged(entry.key, entry.info(DISK), directory, path, staged, sizes,
                      frozenset(names))

    def commit(self, staged: Staged) -> Put:
        """The commit phase of :meth:`put` (under the caller's lock): the entry is on disk.

        Renames the manifest into place, adds the entry to the index and keeps the budget.
        """
        try:
            if staged.dir != self.dir or not self._usable():
                raise OSError(f"the directory changed while it was written ({self.gone or ''})")
            self.delete(staged.key)
            os.replace(staged.staged, staged.path)
            fsync_dir(staged.path.parent)
        except OSError as e:
            self.discard(staged)
            return Put(False, why=f"could not write it to {staged.path.parent}: {e}")
        self._index[staged.key] = _Record(staged.info, staged.path, staged.sizes)
        self.release(staged.names)
        self._fit_budget(keep=staged.key)
        return Put(True)

    def discard(self, staged: Staged) -> None:
        """Drop a prepared write: its manifest, and its blobs no committed entry names."""
        unlink(staged.staged)
        self.release(staged.names)
        self._sweep()

    def release(self, names: Iterable[str]) -> None:
        """Stop keeping the files of a write (its blobs, its manifest's temporary names)."""
        with self._pending_lock:
            self._pending.difference_update(names)

    def _fit_budget(self, keep: str | None = None) -> None:
        """Delete the least recently used entries (not ``keep``) until within the budget."""
        while self.used > self.budget and len(self._index) > (keep is not None):
            victim = min((r for k, r in self._index.items() if k != keep),
                         key=lambda r: r.info.recency)
            log.info("disk budget: parked entry %s (%s, %d tokens) deleted", victim.info.key,
                     victim.info.session or "-", victim.info.n_tokens)
            self.delete(victim.info.key)
            self.tell(victim.info, "over the disk budget")

    def tell(self, info: ParkedInfo, why: str, corrupt: bool = False) -> None:
        """Announce an entry that left the disk other than by take or delete."""
        if self.on_lost is not None:
            self.on_lost(info, why, corrupt)

    # ------------------------------------------------------------------ reading

    def read(self, key: str) -> ParkedEntry | None:
        """The entry ``key``, every byte checked; None (and the entry deleted) if it fails."""
        rec = self._index.get(key)
        if rec is None:
            return None
        if not rec.path.exists() and not (self.dir / ENTRIES).is_dir():
            self._usable()  # the directory was deleted: its entries are announced lost
            return None
        try:
            body = self.body(rec.path)
            diffs, _ = servable(body.get("identity"), self.identity)
            if diffs:
                raise RestoreError("parked by another engine: " + "; ".join(diffs))
            read = Reader(self.dir, body["blobs"])
            state = None
            if rec.slots_from is not None:
                n_now = int(self.identity.get("kv_streams") or self.identity["n_slots"])

                def state(name: str) -> Any:
                    return restream(read(name), n_now)

            entry = entry_from_json(body.get("entry"), read, self.n_vocab, state)
            if entry.key != key:
                raise RestoreError(f"it holds entry {entry.key!r}, not {key!r}")
        except (RestoreError, OSError) as e:
            self.skip(rec.path, str(e))
            self.delete(key)
            self.tell(rec.info, f"unreadable: {e}", corrupt=True)
            return None
        return entry

    def take(self, key: str) -> ParkedEntry | None:
        """:meth:`read` the entry, then delete it from disk.

        Read, it is served even where its file cannot be deleted (a directory turned
        read-only): :meth:`delete` says so, and tries again later.
        """
        entry = self.read(key)
        self.delete(key)
        return entry

    @staticmethod
    def body(path: Path) -> dict[str, Any]:
        """The checked body of an entry manifest (format, version, checksum, blob table)."""
        body, why = read_manifest(path, FORMAT, VERSION)
        if why:  # never served: its KV could be anything (nbkv.core.signing)
            raise UntrustedSaveError(f"not signed by your nbkv key: {why}")
        table = body.get("blobs")
        if not isinstance(table, dict) or not all(
                BLOB_NAME.fullmatch(n) and isinstance(m, dict) and isinstance(m.get("size"), int)
                for n, m in table.items()):
            raise RestoreError("malformed blob table")
        return body

    # ------------------------------------------------------------------ deleting

    def delete(self, key: str) -> bool:
        """Forget the entry ``key`` and delete its files (blobs no other entry names).

        Never raises: a manifest the file system will not delete (a directory turned
        read-only) is logged and kept in :attr:`undeleted`, deleted at the next chance.
        """
        rec = self._index.pop(key, None)
        if rec is None:
            return False
        if unlink(rec.path) is not None:
            self.undeleted.add(rec.path)
        fsync_dir(rec.path.parent)
        self._sweep()
        return True

    def clear(self) -> None:
        """Delete every entry."""
        for key in list(self._index):
            self.delete(key)

    def skip(self, path: Path, why: str) -> None:
        """An entry's manifest failed a check: never served, deleted (counted, logged)."""
        log.warning("parked entry %s skipped and deleted: %s", path, why)
        self.skipped += 1
        if unlink(path) is not None:
            self.undeleted.add(path)

    def _sweep(self) -> None:
        for path in list(self.undeleted):  # manifests left before: try again
            if unlink(path, quiet=True) is None:
                self.undeleted.discard(path)
        with self._pending_lock:  # held throughout: a write starting now waits for it
            keep = set(self._pending)
            for r in self._index.values():
                keep.update(r.blobs)

            def stale(f: Path) -> bool:  # writes here are this engine's: one not pending failed
                return not any(n in f.name for n in self._pending)

            sweep(self.dir, keep, stale_tmp=stale)
            for f in (self.dir / ENTRIES).glob(".*.tmp"):
                if stale(f):
                    unlink(f, quiet=True)

    # ------------------------------------------------------------------ the namespace

    def _make_namespace(self) -> Path:
        """Create and lock this engine's namespace; returns its directory."""
        engines = self.root / ENGINES
        if engines.exists() and not engines.is_dir():
            raise InvalidRequestError(
                f"park_dir {str(self.root)!r} is not a parking directory: its {ENGINES!r} "
                "entry is a file (move it away, or give another park_dir)")
        engines.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode())
        name = f"{digest.hexdigest()[:12]}-{os.getpid()}-{secrets.token_hex(4)}"
        new = engines / f".{name}.new"
        (new / ENTRIES).mkdir(parents=True)
        (new / BLOBS).mkdir()
        self._fd = os.open(new / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        flock(self._fd, blocking=True)
        os.rename(new, engines / name)
        fsync_dir(engines)
        return engines / name

    def _usable(self) -> bool:
        """Make the namespace again if it was deleted; False (and :attr:`gone`) if it cannot."""
        if (self.dir / ENTRIES).is_dir() and (self.dir / BLOBS).is_dir() \
                and (self.dir / LOCK).exists():
            self.gone = None
            return True
        lost = [r.info for r in self._index.values() if not r.path.exists()]
        for info in lost:
            self._index.pop(info.key, None)
        try:
            self._closer()  # the old lock (a finalizer runs once)
            self.dir = self._make_namespace()
            self._closer = weakref.finalize(self, _close_fd, self._fd)
        except (OSError, InvalidRequestError) as e:  # (its engines entry made a file)
            self.gone = f"{self.root} cannot be written ({e})"
            log.warning("parking directory: %s; parked conversations stay in RAM", self.gone)
            ok = False
        else:
            self.gone = None
            log.warning("parking directory %s was deleted: made again (%d parked "
                        "entries lost with it)", self.root, len(lost))
            self._sweep()  # entries whose manifests survive elsewhere keep their blobs
            ok = True
        for info in lost:
            self.tell(info, "its file was deleted from the parking directory")
        return ok

    # ------------------------------------------------------------------ adoption's view

    def keys(self) -> list[str]:
        """The keys of the entries on disk."""
        return list(self._index)

    def holds(self, key: str, blobs: Iterable[str]) -> bool:
        """Whether the entry ``key`` is here already, naming the same ``blobs``."""
        rec = self._index.get(key)
        return rec is not None and set(rec.blobs) == set(blobs)

    def servable(self, identity: Any) -> tuple[list[str], int | None]:
        """:func:`servable` against this engine's identity."""
        return servable(identity, self.identity)

    def add(self, key: str, info: ParkedInfo, blobs: dict[str, int],
            slots_from: int | None = None) -> None:
        """Index an entry whose manifest was just committed under this namespace."""
        self._index[key] = _Record(info, self.dir / ENTRIES / entry_file(key), blobs,
                                   slots_from)

def _close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)  # releases the flock
        except OSError:
            pass

