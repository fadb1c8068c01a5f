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

    def clear(self, slot: int | None = None) -> str | None:
        """Empty one slot, or all; may say what it emptied."""

    def close(self) -> None:
        """Release the engine."""
