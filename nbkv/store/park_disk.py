"""The disk tier of the parking lot: parked conversations in the save format, per engine.

A parking directory may be shared by several engines, in one process or in several. Each
engine writes only under its own namespace::

    engines/<id>/lock                   held (``flock``) by the engine while it is open
    engines/<id>/entries/<32 hex>.json  one checksummed manifest per parked conversation:
                                        its engine identity, its record
                                        (:func:`nbkv.store.parked.entry_json`) and each
                                        blob's checksum and size
    engines/<id>/blobs/<sha256>.bin     its state and checkpoints, named by content

Writes are atomic (temp file, fsync, rename; blobs first) and nothing is pickled.

Opening a directory makes the engine's namespace (renamed into place once its lock is held)
and looks at the others. A namespace whose lock nobody holds is orphaned: its entries this
engine can serve (signed by this user's key, same model, context, KV layout and build; on
plain attention another slot count too) are adopted, in their order of use, others are left
alone, and files no manifest names (a killed writer's) are deleted. A namespace whose lock
is held is never touched; nbkv 0.1's layout (no ``engines/``) counts as orphaned.

An entry failing a check when read is skipped with a warning naming its file, and deleted. A
directory deleted while the engine runs is made again at the next write (its entries are
reported lost); where it cannot be, :attr:`DiskTier.gone` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkv.core.errors import RestoreError, UntrustedSaveError
from nbkv.store.blobstore import (
    BLOB_NAME,
    BLOBS,
    Blobs,
    Reader,
    body_checksum,
    fsync_dir,
    manifest_text,
    sweep,
    untrusted,
    write_blobs,
    write_file,
)
from nbkv.store.parked import (
    DISK,
    ParkedEntry,
    ParkedInfo,
    entry_from_json,
    entry_json,
    info_from_json,
)
from nbkv.store.save_checks import restream

log = logging.getLogger("nbkv.store.parking")

FORMAT = "nbkv-parked"
VERSION = 1
ENTRIES = "entries"
ENGINES = "engines"
LOCK = "lock"
_ENTRY_FILE = re.compile(r"[0-9a-f]{32}\.json")
LEGACY_TMP_AGE = 3600.0  # nbkv 0.1's layout has no lock: a temporary file this old is stale
GIB = 1 << 30


def default_disk_budget(root: Path) -> int:
    """A quarter of the free space where ``root`` is, at most 16 GiB."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = 4 * GIB
    return min(free // 4, 16 * GIB)


def entry_file(key: str) -> str:
    """The manifest name of the entry ``key`` (a digest: session names never make paths)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] + ".json"


def _canon(identity: Mapping[str, Any]) -> dict[str, Any]:
    """``identity`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(dict(identity), sort_keys=True))


def differences(parked: Any, mine: Mapping[str, Any]) -> list[str]:
    """What differs between the identity an entry was parked under and this engine's."""
    if not isinstance(parked, dict):
        return ["no engine identity"]
    return [f"{k}: parked with {parked.get(k)!r}, this engine has {mine.get(k)!r}"
            for k in sorted(set(parked) | set(mine)) if parked.get(k) != mine.get(k)]


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
    diffs = differences({k: v for k, v in parked.items() if k not in moves},
                        {k: v for k, v in mine.items() if k not in moves})
    if diffs or all(parked.get(k) == mine.get(k) for k in moves):
        return diffs, None
    if mine.get("memory") == "plain" and isinstance(theirs, int) and theirs > 0:
        return [], theirs
    if theirs == ours:
        return [f"KV streams: parked with {parked.get('kv_streams')!r}, this engine has "
                f"{mine.get('kv_streams')!r} (only plain attention states are re-addressed)"], None
    return [f"n_slots: parked with {theirs!r}, this engine has {ours!r} (only plain "
            "attention states move between slot counts)"], None


def _flock(fd: int, blocking: bool = False) -> bool:
    """Take an exclusive ``flock`` on ``fd``; False when another holder has it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: every other namespace looks live
        return not blocking
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _orphaned(ns: Path, legacy: bool) -> Iterator[bool]:
    """Hold ``ns``'s lock if nobody does (its engine is gone); yields whether it is held."""
    target = ns / ENTRIES if legacy else ns / LOCK
    try:
        fd = os.open(target, os.O_RDONLY if legacy else os.O_RDWR)
    except OSError:  # no lock file: a namespace being made, or not one at all
        yield False
        return
    try:
        yield _flock(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Record:
    info: ParkedInfo
    path: Path
    blobs: dict[str, int]  # name -> size
    slots_from: int | None = None  # parked with this many slots: re-addressed when read


@dataclass(frozen=True)
class Put:
    """What :meth:`DiskTier.put` did: whether it wrote the entry, and what it evicted."""

    written: bool
    evicted: tuple[ParkedInfo, ...] = ()
    why: str = ""  # why it was not written


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
        self._index: dict[str, _Record] = {}
        self._pending: set[str] = set()  # files of writes prepared, not yet committed
        self._pending_lock = threading.Lock()
        self._fd: int | None = None
        self.dir = self._make_namespace()
        self._closer = weakref.finalize(self, _close_fd, self._fd)
        self._adopt_orphans()
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
        the file system refuses, or any while the directory is :attr:`gone`. The same as
        :meth:`prepare` then :meth:`commit`, in one call.
        """
        if not self._usable():
            return Put(False, why=f"the disk tier is gone: {self.gone}")
        staged = self.prepare(entry)
        return staged if isinstance(staged, Put) else self.commit(staged)

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
        except OSError as e:
            staged.unlink(missing_ok=True)
            self.release(names)
            return Put(False, why=f"could not write it to {path.parent}: {e}")
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
        return Put(True, self._fit_budget(keep=staged.key))

    def discard(self, staged: Staged) -> None:
        """Drop a prepared write: its manifest, and its blobs no committed entry names."""
        staged.staged.unlink(missing_ok=True)
        self.release(staged.names)
        self._sweep()

    def release(self, names: Iterable[str]) -> None:
        """Stop keeping the files of a write (its blobs, its manifest's temporary names)."""
        with self._pending_lock:
            self._pending.difference_update(names)

    def _fit_budget(self, keep: str | None = None) -> tuple[ParkedInfo, ...]:
        """Delete the least recently used entries (not ``keep``) until within the budget."""
        gone = []
        while self.used > self.budget and len(self._index) > (keep is not None):
            victim = min((r for k, r in self._index.items() if k != keep),
                         key=lambda r: (r.info.used_at, r.info.last_used))
            log.info("disk budget: parked entry %s (%s, %d tokens) deleted", victim.info.key,
                     victim.info.session or "-", victim.info.n_tokens)
            self.delete(victim.info.key)
            gone.append(victim.info)
            self._tell(victim.info, "over the disk budget")
        return tuple(gone)

    def _tell(self, info: ParkedInfo, why: str, corrupt: bool = False) -> None:
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
            body = self._body(rec.path)
            diffs, _ = servable(body.get("identity"), self.identity)
            if diffs:
                raise RestoreError("parked by another engine: " + "; ".join(diffs))
            read = Reader(self.dir, body["blobs"])
            state = None
            if rec.slots_from is not None:
                n_now = int(self.identity.get("kv_streams") or self.identity["n_slots"])

                def state(name: str) -> Any:
                    data = restream(bytes(read(name)), n_now)
                    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)

            entry = entry_from_json(body.get("entry"), read, self.n_vocab, state)
            if entry.key != key:
                raise RestoreError(f"it holds entry {entry.key!r}, not {key!r}")
        except (RestoreError, OSError) as e:
            self._skip(rec.path, str(e))
            self.delete(key)
            self._tell(rec.info, f"unreadable: {e}", corrupt=True)
            return None
        return entry

    def take(self, key: str) -> ParkedEntry | None:
        """:meth:`read` the entry, then delete it from disk."""
        entry = self.read(key)
        self.delete(key)
        return entry

    @staticmethod
    def _body(path: Path) -> dict[str, Any]:
        """The checked body of an entry manifest (format, version, checksum, blob table)."""
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise RestoreError("its manifest is gone") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RestoreError(f"unreadable manifest (truncated or corrupt: {e})") from e
        body = doc.get("body") if isinstance(doc, dict) else None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise RestoreError("not a parked-entry manifest")
        if body.get("version") != VERSION:
            raise RestoreError(f"format version {body.get('version')!r}, this nbkv reads "
                               f"{VERSION}")
        if body_checksum(body) != doc.get("checksum"):
            raise RestoreError("the manifest fails its checksum (corrupt or edited)")
        why = untrusted(doc)
        if why:  # never served: its KV could be anything (nbkv.store.signing)
            raise UntrustedSaveError(f"not signed by your nbkv key: {why}")
        table = body.get("blobs")
        if not isinstance(table, dict) or not all(
                BLOB_NAME.fullmatch(n) and isinstance(m, dict) and isinstance(m.get("size"), int)
                for n, m in table.items()):
            raise RestoreError("malformed blob table")
        return body

    # ------------------------------------------------------------------ deleting

    def delete(self, key: str) -> bool:
        """Forget the entry ``key`` and delete its files (blobs no other entry names)."""
        rec = self._index.pop(key, None)
        if rec is None:
            return False
        rec.path.unlink(missing_ok=True)
        fsync_dir(rec.path.parent)
        self._sweep()
        return True

    def clear(self) -> None:
        """Delete every entry."""
        for key in list(self._index):
            self.delete(key)

    def _skip(self, path: Path, why: str) -> None:
        log.warning("parked entry %s skipped and deleted: %s", path, why)
        self.skipped += 1
        path.unlink(missing_ok=True)

    def _sweep(self) -> None:
        with self._pending_lock:  # held throughout: a write starting now waits for it
            keep = set(self._pending)
            for r in self._index.values():
                keep.update(r.blobs)

            def stale(f: Path) -> bool:  # writes here are this engine's: one not pending failed
                return not any(n in f.name for n in self._pending)

            sweep(self.dir, keep, stale_tmp=stale)
            for f in (self.dir / ENTRIES).glob(".*.tmp"):
                if stale(f):
                    f.unlink(missing_ok=True)

    # ------------------------------------------------------------------ the namespace

    def _make_namespace(self) -> Path:
        """Create and lock this engine's namespace; returns its directory."""
        engines = self.root / ENGINES
        engines.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode())
        name = f"{digest.hexdigest()[:12]}-{os.getpid()}-{secrets.token_hex(4)}"
        new = engines / f".{name}.new"
        (new / ENTRIES).mkdir(parents=True)
        (new / BLOBS).mkdir()
        self._fd = os.open(new / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        _flock(self._fd, blocking=True)
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
        except OSError as e:
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
            self._tell(info, "its file was deleted from the parking directory")
        return ok

    def _adopt_orphans(self) -> None:
        """Take over the servable entries of namespaces whose engine is gone."""
        spaces = [(p, False) for p in sorted((self.root / ENGINES).iterdir())
                  if p.is_dir() and p != self.dir
                  # a hidden one is being made (not yet locked), unless a killed one
                  and (not p.name.startswith(".") or _older_than(p, LEGACY_TMP_AGE))]
        if (self.root / ENTRIES).is_dir():
            spaces.append((self.root, True))  # nbkv 0.1's layout
        for ns, legacy in spaces:
            with _orphaned(ns, legacy) as mine:
                if mine:
                    try:
                        self._adopt(ns, legacy)
                    except OSError as e:  # another process's files: leave them
                        log.warning("parking directory: could not adopt %s: %s", ns, e)

    def _adopt(self, ns: Path, legacy: bool) -> None:
        """Move ``ns``'s servable entries here; clean what no manifest of it names."""
        found: list[tuple[Path, dict[str, Any], int | None]] = []
        stays: set[str] = set()  # blobs the entries left behind name
        for path in sorted((ns / ENTRIES).iterdir()):
            if not _ENTRY_FILE.fullmatch(path.name):
                continue
            try:
                body = self._body(path)
                info_from_json(body.get("entry"), self.n_vocab, DISK)
            except RestoreError as e:  # its engine is gone: nobody else reads it
                self._skip(path, str(e))
                continue
            diffs, slots_from = servable(body.get("identity"), self.identity)
            if diffs:
                log.info("parked entry %s left alone: %s", path, "; ".join(diffs))
                stays.update(body["blobs"])
                continue
            found.append((path, body, slots_from))
        numbers = [_number(k) for k in self._index]
        for path, body, slots_from in sorted(found, key=lambda f: (
                f[1]["entry"].get("used_at", 0), f[1]["entry"].get("last_used", 0))):
            key = str(body["entry"]["key"])
            if key in self._index:
                number = max([*numbers, _number(key)]) + 1
                numbers.append(number)
                key = f"{key.rpartition('#')[0] or '-'}#{number}"
                body["entry"]["key"] = key
            if self._move(ns, path, body, key, stays):
                info = info_from_json(body["entry"], self.n_vocab, DISK)
                target = self.dir / ENTRIES / entry_file(key)
                self._index[key] = _Record(info, target, {
                    n: m["size"] for n, m in body["blobs"].items()}, slots_from)
                self.adopted += 1
        tmp_ok = (lambda f: _older_than(f, LEGACY_TMP_AGE)) if legacy else (lambda f: True)
        for d in (ns / ENTRIES, ns):
            for f in d.iterdir():
                if f.name.endswith(".tmp") and tmp_ok(f):
                    f.unlink(missing_ok=True)
        sweep(ns, stays, stale_tmp=tmp_ok)
        if not legacy and not any((ns / ENTRIES).iterdir()):
            shutil.rmtree(ns, ignore_errors=True)
        if self.adopted:
            log.info("parking directory %s: %d entries taken over from engines that were "
                     "closed", self.root, self.adopted)

    def _move(self, ns: Path, path: Path, body: dict[str, Any], key: str,
              stays: set[str]) -> bool:
        """Move one manifest and its blobs from ``ns`` into this namespace."""
        for name in body["blobs"]:
            src, dst = ns / BLOBS / name, self.dir / BLOBS / name
            if dst.exists():  # moved with an entry adopted before (blobs are shared)
                continue
            if not src.is_file():
                self._skip(path, f"blob {name} is missing")
                self._tell(info_from_json(body["entry"], self.n_vocab, DISK),
                           f"unreadable: blob {name} is missing", corrupt=True)
                return False
            if name in stays:  # an entry left behind names it too
                shutil.copyfile(src, dst)
            else:
                os.replace(src, dst)
        write_file(self.dir / ENTRIES / entry_file(key), [manifest_text(body).encode()])
        path.unlink(missing_ok=True)
        return True


def _number(key: str) -> int:
    tail = key.rpartition("#")[2]
    return int(tail) if tail.isdigit() else 0


def _older_than(f: Path, seconds: float) -> bool:
    try:
        return time.time() - f.stat().st_mtime > seconds
    except OSError:
        return False


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)  # releases the flock
        except OSError:
            pass

