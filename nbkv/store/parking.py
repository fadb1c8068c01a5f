"""The parking lot: conversations that lost their slot, kept in RAM and on disk.

When a request takes a slot from another conversation, the engine parks that conversation
here (:class:`~nbkv.store.parked.ParkedEntry`) instead of losing it; a later prompt that
starts with its tokens restores it into a slot (:func:`nbkv.kv.policy.select` weighs it
against the slots) and reads only the rest.

- RAM: ``ram_bytes`` of states, least recently used leave first, plus ``writing_bytes``.
- Disk (optional ``disk_dir``): entries that leave RAM spill there, in the save format
  (:mod:`nbkv.store.park_disk`), within their own byte budget; else they are dropped.

The lot's rules:

- An entry leaves the lot only when its own session takes it back (:meth:`ParkingLot.take`),
  when a budget evicts it, or when the user clears the lot. A conversation that starts with
  the same tokens restores a copy (:meth:`ParkingLot.borrow`) and leaves the entry in place.
- Every eviction is announced: counted in ``drops``, logged, kept in
  :attr:`ParkingLot.dropped` (session, tokens, why) and passed to ``on_drop``.
- Least recently used leaves first, by the wall clock of its last use in a slot
  (``used_at``), so the order holds across restarts and restores.
- At most one entry per session, its most recently used conversation; a restore's entries
  replace the current ones (they were asked for by name).

Pure bookkeeping over opaque buffers: no model, no llama.cpp; safe to call from any thread.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkv.core.errors import InvalidRequestError, RestoreError
from nbkv.llama.memplan import free_memory
from nbkv.store.blobstore import Blobs
from nbkv.store.park_adopt import number
from nbkv.store.park_disk import GIB, DiskTier, Put, Staged
from nbkv.store.parked import DISK, RAM, TIERS, ParkedEntry, ParkedInfo, entry_from_json, entry_json

__all__ = ["DISK", "RAM", "TIERS", "Dropped", "ParkedEntry", "ParkedInfo", "ParkingLot",
           "default_ram_budget", "parking_stats"]

log = logging.getLogger("nbkv.store.parking")


def default_ram_budget() -> int:
    """What a laptop user never has to think about: a quarter of free RAM, at most 4 GiB."""
    return min(free_memory() // 4, 4 * GIB)


@dataclass(frozen=True)
class Dropped:
    """A parked conversation that left the lot without its session taking it back."""

    session: str | None
    key: str
    n_tokens: int
    tier: str  # where it was: RAM or DISK
    why: str
    at: float  # wall clock

    def __str__(self) -> str:
        return (f"{self.session or 'an unnamed conversation'} ({self.n_tokens:,} tokens, "
                f"{self.tier}): {self.why}")


#: evictions kept for ``%kvcache parked``
DROPS_KEPT = 50
#: spills waiting for the writer thread at most (more: the park writes itself, as before)
SPILL_QUEUE = 2
#: seconds the writer thread waits idle before it ends (the next spill starts another)
WRITER_IDLE = 5.0
#: seconds :meth:`ParkingLot.flush` (and close, spill_all, export) waits for the writer
FLUSH_TIMEOUT = 120.0


class ParkingLot:
    """Parked conversations in two tiers, within byte budgets.

    ``identity`` describes the engine (model fingerprint, ``n_ctx`` per slot, number of
    slots, memory class, KV types, llama.cpp build...): every disk entry records it and one
    parked under another identity is never served (:mod:`nbkv.store.park_disk`). ``n_vocab``
    bounds the token ids of entries read back. Opening a ``disk_dir`` takes over what engines
    that were closed parked there. ``on_drop`` is called with each :class:`Dropped`.
    """

    def __init__(self, ram_bytes: int | None = None, disk_dir: str | Path | None = None,
                 disk_bytes: int | None = None, identity: Mapping[str, Any] | None = None,
                 n_vocab: int = 1 << 31, on_drop: Callable[[Dropped], Any] | None = None
                 ) -> None:
        for name, value in (("ram_bytes", ram_bytes), ("disk_bytes", disk_bytes)):
            if value is not None and value < 0:
                raise InvalidRequestError(f"{name} must be >= 0, not {value}")
        self.ram_bytes = default_ram_budget() if ram_bytes is None else int(ram_bytes)
        self.n_vocab = n_vocab
        self.on_drop = on_drop
        self.dropped: deque[Dropped] = deque(maxlen=DROPS_KEPT)
        self._ram: dict[str, ParkedEntry] = {}
        self._order: dict[str, int] = {}  # key -> when it was parked (LRU ties)
        self._lock = threading.RLock()
        self._counts = {"parks": 0, "restores": 0, "spills": 0, "drops": 0}
        # entries leaving RAM for disk, written by the writer thread: still served from RAM
        self._writing: dict[str, ParkedEntry] = {}
        self._done = threading.Condition(self._lock)
        self._queue: queue.Queue[ParkedEntry | None] = queue.Queue(SPILL_QUEUE)
        self._writer: threading.Thread | None = None
        self._jobs = 0  # spills handed to the writer and not yet finished (discarded ones too)
        self.disk = (DiskTier(disk_dir, disk_bytes, identity, n_vocab, self._lost)
                     if disk_dir is not None else None)
        start = max((number(i.key) for i in self.disk.infos()), default=0) \
            if self.disk is not None else 0
        self._seq = itertools.count(start + 1)

    # ------------------------------------------------------------------ what is parked

    def entries(self) -> tuple[ParkedInfo, ...]:
        """Every parked conversation, most recently used first."""
        with self._lock:
            out = [e.info(RAM) for e in (*self._ram.values(), *self._writing.values())]
            if self.disk is not None:
                out += self.disk.infos()
        return tuple(sorted(out, key=lambda i: (-i.used_at, -i.last_used, i.key)))

    def find(self, session: str) -> ParkedInfo | None:
        """The entry parked for ``session``, if any."""
        return next((i for i in self.entries() if i.session == session), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ram) + len(self._writing) + (
                len(self.disk) if self.disk is not None else 0)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._ram or key in self._writing or (
                self.disk is not None and key in self.disk)

    @property
    def ram_used(self) -> int:
        """Bytes of the entries in RAM (those being written to disk included)."""
        with self._lock:
            return self._resident() + sum(e.nbytes for e in self._writing.values())

    def _resident(self) -> int:
        """Bytes of the RAM tier's entries, within its budget (not those being written)."""
        return sum(e.nbytes for e in self._ram.values())

    # ------------------------------------------------------------------ parking

    def park(self, entry: ParkedEntry, drop: bool = True) -> ParkedInfo | None:
        """Park ``entry`` (it gets a new ``key``); returns where it went, None if not kept.

        An older conversation of a session whose newer one is parked is not parked: the
        newer entry's info is returned.

        Entries leaving RAM to make room spill to disk, or are dropped (announced) without
        one; an entry larger than the whole RAM budget goes straight to disk. With
        ``drop=False`` an entry that fits nowhere is not dropped but handed back (None, and
        nothing announced): the caller keeps it where it is.
        """
        with self._lock:
            info = self._park(entry, drop)
            if info is not None or drop:
                self._counts["parks"] += 1
            return info

    def _park(self, entry: ParkedEntry, drop: bool = True, force: bool = False
              ) -> ParkedInfo | None:
        if entry.session is not None:
            newer = self.find(entry.session)
            if newer is not None and not force and newer.recency > entry.recency:
                return newer  # an older conversation of a session: its newer one stands
            self.drop_session(entry.session)  # its older conversation: superseded
        n = next(self._seq)
        entry.key = f"{entry.session if entry.session is not None else '-'}#{n}"
        self._order[entry.key] = n
        if entry.nbytes > self.ram_bytes:
            return entry.info(DISK) if self._spill(entry, drop) else None
        self._ram[entry.key] = entry
        while self._resident() > self.ram_bytes:
            victim = min(self._ram.values(), key=self._lru)
            del self._ram[victim.key]
            if victim is entry or not self._spill_later(victim):
                self._spill(victim, drop or victim is not entry)
        if entry.key in self._ram:
            return entry.info(RAM)
        return entry.info(DISK) if self.disk is not None and entry.key in self.disk else None

    def _lru(self, e: ParkedEntry) -> tuple[float, int, int]:
        return (*e.recency, self._order.get(e.key, 0))

    def _spill(self, entry: ParkedEntry, drop: bool = True) -> bool:
        """Move an entry leaving RAM to disk; False when it is dropped (or handed back)."""
        if self.disk is None:
            why = ("larger than the whole RAM budget" if entry.nbytes > self.ram_bytes else
                   "over the RAM budget") + " (no disk tier)"
            return self._spilled(entry, Put(False, why=why), drop)
        try:
            put = self.disk.put(entry)
        except Exception as e:  # noqa: BLE001 - one entry's failure never stops the others
            log.exception("parking: writing entry %s to disk failed", entry.key)
            put = Put(False, why=f"could not write it to disk: {e!r}")
        return self._spilled(entry, put, drop)

    def _spilled(self, entry: ParkedEntry, put: Put, drop: bool = True) -> bool:
        """Count a spill written, or forget (and announce, with ``drop``) one that was not."""
        if put.written:
            self._counts["spills"] += 1
            log.debug("parked entry %s spilled to disk", entry.key)
            return True
        self._order.pop(entry.key, None)
        if drop:
            self._announce(entry.info(RAM), put.why)
        return False

    def _spill_later(self, entry: ParkedEntry) -> bool:
        """Hand ``entry`` to the writer thread; False when its queue is full (write it now)."""
        if self.disk is None:
            return False
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            return False
        self._writing[entry.key] = entry
        self._jobs += 1
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="nbkv-park-writer",
                                            daemon=True)
            self._writer.start()
        return True

    def _write_loop(self) -> None:
        """The writer thread: each spill written outside the lot's lock, committed under it."""
        while True:
            try:
                entry = self._queue.get(timeout=WRITER_IDLE)
            except queue.Empty:
                with self._lock:  # idle: end (a lot nobody closed can then be collected)
                    if self._queue.empty():
                        self._writer = None
                        return
                continue
            if entry is None:
                return
            with self._lock:
                if entry.key not in self._writing:  # taken back or dropped while queued
                    self._jobs -= 1
                    self._done.notify_all()
                    continue
                # its own view of the entry: a restore that takes it back meanwhile empties
                # the entry's state field, and does not recycle a buffer this one holds
                job = copy.copy(entry)
            assert self.disk is not None
            staged = self.disk.stage(job, functools.partial(self._make_room, entry))
            with self._lock:
                try:
                    self._commit(entry, staged)
                except Exception:  # noqa: BLE001 - the writer serves the next spill
                    log.exception("parking: committing entry %s to disk failed", entry.key)
                finally:
                    del job
                    self._jobs -= 1
                    self._done.notify_all()

    def _make_room(self, entry: ParkedEntry) -> int:
        """A full disk: older entries go while ``entry`` is still to be written."""
        assert self.disk is not None
        with self._lock:
            return self.disk.make_room(entry.info(DISK)) if entry.key in self._writing else 0

    def _commit(self, entry: ParkedEntry, staged: Staged | Put) -> None:
        """Under the lock: the spill of ``entry`` is on disk, or reported as not written."""
        assert self.disk is not None
        if self._writing.pop(entry.key, None) is None:  # taken back or dropped meanwhile
            if isinstance(staged, Staged):
                self.disk.discard(staged)
            return
        self._spilled(entry, staged if isinstance(staged, Put) else self.disk.commit(staged))

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Wait until every spill handed to the writer thread is on disk (or reported).

        A spill discarded (its entry taken back meanwhile) is waited for too: its files are
        gone when this returns.

        Raises ``TimeoutError`` naming what is still being written after ``timeout`` seconds.
        """
        if threading.current_thread() is self._writer:
            return  # a listener called from the writer: it cannot wait for itself
        with self._lock:
            if not self._done.wait_for(lambda: not self._jobs, timeout):
                raise TimeoutError(
                    f"parking: {self._jobs} spills still being written to "
                    f"{self.disk.dir if self.disk is not None else 'disk'} after {timeout:g} s "
                    f"(entries {', '.join(self._writing) or 'taken back meanwhile'})")

    def _lost(self, info: ParkedInfo, why: str, corrupt: bool = False) -> None:
        """The disk tier lost an entry (its budget, its directory deleted, corrupt)."""
        self._order.pop(info.key, None)
        self._announce(info, why, count=not corrupt)  # corrupt ones: skipped_corrupt

    def _announce(self, info: ParkedInfo, why: str, count: bool = True) -> None:
        if count:
            self._counts["drops"] += 1
        d = Dropped(info.session, info.key, info.n_tokens, info.tier, why, time.time())
        self.dropped.append(d)
        log.info("parked conversation %s dropped: %s", d, why)
        if self.on_drop is not None:
            try:
                self.on_drop(d)
            except Exception:  # noqa: BLE001 - a listener must not break the lot
                log.exception("parking: on_drop failed")

    # ------------------------------------------------------------------ taking back

    def take(self, key: str) -> ParkedEntry | None:
        """Remove and return the entry ``key`` (``entry.tier`` says where it was).

        For the entry's own session. A disk entry is read and every byte checked first;
        one that fails (truncated, corrupt, edited) is skipped with a warning naming its
        file, deleted, and None is returned: the caller rebuilds.
        """
        return self._fetch(key, take=True)

    def borrow(self, key: str) -> ParkedEntry | None:
        """The entry ``key``, left in the lot: another conversation restores a copy of it."""
        return self._fetch(key, take=False)

    def _fetch(self, key: str, take: bool) -> ParkedEntry | None:
        with self._lock:
            if take:  # one being written: the write is discarded
                entry = self._ram.pop(key, None) or self._writing.pop(key, None)
                self._order.pop(key, None)
            else:  # a copy: the buffers are never written, and are shared
                entry = copy.copy(self._ram.get(key) or self._writing.get(key))
            if entry is not None:
                entry.tier = RAM
            elif self.disk is not None and key in self.disk:
                entry = self.disk.take(key) if take else self.disk.read(key)
                if entry is not None:
                    entry.tier = DISK
            if entry is not None:
                self._counts["restores"] += 1
            return entry

    def drop(self, key: str) -> bool:
        """Forget the entry ``key`` (not counted as a budget drop)."""
        with self._lock:
            self._order.pop(key, None)
            if self._ram.pop(key, None) is not None or self._writing.pop(key, None) is not None:
                return True
            return self.disk is not None and self.disk.delete(key)

    def drop_session(self, session: str) -> int:
        """Forget the entries of ``session``; returns how many."""
        with self._lock:
            keys = [i.key for i in self.entries() if i.session == session]
            return sum(self.drop(k) for k in keys)

    def clear(self) -> int:
        """Forget every entry, in RAM and on disk; returns how many there were."""
        with self._lock:
            n = len(self)
            self._ram.clear()
            self._writing.clear()  # their writes are discarded
            self._order.clear()
            if self.disk is not None:
                self.disk.clear()
            return n

    def spill_all(self) -> int:
        """With a disk tier, write every RAM entry to disk (oldest first); returns how many.

        What the disk budget or the file system refuses is announced as dropped: the RAM
        tier ends with the process (``Engine.close``). One entry that fails, whatever the
        error, never keeps the others from disk.
        """
        with self._lock:
            if self.disk is None:
                return 0
            self.flush()
            moved = 0
            for entry in sorted(self._ram.values(), key=self._lru):
                del self._ram[entry.key]
                moved += self._spill(entry)
            return moved

    def close(self) -> None:
        """Release the disk tier's namespace, for another engine to take over.

        Waits for the writer thread first (:meth:`flush`; ``TimeoutError`` if it is stuck,
        and the namespace stays held), then stops it.
        """
        if self.disk is not None:
            self.flush()
            writer = self._writer
            if writer is not None and writer.is_alive():
                self._queue.put(None, timeout=FLUSH_TIMEOUT)
                writer.join(FLUSH_TIMEOUT)
            self.disk.close()

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict[str, Any]:
        """Parks, restores, spills, drops, corrupt entries skipped, bytes and entries by tier.

        ``writing_bytes``: entries in RAM being written to disk (at most ``SPILL_QUEUE + 1``
        of them), over the RAM budget: a park never waits for the disk.
        """
        with self._lock:
            disk = self.disk
            return {
                **self._counts,
                "skipped_corrupt": disk.skipped if disk is not None else 0,
                "adopted": disk.adopted if disk is not None else 0,
                "disk_gone": disk.gone if disk is not None else None,
                "ram_bytes": self.ram_used,
                "writing": len(self._writing),  # in RAM, being written to disk
                "writing_bytes": sum(e.nbytes for e in self._writing.values()),
                "disk_bytes": disk.used if disk is not None else 0,
                "ram_budget": self.ram_bytes,
                "disk_budget": disk.budget if disk is not None else 0,
                "entries": {RAM: len(self._ram) + len(self._writing),
                            DISK: len(disk) if disk is not None else 0},
            }

    # ------------------------------------------------------------------ saves

    def export(self, blobs: Blobs) -> list[dict[str, Any]]:
        """Every entry as JSON for a save, its buffers added to ``blobs``; oldest first.

        Disk entries are read and checked (one that fails is skipped, as by :meth:`take`).
        """
        with self._lock:
            entries = [*self._ram.values(), *self._writing.values()]
            if self.disk is not None:
                entries += [e for e in (self.disk.read(i.key) for i in self.disk.infos())
                            if e is not None]
            return [entry_json(e, blobs) for e in sorted(entries, key=self._lru)]

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

    def import_(self, entries: Iterable[ParkedEntry], replace: bool = False
                ) -> list[ParkedInfo | None]:
        """Park decoded entries, least recently used first, beside those already parked.

        ``replace`` forgets every entry first. An unnamed entry that one already parked
        holds (unnamed, the same tokens, as far settled) is not parked twice: it takes that
        entry's key. Returns where each went (None: over the budgets, dropped and announced).
        """
        with self._lock:
            if replace:
                self.clear()
            out: list[ParkedInfo | None] = []
            for e in sorted(entries, key=lambda e: e.recency):
                same = None if e.session is not None else next(
                    (i for i in self.entries() if i.session is None and i.tokens == e.tokens
                     and i.settled == e.settled), None)
                if same is not None:
                    e.key = same.key
                    out.append(same)
                    continue
                info = self._park(e, force=True)  # the save's, asked for by name
                self._counts["parks"] += 1
                out.append(info)
            return out


def parking_stats(lot: ParkingLot | None) -> dict[str, Any]:
    """The parking figures of ``%kvcache stats`` (empty without a parking lot)."""
    if lot is None:
        return {}
    s = lot.stats()
    return {"parks": s["parks"], "restores": s["restores"], "spills": s["spills"],
            "parking_drops": s["drops"], "parked_skipped_corrupt": s["skipped_corrupt"],
            "parked_ram_entries": s["entries"][RAM], "parked_disk_entries": s["entries"][DISK],
            "parked_ram_bytes": s["ram_bytes"], "parked_writing_bytes": s["writing_bytes"],
            "parked_disk_bytes": s["disk_bytes"]}
