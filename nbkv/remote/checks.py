"""What a llama-server engine checks of the server: its slots, other clients, restarts.

A mixin of :class:`~nbkv.remote.llama_server.LlamaServerEngine` (the engine owns the slot
table; :class:`~nbkv.remote.watch.ServerWatch` reads the server): at connect, slots the
server already fills are not trusted; every second, and before and after each request in
exact mode, ``/slots`` is compared with the table; a restart empties it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from nbkv.core.events import EventBus, SlotsChanged
from nbkv.kv import reasons
from nbkv.kv.slot_table import SlotTable
from nbkv.remote.server_slot import DRAIN_S, ServerSlot
from nbkv.remote.steering import Ledger
from nbkv.remote.watch import ServerWatch, SlotView

log = logging.getLogger("nbkv.remote.connect")


class ServerChecks:
    """``poll``, the check before a request, restarts: the table against ``/slots``."""

    table: SlotTable[ServerSlot]
    watch: ServerWatch
    ledger: Ledger
    events: EventBus
    _cv: threading.Condition
    _last_poll: float
    restart_note: str
    #: slots where the server may still compute an answer nbkv closed (exact mode)
    draining: set[int]

    def _adopt(self) -> None:
        """At connect: slots the server already fills hold what nbkv does not know."""
        seen = self.watch.read() or {}
        with self._cv:
            for s in self.table.slots:
                v = seen.get(s.index)
                if v is None:
                    continue
                s.server_tokens = v.n_tokens
                if v.task is not None:
                    self.watch.tasks[s.index] = v.task
                if v.n_tokens:
                    s.known, s.verified = False, False
                    s.note = (f"holds {v.n_tokens} tokens from before nbkv connected; "
                              f"the next request here re-verifies it")

    def poll(self) -> bool:
        """Read ``/slots`` now: mark slots whose server content differs from the table.

        Returns True when a slot's state changed. Called by the poller thread at most every
        ``POLL_INTERVAL`` seconds, and after each request. Notices a restarted server
        (:meth:`nbkv.remote.watch.ServerWatch.restart`) and another client's task on a slot.
        """
        with self._cv:
            versions = [s.version for s in self.table.slots]
        seen = self.watch.read()
        if seen is None:
            return False
        self._last_poll = time.monotonic()
        changed = self._restarted(seen)
        with self._cv:
            stale = {s.index for s in self.table.slots if s.version != versions[s.index]}
            for i, v in seen.items():
                if not 0 <= i < len(self.table.slots) or i in stale:
                    continue  # a request came or went while the answer was on its way
                s = self.table.slots[i]
                s.server_tokens = v.n_tokens
                if s.pending or not s.known or s.rewriting:
                    continue  # (nbkv's own tasks run there now)
                note = self._differs(s, v)
                if note and (s.verified or s.note != note):
                    s.verified, s.note, changed = False, note, True
        if changed:
            self.events.publish(SlotsChanged("server"))
        return changed

    def _differs(self, s: ServerSlot, v: SlotView) -> str:
        """Why the server's view of slot ``s`` contradicts nbkv's, or ``""`` (lock held)."""
        if v.processing:
            return "another client is using this slot"
        task = (f" (another client ran task #{v.task} there since nbkv's last request)"
                if self.watch.foreign(v) else "")
        if v.n_tokens is None and s.held and s.index not in self.watch.loaded:
            return (f"the server does not say what slot {s.index} holds, where nbkv expects "
                    f"{len(s.held)} tokens{task}")
        if v.n_tokens is not None and v.n_tokens != len(s.held):
            return (f"the server holds {v.n_tokens} tokens where nbkv expects {len(s.held)}: "
                    f"another client or the server changed it{task}")
        if task:
            return (f"another client ran task #{v.task} on this slot since nbkv's last "
                    f"request: its content is not what nbkv put there")
        return ""

    def _restarted(self, seen: Mapping[int, SlotView]) -> bool:
        """If the server restarted, forget what its slots and cache held; True if it did."""
        with self._cv:
            expect = {s.index: len(s.held) for s in self.table.slots if s.known}
        note = self.watch.restart(seen, expect)
        if note is None:
            return False
        log.warning("%s", note)
        self.restart_note = note.split(" (")[0]
        with self._cv:
            # (a slot whose last request failed in the restart keeps its session, no tokens)
            lost = [s.session for s in self.table.slots if s.session and (s.held or s.failed)]
            for s in self.table.slots:
                if s.pending:
                    continue
                s.forget()
                s.known, s.verified, s.note = True, True, note
            self.table.carry_over(x for x in lost if x is not None)
            for name in lost:  # their next turn: the cache started empty again
                if name is not None:
                    self.table.whereabouts[name] = reasons.Whereabouts(
                        0, reasons.RELOADED)
        self.ledger.forget()
        self.events.publish(SlotsChanged("server restarted"))
        return True

    def drain(self, deadline: float) -> bool:
        """Wait (until ``deadline``) for the server to let go of the answers nbkv closed.

        llama-server stops an answer whose connection closed only when it next writes to it,
        a token later or, on a loaded machine, many seconds later (its whole ``n_predict``:
        measured); meanwhile it computes that answer beside the next request, in one batch,
        which no calibration covers. So in exact mode neither a request nor a rewrite runs
        until the slot is idle (at most :data:`DRAIN_S`). True when none is left.
        """
        deadline = min(deadline, time.monotonic() + DRAIN_S)
        while True:
            with self._cv:
                pending = set(self.draining)
            if not pending:
                return True
            seen = self.watch.read()
            if seen is None:  # no /slots: the request's own checks decide
                return False
            with self._cv:
                for i in pending:
                    v = seen.get(i)
                    if v is None or not v.processing:
                        self.draining.discard(i)
                if not self.draining:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _look(self, slot: ServerSlot) -> tuple[dict[int, SlotView], str]:
        """Read ``/slots`` before a request (exact mode): a restart, another client's use.

        Returns what it saw and a note when another client used the pinned slot (its
        content is then unknown, and the request rebuilds it).
        """
        seen = self.watch.read()
        if seen is None:
            return {}, ""
        self._restarted(seen)
        v = seen.get(slot.index)
        note = ""
        with self._cv:
            if v is not None and slot.known:
                note = self._differs(slot, v)
                if note:
                    slot.forget(note)
                    slot.verified = False
        return seen, note
