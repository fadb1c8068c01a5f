"""One llama-server slot as nbkv knows it, what ``/slots`` shows of it, and the checks between.

:class:`ServerSlot` is the slot table's entry for a server slot. :class:`ServerWatch` reads
``/slots``: each slot's token count (``n_prompt_tokens``) and the id of the last task that
ran on it (``id_task``; ids count up from the server's start, every request and every
``/slots`` read taking one). A slot that has never served a task has neither field: on a
slot nbkv filled, that is a restarted server. Task ids tell another client's use apart
from nbkv's own: after each of its requests nbkv notes the task id the slot shows, and a
different one later means someone else ran a task there (or, lower, that the server
restarted). A launcher that states its start time in ``/props`` (:mod:`nbkv.remote.facts`)
names the restart; otherwise ``/metrics`` does, when the server has ``--metrics``.

:class:`ServerChecks`, a mixin of :class:`~nbkv.remote.llama_server.LlamaServerEngine` (the
engine owns the slot table), compares the two: at connect, slots the server already fills
are not trusted; every second, and before and after each request in exact mode, ``/slots``
is compared with the table; a restart empties it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbkv.core.errors import EngineClosedError, ServerError, ServerUnsupportedError
from nbkv.core.events import EventBus, SlotsChanged
from nbkv.kv import admission
from nbkv.kv.slot_table import SlotInfo, SlotTable, TableSlot
from nbkv.remote.facts import ServerFacts
from nbkv.remote.http_client import ServerClient
from nbkv.remote.steering import Ledger

log = logging.getLogger("nbkv.remote.connect")

#: the longest a request waits for the server to let go of an answer nbkv closed (then it
#: goes, and its record says whether another task ran beside it)
DRAIN_S = 60.0

#: where a conversation the server parked in its host-memory prompt cache is restored from
SERVER_RAM = "server-ram"


@dataclass
class ServerSlot(TableSlot):
    """What nbkv knows of one server slot: the tokens it expects the server's KV to hold."""

    held: list[int] = field(default_factory=list)
    settled: int = 0  # leading positions of ``held`` whose KV is canonical (exact mode)
    junk: bool = False  # ``held`` ends with a steering request's junk token
    failed: str = ""  # the error that left the slot's content unknown
    rewriting: bool = False  # its reply is being rewritten on the server (nbkv.remote.settle)
    known: bool = True  # False after a failure: the server's content is not known
    verified: bool = True
    note: str = ""
    version: int = 0  # bumped when a request takes or leaves the slot (stale polls skip it)

    @property
    def tokens(self) -> list[int]:
        """The tokens nbkv expects the server's KV to hold (``held``)."""
        return self.held

    def snapshot(self) -> SlotInfo:
        """The slot as the views and the policy read it (``memory="server"``)."""
        return SlotInfo(self.index, self.index, self.capacity,
                        self.conversation(settled=self.settled), self.pending, memory="server",
                        verified=self.verified, note=self.note)

    def hold(self, tokens: Sequence[int], settled: int, *, junk: bool = False) -> None:
        """Hold ``tokens`` now, the first ``settled`` canonical (known again; a new version)."""
        self.held = list(tokens)
        self.settled = min(settled, len(self.held))
        self.junk = junk
        self.known = True
        self.version += 1

    def forget(self, note: str = "") -> None:
        """Hold nothing; a ``note`` says why the server's content is not known any more."""
        self.held = []
        self.settled = 0
        self.junk = False
        self.failed = ""
        self.forget_messages()
        self.known = not note
        self.verified = not note
        self.note = note
        self.version += 1


@dataclass(frozen=True)
class SlotView:
    """One slot as ``/slots`` shows it (``used=False``: no task ran on it since the start)."""

    index: int
    used: bool
    n_tokens: int | None
    task: int | None
    processing: bool


def views(data: Any) -> dict[int, SlotView]:
    """``/slots``'s answer, by slot index."""
    out = {}
    for info in data if isinstance(data, list) else ():
        i = info.get("id") if isinstance(info, Mapping) else None
        if not isinstance(i, int):
            continue
        n, task = info.get("n_prompt_tokens"), info.get("id_task")
        out[i] = SlotView(i, isinstance(task, int), n if isinstance(n, int) else None,
                          task if isinstance(task, int) else None,
                          bool(info.get("is_processing")))
    return out


class ServerWatch:
    """Reads ``/slots`` and the server's start; remembers the last task nbkv saw per slot."""

    def __init__(self, client: ServerClient, facts: ServerFacts, has_metrics: bool) -> None:
        self.client = client
        self.started = facts.started
        self.has_metrics = has_metrics
        self.has_slots = True
        self.tasks: dict[int, int] = {}  # slot -> id_task after nbkv's last request there
        self.loaded: set[int] = set()  # slots filled from a save file: no task ran there yet
        self.raw: list[dict[str, Any]] = []  # the last /slots answer (slot cards show it)

    def read(self) -> dict[int, SlotView] | None:
        """``/slots`` now (None when the server has no such endpoint or does not answer)."""
        if not self.has_slots:
            return None
        try:
            data = self.client.get("/slots", timeout=5.0)
        except ServerUnsupportedError:
            self.has_slots = False
            return None
        except (ServerError, EngineClosedError) as e:  # (closed: the engine closed meanwhile)
            log.debug("/slots read failed: %s", e)
            return None
        self.raw = list(data) if isinstance(data, list) else []
        return views(data)

    def note_own(self, slot: int, view: SlotView | None) -> None:
        """The task ``view`` shows on ``slot`` is nbkv's own (read right after its request)."""
        if view is not None and view.task is not None:
            self.tasks[slot] = view.task
            self.loaded.discard(slot)

    def foreign(self, view: SlotView) -> bool:
        """Another client ran a task on the slot since nbkv's last request there."""
        mine = self.tasks.get(view.index)
        return mine is not None and view.task is not None and view.task > mine

    def restart(self, seen: Mapping[int, SlotView], expect: Mapping[int, int]) -> str | None:
        """A sentence naming a restart since the last look, or None.

        ``expect``: slot -> tokens nbkv believes it holds. Signs: the start time the launcher
        states (or ``/metrics``) changed; a slot nbkv filled shows no task at all; task ids
        went down.
        """
        sign = None
        for i, v in seen.items():
            if expect.get(i) and not v.used and i not in self.loaded:
                sign = f"slot {i} shows no task at all, where nbkv put {expect[i]} tokens"
                break
            mine = self.tasks.get(i)
            if mine is not None and v.task is not None and v.task < mine:
                sign = f"slot {i}'s last task is #{v.task}, before nbkv's #{mine}"
                break
        started = self._started()
        if started is not None and self.started is not None and started != self.started:
            sign = sign or "its start time changed"
        if sign is None:
            return None
        when = started if started is not None else None
        self.started = started if started is not None else self.started
        self.tasks.clear()
        self.loaded.clear()
        at = f" at {time.strftime('%H:%M:%S', time.localtime(when))}" if when else ""
        return f"the server restarted{at} ({sign}): its slots and its --cache-ram are empty"

    def _started(self) -> float | None:
        """The server's start, as its launcher states it, else as ``/metrics`` does."""
        try:
            props = self.client.get("/props", timeout=5.0)
            facts = ServerFacts.from_props(props) if isinstance(props, Mapping) else None
            if facts is not None and facts.started is not None:
                return facts.started
        except ServerError:
            return None
        if not self.has_metrics:
            return None
        try:
            head = self.client.head_of("/metrics", "Process-Start-Time-Unix", timeout=5.0)
            return float(head) if head else None
        except (ServerError, ValueError):
            return None


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
        (:meth:`ServerWatch.restart`) and another client's task on a slot.
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
                    self.table.whereabouts[name] = admission.Whereabouts(
                        0, admission.RELOADED)
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
