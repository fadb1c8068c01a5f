"""What the control calls are given: the scheduler's parts they use, as narrow protocols.

The control calls (:mod:`nbkv.engine.state`, :mod:`nbkv.engine.verify`,
:mod:`nbkv.engine.recompute`, and :func:`nbkv.engine.prefill.extension_logits`; the
engine's own in :mod:`nbkv.engine.calls`) run on the scheduler thread between decode steps.
They take the scheduler through these protocols, so that no module but the facade (which
composes it) imports :mod:`nbkv.engine.scheduler`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.proving import BackgroundProof
    from nbkv.engine.rewrite import Pace, Rewriter
    from nbkv.engine.slot_parking import Parker
    from nbkv.engine.slots import EngineTable
    from nbkv.kv.replies import ReplyBook
    from nbkv.kv.spc import SystemPromptStore
    from nbkv.store.parking import ParkingLot

T = TypeVar("T")


class Runs(Protocol):
    """What a prompt run outside a request uses: the native resources and serve settings."""

    @property
    def res(self) -> Resources:
        """The model, context, batch and prefill rule."""

    @property
    def settings(self) -> EngineSettings:
        """How requests are served (cache mode, exact, ...)."""


class Controls(Runs, Protocol):
    """What the control calls use of the scheduler: its slots, caches and thread."""

    @property
    def table(self) -> EngineTable:
        """The slots."""

    @property
    def spc(self) -> SystemPromptStore:
        """The system prompts' saved states."""

    @property
    def parking(self) -> ParkingLot | None:
        """Conversations that lost their slot (None: parking off)."""

    @property
    def images(self) -> OrderedDict[str, Any]:
        """Pictures of recent prompts by hash."""

    @property
    def active(self) -> Sequence[Job]:
        """The requests placed in slots."""

    @property
    def parker(self) -> Parker:
        """Parks slots' conversations and restores parked ones."""

    @property
    def rewriter(self) -> Rewriter:
        """Finished replies' KV rewritten as canonical prefills."""

    @property
    def proof(self) -> BackgroundProof | None:
        """The exactness proof running in the background, if any."""

    def busy(self) -> bool:
        """Requests queued or running, or a reply's KV still to rewrite."""

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between decode steps; return its result."""


class Composed(Controls, Protocol):
    """The scheduler as the engine's control calls see it: the parts they reach as well."""

    @property
    def pace(self) -> Pace:
        """How fast rows prefill, and whether requests come back to back."""

    @property
    def parker(self) -> Parker:
        """Parks slots' conversations, restores parked ones."""

    @property
    def replies(self) -> ReplyBook:
        """Replies a re-run of the same prompt and settings may be answered with."""
