"""What nbkv reads of a llama-server between requests: its slots, and whether it restarted.

``/slots`` gives each slot's token count (``n_prompt_tokens``) and the id of the last task
that ran on it (``id_task``; ids count up from the server's start, every request and every
``/slots`` read taking one). A slot that has never served a task has neither field: on a
slot nbkv filled, that is a restarted server. Task ids tell another client's use apart
from nbkv's own: after each of its requests nbkv notes the task id the slot shows, and a
different one later means someone else ran a task there (or, lower, that the server
restarted). A launcher that states its start time in ``/props`` (:mod:`nbkv.remote.facts`)
names the restart; otherwise ``/metrics`` does, when the server has ``--metrics``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbkv.core.errors import EngineClosedError, ServerError, ServerUnsupportedError
from nbkv.remote.facts import ServerFacts
from nbkv.remote.http_client import ServerClient

log = logging.getLogger("nbkv.remote.connect")


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
