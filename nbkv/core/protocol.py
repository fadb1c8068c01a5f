"""The engine interface that magics, sessions and widgets rely on.

:class:`nbkv.Engine` and the remote engines of :mod:`nbkv.remote.connect` (``nbkv.connect``)
satisfy it, so callers type against :class:`EngineLike` rather than the ``Engine`` class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from nbkv.core.events import RequestRecord, Subscriber


@runtime_checkable
class EngineLike(Protocol):
    """The public API shared by the in-kernel engine and remote engines."""

    @property
    def n_slots(self) -> int:
        """Number of slots (the server's total for a remote engine)."""

    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: bool = False, **sampling: Any) -> Any:
        """Reply to a conversation."""

    def chat_many(self, conversations: Sequence[Sequence[Mapping[str, Any]]],
                  sessions: Sequence[str | None] | None = None, *,
                  stream: bool = False, **sampling: Any) -> list[Any]:
        """Reply to several conversations at once."""

    async def achat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None,
                    *, stream: bool = False, **sampling: Any) -> Any:
        """``chat`` for asyncio."""

    def slots(self) -> tuple[Any, ...]:
        """A snapshot of every slot."""

    def stats(self) -> dict[str, Any]:
        """Aggregate figures."""

    @property
    def history(self) -> list[RequestRecord]:
        """Every request record so far."""

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` on each event; returns the unsubscribe function."""

    def explain(self, request: int | None = None) -> Any:
        """Why request ``request`` (default: the latest) reused what it did."""

    def clear(self, slot: int | None = None) -> None:
        """Empty one slot, or all."""

    def close(self) -> None:
        """Release the engine."""


# What only some engines can do, said as protocols (``isinstance(engine, Verifiable)``)
# rather than by probing for attribute names.


@runtime_checkable
class ServerBacked(Protocol):
    """A remote engine: a serving engine (llama-server, vLLM, ...) holds its KV."""

    kind: str
    model_name: str
    url: str

    def describe(self) -> list[tuple[str, str]]:
        """The server, its model and settings, as (label, value) rows."""


@runtime_checkable
class Verifiable(Protocol):
    """An engine whose KV can be read back and recomputed (the in-kernel one)."""

    def verify(self, slot: int | None = None, *, request: int | None = None,
               probe: int = 42) -> list[Any]:
        """Recompute slots from scratch and compare."""

    def probe(self, slot: int, token: int) -> list[float]:
        """Logits of ``token`` appended to ``slot``'s tokens."""


@runtime_checkable
class Parks(Protocol):
    """An engine that parks conversations that lose their slot (RAM, disk)."""

    def parked(self) -> tuple[Any, ...]:
        """The parked conversations, most recently used first."""

    def park(self, session: str | None = None, all: bool = False) -> str:  # noqa: A002
        """Park a session's slot now."""

    def unpark(self, session: str | None = None, all: bool = False) -> str:  # noqa: A002
        """Bring parked conversations back into slots now."""


@runtime_checkable
class Exportable(Protocol):
    """An engine with the public state API (saves, restores and autosave use it)."""

    def export_state(self, only_if_idle: bool = False) -> Any:
        """Every idle slot's proven KV and bookkeeping, as data."""

    def import_state(self, placed: Sequence[tuple[int, Any]], spc: Sequence[Any] = (),
                     recompute: bool = False) -> Any:
        """Replace every slot with ``placed``; all or nothing."""
