"""One llama-server slot as nbkv knows it, and what the engine's helpers use of the engine.

:class:`ServerSlot` is the slot table's entry for a server slot (the server checks of
:mod:`nbkv.remote.checks` read it); :class:`ServerEngine` is the narrow view of
:class:`~nbkv.remote.llama_server.LlamaServerEngine` that :mod:`nbkv.remote.exchange` and
:mod:`nbkv.remote.settle` take, so that they sit below the engine instead of importing it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from nbkv.kv.slot_table import SlotInfo, SlotTable, TableSlot

if TYPE_CHECKING:
    from nbkv.core.events import EventBus
    from nbkv.kv.invariance import PrefillRule
    from nbkv.remote.base import RemoteJob
    from nbkv.remote.facts import ServerFacts
    from nbkv.remote.http_client import ServerClient
    from nbkv.remote.steering import Ledger
    from nbkv.remote.watch import ServerWatch, SlotView

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
    server_tokens: int | None = None  # n_prompt_tokens at the last /slots poll
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


class ServerEngine(Protocol):
    """What one request's exchange and the idle-time rewrite use of the engine."""

    table: SlotTable[ServerSlot]
    watch: ServerWatch
    events: EventBus
    _cv: threading.Condition
    draining: set[int]
    restart_note: str
    client: ServerClient
    url: str
    closed: bool
    facts: ServerFacts
    ledger: Ledger
    rule: PrefillRule | None
    why_not_exact: str
    _turn: threading.Lock

    @property
    def has_slots_endpoint(self) -> bool:
        """The server answers ``/slots``."""

    def drain(self, deadline: float) -> bool:
        """Wait for the server to let go of the answers nbkv closed; True when none is left."""

    def _restarted(self, seen: Mapping[int, SlotView]) -> bool:
        """If the server restarted, forget what its slots held; True if it did."""

    def waiting(self) -> bool:
        """A request is waiting for its turn on the server (exact mode)."""

    def offer_states(self, target: ServerSlot, sent: Sequence[int]) -> None:
        """A task with ``sent`` starts on ``target``: note what the server may cache now."""

    def proven(self, sent: Sequence[int], told: int, held: Sequence[int]) -> int | None:
        """Rows of a server restore proven canonical (None: no restore can explain them)."""

    def steer_slot(self, slot: ServerSlot, sent: list[int], fresh: bool,
                   session: str | None) -> int:
        """Send one steering request; its ``cache_n``."""

    def _events(self, job: RemoteJob, path: str, body: dict[str, Any]
                ) -> Iterator[dict[str, Any]]:
        """The answer's events until the request is cancelled."""

    def _delta(self, job: RemoteJob, text: str) -> None:
        """A piece of the reply's text arrived."""
