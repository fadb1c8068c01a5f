"""What saving and restoring need of an engine and of a session store: two small protocols.

:mod:`nbkv.store.persist` is free functions over these, in the manner of mlx-lm's prompt
cache: it never reaches inside an engine. :class:`nbkv.Engine` satisfies
:class:`Persistable`; the notebook's session store satisfies :class:`SessionStoreLike`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from nbkv.core.events import EventBus, Subscriber
from nbkv.kv.slot_table import EngineState, SlotState
from nbkv.kv.spc import SavedPrompt


class Persistable(Protocol):
    """An engine whose slots can be saved and restored: the public state API."""

    @property
    def n_slots(self) -> int:
        """Number of slots."""

    @property
    def kv_streams(self) -> int:
        """The context's KV streams: the slots, and a shadow sequence if any."""

    @property
    def cache(self) -> str:
        """The cache mode (``"imc"``, ``"spc"`` or ``"off"``)."""

    @property
    def exact(self) -> bool:
        """Exactness asked for."""

    n_ctx: int
    template: Any  # nbkv.prompt.templates.ChatTemplate (its ``source`` is hashed)
    model: Any  # nbkv.llama.backend.Model (``n_vocab``)
    memory: Any  # nbkv.kv.slot_kv.MemoryInfo (``kind``)
    projector: Any  # nbkv.media.projector.Projector or None (its embedding cache)
    parking: Any  # nbkv.store.parking.ParkingLot or None
    events: EventBus
    last_save: Any
    last_restore: Any

    def identity(self) -> dict[str, Any]:
        """What a saved or parked state depends on (model, build, n_ctx, KV types...)."""

    def export_state(self, only_if_idle: bool = False) -> EngineState:
        """Every idle slot's proven KV and bookkeeping, and the SPC, as data."""

    def import_state(self, placed: Sequence[tuple[int, SlotState]],
                     spc: Sequence[tuple[str, SavedPrompt]] = (), recompute: bool = False
                     ) -> list[Any]:
        """Replace every slot with ``placed``; all or nothing.

        ``recompute``: each placed slot's KV is then recomputed by a full prefill before
        any request can use it (an untrusted save); one report per slot is returned.
        """

    def export_replies(self, holders: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
        """The replies whose tokens ``holders`` (saved slots, parked entries) hold, as JSON."""

    def import_replies(self, memos: Sequence[Any]) -> None:
        """Remember the replies a save kept (a cell run again after a restore replays)."""

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback`` on each event; returns the unsubscribe function."""


class SavedSession(Protocol):
    """One conversation of a session store, as a save sees it."""

    name: str

    def state_dict(self) -> dict[str, Any]:
        """Its messages and turns as plain data."""

    def load_state(self, d: Mapping[str, Any]) -> None:
        """Replace its messages and turns with ``d``."""


class SessionStoreLike(Protocol):
    """A store of named conversations that saves carry along."""

    def __iter__(self) -> Iterator[Any]:
        """Every session (each a :class:`SavedSession`)."""

    def get(self, name: str | None = None) -> Any:
        """The session called ``name`` (created if new): a :class:`SavedSession`."""

    def check_state(self, name: str, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` would not load into session ``name``."""


#: where saves find the kernel's sessions when none are given (set by the notebook layer)
_default_sessions: Callable[[], Any] | None = None


def use_default_sessions(provider: Callable[[], Any] | None) -> None:
    """Make ``provider()`` the session store saves use when none is given (the notebook's)."""
    global _default_sessions
    _default_sessions = provider


def default_sessions() -> Any:
    """The session store registered by :func:`use_default_sessions`, else none (``()``)."""
    return _default_sessions() if _default_sessions is not None else ()
