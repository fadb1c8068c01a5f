"""The engine interface that magics, sessions and widgets rely on.

:class:`nbkv.Engine` and the remote engines of :mod:`nbkv.remote.connect` (``nbkv.connect``)
satisfy it, so callers type against :class:`EngineLike` rather than the ``Engine`` class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, overload, runtime_checkable

from nbkv.core.events import RequestRecord, Subscriber
from nbkv.core.streams import ChatResult, ChatStream


@runtime_checkable
class EngineLike(Protocol):
    """The public API shared by the in-kernel engine and remote engines."""

    @property
    def n_slots(self) -> int:
        """Number of slots (the server's total for a remote engine)."""

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: Literal[False] = False, overflow: str | None = None,
             timeout: float | None = None, **sampling: Any) -> ChatResult: ...

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: Literal[True], overflow: str | None = None,
             timeout: float | None = None, **sampling: Any) -> ChatStream: ...

    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: bool = False, overflow: str | None = None,
             timeout: float | None = None, **sampling: Any) -> ChatResult | ChatStream:
        """Reply to a conversation (a stream of its text with ``stream=True``)."""

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

    def clear(self, slot: int | None = None) -> str | None:
        """Empty one slot, or all; may say what it emptied."""

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
class ServerCacheRows(Protocol):
    """A remote engine that maps its conversations onto the server's cache (the KV map)."""

    def cache_rows(self) -> tuple[Any, ...]:
        """Per session, what its latest request left in the server's cache (``SlotInfo``)."""


@runtime_checkable
class Verifiable(Protocol):
    """An engine whose KV can be read back and recomputed (the in-kernel one)."""

    def verify(self, slot: int | None = None, *, request: int | None = None,
               probe: int = 42) -> list[Any]:
        """Recompute slots from scratch and compare."""

    def probe(self, slot: int, token: int) -> list[float]:
        """Logits of ``token`` appended to ``slot``'s tokens."""

    @property
    def model(self) -> Any:
        """The loaded model (``exactness``: what its calibration proved, in words)."""


@runtime_checkable
class Parks(Protocol):
    """An engine that parks conversations that lose their slot (RAM, disk)."""

    def parked(self) -> tuple[Any, ...]:
        """The parked conversations, most recently used first."""

    def park(self, session: str | None = None, all: bool = False) -> str:  # noqa: A002
        """Park a session's slot now."""

    def unpark(self, session: str | None = None, all: bool = False) -> str:  # noqa: A002
        """Bring parked conversations back into slots now."""

    def clear_parked(self) -> str:
        """Forget every parked conversation (RAM and disk); the slots stay as they are."""


@runtime_checkable
class ClearsParked(Parks, Protocol):
    """An engine that parks and can empty slots and its parked conversations in one call."""

    def clear(self, slot: int | None = None, *, parked: bool = False) -> str:
        """Empty one slot, or all (``parked``: and forget the parked conversations)."""


@runtime_checkable
class Saves(Protocol):
    """An engine whose cache ``%kvcache save`` / ``restore`` can write and read back."""

    def save(self, path: str | None = None, sessions: Any = None) -> Any:
        """Save the slots and caches (and ``sessions``) under ``path``."""

    def restore(self, path: str | None = None, sessions: Any = None, *,
                trust: bool = False) -> Any:
        """Bring a save back (``trust``: one this machine did not sign)."""


@runtime_checkable
class Exportable(Protocol):
    """An engine with the public state API (saves, restores and autosave use it)."""

    def export_state(self, only_if_idle: bool = False) -> Any:
        """Every idle slot's proven KV and bookkeeping, as data."""

    def import_state(self, placed: Sequence[tuple[int, Any]], spc: Sequence[Any] = (),
                     recompute: bool = False) -> Any:
        """Replace every slot with ``placed``; all or nothing."""
