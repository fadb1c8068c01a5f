"""The disk tier of the parking lot: parked conversations in the save format.

A parking directory holds::

    entries/<32 hex>.json   one manifest per parked conversation: the engine identity it
                            was parked under, the entry's record
                            (:func:`nbkv.store.parked.entry_json`) and the checksum and
                            size of each of its blobs; the manifest carries its own
                            checksum too
    blobs/<sha256>.bin      its state and checkpoints, named by content (shared blobs once)

Everything is written atomically (temporary file, fsync, rename), blobs first, so a crash
leaves either a whole entry or none. Nothing is pickled.

Opening a directory lists what an earlier process left there: each manifest is read and
checked (checksum, signature, identity: model, per-slot context, KV layout...); the blobs
are checked only when an entry is taken. An entry that fails any check is never served: it
is skipped with a warning naming its file and why, and deleted. One engine per directory at
a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Mapping
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

log = logging.getLogger("nbkv.store.parking")

FORMAT = "nbkv-parked"
VERSION = 1
ENTRIES = "entries"
_ENTRY_FILE = re.compile(r"[0-9a-f]{32}\.json")
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


@dataclass(frozen=True)
class _Record:
    info: ParkedInfo
    path: Path
    blobs: dict[str, int]  # name -> size


class DiskTier:
    """Parked entries under ``root``, at most ``budget`` bytes of blobs (oldest go first).

    ``identity`` describes the engine (model fingerprint, n_ctx per slot, memory class, KV
    types, llama.cpp build...): written into every entry and compared on every read.
    ``n_vocab`` bounds the token ids an entry may hold.
    """

    def __init__(self, root: str | Path, budget: int | None = None,
                 identity: Mapping[str, Any] | None = None, n_vocab: int = 1 << 31) -> None:
        self.root = Path(root).expanduser()
        (self.root / ENTRIES).mkdir(parents=True, exist_ok=True)
        (self.root / BLOBS).mkdir(exist_ok=True)
        self.budget = default_disk_budget(self.root) if budget is None else int(budget)
        self.identity = _canon(identity or {})
        self.n_vocab = n_vocab
        self.skipped = 0  # entries found corrupt or foreign, and deleted
        self._index: dict[str, _Record] = {}
        self._scan()

    # ------------------------------------------------------------------ what is there

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def infos(self) -> list[ParkedInfo]:
        """Every entry's light view."""
        return [r.info for r in self._index.values()]

    @property
    def used(self) -> int:
        """Bytes of blobs the entries take (a blob shared by two entries counted once)."""
        sizes: dict[str, int] = {}
        for r in self._index.values():
            sizes.update(r.blobs)
        return sum(sizes.values())

    # ------------------------------------------------------------------ writing

    def put(self, entry: ParkedEntry) -> bool:
        """Write ``entry``, deleting the oldest entries to stay in budget; False if it cannot.

        An entry larger than the whole budget, or one the file system refuses, is not
        written (a warning says why).
        """
        blobs = Blobs()
        record = entry_json(entry, blobs)
        sizes = {n: len(mv) for n, mv in blobs.data.items()}
        if sum(sizes.values()) > self.budget:
            log.info("parked entry %s (%d bytes) is larger than the disk budget (%d): dropped",
                     entry.key, sum(sizes.values()), self.budget)
            return False
        self.delete(entry.key)
        while self._index and self._growth(sizes) + self.used > self.budget:
            oldest = min(self._index.values(), key=lambda r: r.info.last_used)
            log.debug("disk budget: deleting parked entry %s", oldest.info.key)
            self.delete(oldest.info.key)
        body = {"format": FORMAT, "version": VERSION, "identity": self.identity,
                "created": time.time(), "entry": record, "blobs": blobs.table()}
        path = self.root / ENTRIES / entry_file(entry.key)
        try:
            write_blobs(self.root, blobs)
            write_file(path, [manifest_text(body).encode()])
            fsync_dir(path.parent)
        except OSError as e:
            log.warning("could not write parked entry %s to %s: %s (dropped)", entry.key,
                        path, e)
            path.unlink(missing_ok=True)
            self._sweep()
            return False
        self._index[entry.key] = _Record(entry.info(DISK), path, sizes)
        return True

    def _growth(self, sizes: Mapping[str, int]) -> int:
        """Bytes that blobs ``sizes`` add to the directory (some may be there already)."""
        have: set[str] = set()
        for r in self._index.values():
            have.update(r.blobs)
        return sum(n for name, n in sizes.items() if name not in have)

    # ------------------------------------------------------------------ reading

    def read(self, key: str) -> ParkedEntry | None:
        """The entry ``key``, every byte checked; None (and the entry deleted) if it fails."""
        rec = self._index.get(key)
        if rec is None:
            return None
        try:
            body = self._body(rec.path)
            entry = entry_from_json(body.get("entry"), Reader(self.root, body["blobs"]),
                                    self.n_vocab)
            if entry.key != key:
                raise RestoreError(f"it holds entry {entry.key!r}, not {key!r}")
        except (RestoreError, OSError) as e:
            self._skip(rec.path, str(e))
            self.delete(key)
            return None
        return entry

    def take(self, key: str) -> ParkedEntry | None:
        """:meth:`read` the entry, then delete it from disk."""
        entry = self.read(key)
        self.delete(key)
        return entry

    def _body(self, path: Path) -> dict[str, Any]:
        """The checked body of an entry manifest (format, checksum, identity)."""
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
        diffs = differences(body.get("identity"), self.identity)
        if diffs:
            raise RestoreError("parked by another engine: " + "; ".join(diffs))
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
        keep: set[str] = set()
        for r in self._index.values():
            keep.update(r.blobs)
        sweep(self.root, keep)

    def _scan(self) -> None:
        """Index what an earlier process parked here; skip (and delete) what fails."""
        for path in sorted((self.root / ENTRIES).iterdir()):
            if not _ENTRY_FILE.fullmatch(path.name):
                if path.name.endswith(".tmp") and time.time() - path.stat().st_mtime > 3600:
                    path.unlink(missing_ok=True)
                continue
            try:
                body = self._body(path)
                info = info_from_json(body.get("entry"), self.n_vocab, DISK)
                if path.name != entry_file(info.key) or info.key in self._index:
                    raise RestoreError(f"misnamed (it holds entry {info.key!r})")
            except RestoreError as e:
                self._skip(path, str(e))
                continue
            sizes = {n: m["size"] for n, m in body["blobs"].items()}
            self._index[info.key] = _Record(info, path, sizes)
        self._sweep()
