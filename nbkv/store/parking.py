"""The parking lot: conversations that lost their slot, kept in RAM and on disk.

Slots are the first level of the cache. When a request takes a slot from another
conversation, the engine parks that conversation here (:class:`~nbkv.store.parked.ParkedEntry`)
instead of losing it; a later prompt that starts with its tokens restores it into a slot
(:func:`nbkv.kv.policy.select` weighs it against the slots) and reads only the rest.

- RAM: ``ram_bytes`` of states, least recently used entries leave first, counted in bytes.
- Disk (optional ``disk_dir``): entries that leave RAM spill there, in the save format
  (:mod:`nbkv.store.park_disk`), within their own byte budget; without a disk tier they are dropped.
  With ``background_spills`` (the engine's lot) a spill is written by a thread of its own:
  the request that parked the entry goes on (its prefill, its reply) while the entry is
  checksummed and written; listing or taking entries waits for the writes in progress.

At most one entry per session: parking a session again replaces its older entry. Pure
bookkeeping over opaque buffers: no model, no llama.cpp; safe to call from any thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from nbkv.core.errors import InvalidRequestError, RestoreError
from nbkv.llama.memplan import free_memory
from nbkv.store.blobstore import Blobs
from nbkv.store.park_disk import DiskTier
from nbkv.store.parked import DISK, RAM, TIERS, ParkedEntry, ParkedInfo, entry_from_json, entry_json

__all__ = ["DISK", "RAM", "TIERS", "ParkedEntry", "ParkedInfo", "ParkingLot",
           "default_ram_budget", "parking_stats"]

log = logging.getLogger("nbkv.store.parking")

GIB = 1 << 30


def default_ram_budget() -> int:
    """What a laptop user never has to think about: a quarter of free RAM, at most 4 GiB."""
    return min(free_memory() // 4, 4 * GIB)


class ParkingLot:
    """Parked conversations in two tiers, within byte budgets.

    ``identity`` describes the engine (model fingerprint, ``n_ctx`` per slot, number of
    slots, memory class, KV types, llama.cpp build...): every disk entry records it and one
    parked under another identity is never served. ``n_vocab`` bounds the token ids of
    entries read back. Opening an existing ``disk_dir`` lists what an earlier process
    parked there.
    """

    def __init__(self, ram_bytes: int | None = None, disk_dir: str | Path | None = None,
                 disk_bytes: int | None = None, identity: Mapping[str, Any] | None = None,
                 n_vocab: int = 1 << 31, background_spills: bool = False) -> None:
        for name, value in (("ram_bytes", ram_bytes), ("disk_bytes", disk_bytes)):
            if value is not None and value < 0:
                raise InvalidRequestError(f"{name} must be >= 0, not {value}")
        self.ram_bytes = default_ram_budget() if ram_bytes is None else int(ram_bytes)
        #: spills are written by a thread of their own (the engine's lot); else in park()
        self.background = background_spills
        self.n_vocab = n_vocab
        self.disk = (DiskTier(disk_dir, disk_bytes, identity, n_vocab)
                     if disk_dir is not None else None)
        self._ram: dict[str, ParkedEntry] = {}
        self._order: dict[str, int] = {}  # key -> when it was parked (LRU ties)
        self._lock = threading.RLock()
        self._written = threading.Condition(self._lock)  # a spill was written (or dropped)
        self._spilling: dict[str, ParkedEntry] = {}  # on their way to disk, oldest first
        self._writer: threading.Thread | None = None
        self._counts = {"parks": 0, "restores": 0, "spills": 0, "drops": 0}
        start = max((self._number(i.key) for i in self.disk.infos()), default=0) \
            if self.disk is not None else 0
        self._seq = itertools.count(start + 1)

    # ------------------------------------------------------------------ what is parked

    def entries(self) -> tuple[ParkedInfo, ...]:
        """Every parked conversation, most recently used first."""
        with self._lock:
            self.flush()
            out = [e.info(RAM) for e in self._ram.values()]
            if self.disk is not None:
                out += self.disk.infos()
        return tuple(sorted(out, key=lambda i: (-i.last_used, i.key)))

    def find(self, session: str) -> ParkedInfo | None:
        """The entry parked for ``session``, if any."""
        return next((i for i in self.entries() if i.session == session), None)

    def __len__(self) -> int:
        with self._lock:
            self.flush()
            return len(self._ram) + (len(self.disk) if self.disk is not None else 0)

    @property
    def ram_used(self) -> int:
        """Bytes of the entries in RAM."""
        with self._lock:
            return sum(e.nbytes for e in self._ram.values())

    # ------------------------------------------------------------------ parking

    def park(self, entry: ParkedEntry) -> ParkedInfo | None:
        """Park ``entry`` (it gets a new ``key``); returns where it went, None if dropped.

        Entries leaving RAM to make room spill to disk, or are dropped without a disk tier;
        one larger than the whole RAM budget goes straight to disk (or is dropped).
        """
        with self._lock:
            self._counts["parks"] += 1
            return self._park(entry)

    def _park(self, entry: ParkedEntry) -> ParkedInfo | None:
        if entry.session is not None:
            self.drop_session(entry.session)
        n = next(self._seq)
        entry.key = f"{entry.session if entry.session is not None else '-'}#{n}"
        self._order[entry.key] = n
        if entry.nbytes > self.ram_bytes:
            return entry.info(DISK) if self._spill(entry) else None
        self._ram[entry.key] = entry
        while self.ram_used > self.ram_bytes:
            victim = min(self._ram.values(), key=lambda e: (e.last_used, self._order[e.key]))
            del self._ram[victim.key]
            self._spill(victim)
        if entry.key in self._ram:
            return entry.info(RAM)
        if entry.key in self._spilling or (self.disk is not None and entry.key in self.disk):
            return entry.info(DISK)
        return None

    def _spill(self, entry: ParkedEntry) -> bool:
        """Send an entry leaving RAM to disk (written by the spill thread); False: dropped."""
        if self.disk is None or entry.nbytes > self.disk.budget:
            self._dropped(entry)
            return False
        if not self.background:
            return self._write(entry)
        self._spilling[entry.key] = entry
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_spills, name="nbkv-spill",
                                            daemon=True)
            self._writer.start()
        return True

    def _dropped(self, entry: ParkedEntry) -> None:
        self._counts["drops"] += 1
        self._order.pop(entry.key, None)
        log.info("parked entry %s (%d tokens, %d bytes) dropped: over the parking budget",
                 entry.key, len(entry.tokens), entry.nbytes)

    def _write_spills(self) -> None:
        """The spill thread: write the entries on their way to disk, oldest first, then end.

        It holds the lot while it writes one (the disk tier is one thread's at a time); the
        scheduler meanwhile prefills and decodes, which does not touch the lot.
        """
        while True:
            with self._lock:
                if not self._spilling or self.disk is None:
                    self._writer = None
                    self._written.notify_all()
                    return
                key = next(iter(self._spilling))
                self._write(self._spilling[key])
                del self._spilling[key]
                self._written.notify_all()

    def _write(self, entry: ParkedEntry) -> bool:
        """Write an entry to the disk tier (lock held); False when it is dropped."""
        assert self.disk is not None
        try:
            ok = self.disk.put(entry)
        except Exception:  # noqa: BLE001 - the entry is dropped, parking goes on
            log.exception("writing parked entry %s to disk failed", entry.key)
            ok = False
        if ok:
            self._counts["spills"] += 1
            log.debug("parked entry %s spilled to disk", entry.key)
        else:
            self._dropped(entry)
        return ok

    def flush(self) -> None:
        """Wait until every spill on its way to disk is written."""
        with self._lock:
            while self._spilling:
                self._written.wait()

    # ------------------------------------------------------------------ taking back

    def take(self, key: str) -> ParkedEntry | None:
        """Remove and return the entry ``key`` (``entry.tier`` says where it was).

        A disk entry is read and every byte checked first; one that fails (truncated,
        corrupt, parked by another model or with another ``n_ctx``) is skipped with a
        warning naming its file, deleted, and None is returned: the caller rebuilds.
        """
        with self._lock:
            if key in self._spilling:
                self.flush()  # taken back from disk, as listed
            entry = self._ram.pop(key, None)
            if entry is not None:
                entry.tier = RAM
            elif self.disk is not None and key in self.disk:
                entry = self.disk.take(key)
                if entry is not None:
                    entry.tier = DISK
            self._order.pop(key, None)
            if entry is not None:
                self._counts["restores"] += 1
            return entry

    def drop(self, key: str) -> bool:
        """Forget the entry ``key`` (not counted as a budget drop)."""
        with self._lock:
            self._order.pop(key, None)
            if self._ram.pop(key, None) is not None:
                return True
            if self._spilling.pop(key, None) is not None:
                return True
            return self.disk is not None and self.disk.delete(key)

    def drop_session(self, session: str) -> int:
        """Forget the entries of ``session``; returns how many."""
        with self._lock:
            keys = [i.key for i in self.entries() if i.session == session]
            return sum(self.drop(k) for k in keys)

    def clear(self) -> None:
        """Forget every entry, in RAM and on disk."""
        with self._lock:
            self._ram.clear()
            self._spilling.clear()
            self._order.clear()
            if self.disk is not None:
                self.disk.clear()

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict[str, Any]:
        """Parks, restores, spills, drops, corrupt entries skipped, bytes and entries by tier.

        Spills on their way to disk are written first.
        """
        with self._lock:
            self.flush()
            disk = self.disk
            return {
                **self._counts,
                "skipped_corrupt": disk.skipped if disk is not None else 0,
                "ram_bytes": self.ram_used,
                "disk_bytes": disk.used if disk is not None else 0,
                "ram_budget": self.ram_bytes,
                "disk_budget": disk.budget if disk is not None else 0,
                "entries": {RAM: len(self._ram), DISK: len(disk) if disk is not None else 0},
            }

    # ------------------------------------------------------------------ saves

    def export(self, blobs: Blobs) -> list[dict[str, Any]]:
        """Every entry as JSON for a save, its buffers added to ``blobs``; oldest first.

        Disk entries are read and checked (one that fails is skipped, as by :meth:`take`).
        """
        with self._lock:
            self.flush()
            entries = list(self._ram.values())
            if self.disk is not None:
                entries += [e for e in (self.disk.read(i.key) for i in self.disk.infos())
                            if e is not None]
            return [entry_json(e, blobs) for e in sorted(entries, key=lambda e: e.last_used)]

    def decode(self, items: Any, read: Callable[[str], Any],
               state: Callable[[str], Any] | None = None) -> list[ParkedEntry]:
        """The entries of a save's :meth:`export` items; raises ``RestoreError`` if malformed.

        ``read(name)`` returns a blob's checked bytes (``blobstore.Reader``); ``state``
        reads whole-sequence states instead, when they need converting. Touches nothing:
        call :meth:`import_` once the whole save has been checked.
        """
        if not isinstance(items, list):
            raise RestoreError("the save's parked entries are not a list")
        return [entry_from_json(d, read, self.n_vocab, state) for d in items]

    def import_(self, entries: Iterable[ParkedEntry], replace: bool = True
                ) -> list[ParkedInfo | None]:
        """Park decoded entries (replacing every entry first when ``replace``), oldest first.

        Returns where each went (None: over the budgets, dropped).
        """
        with self._lock:
            if replace:
                self.clear()
            return [self._park(e) for e in sorted(entries, key=lambda e: e.last_used)]

    @staticmethod
    def _number(key: str) -> int:
        tail = key.rpartition("#")[2]
        return int(tail) if tail.isdigit() else 0


def parking_stats(lot: ParkingLot | None) -> dict[str, Any]:
    """The parking figures of ``%kvcache stats`` (empty without a parking lot)."""
    if lot is None:
        return {}
    s = lot.stats()
    return {"parks": s["parks"], "restores": s["restores"], "spills": s["spills"],
            "parking_drops": s["drops"], "parked_skipped_corrupt": s["skipped_corrupt"],
            "parked_ram_entries": s["entries"][RAM], "parked_disk_entries": s["entries"][DISK],
            "parked_ram_bytes": s["ram_bytes"], "parked_disk_bytes": s["disk_bytes"]}
