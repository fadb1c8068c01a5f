"""One engine's core: the parts every piece of it shares, built once by the facade.

The :class:`~nbkv.engine.facade.Engine` builds one :class:`EngineCore` and hands it to the
scheduler and to the control calls (:mod:`nbkv.engine.state`, :mod:`nbkv.engine.verify`,
:mod:`nbkv.engine.recompute`, :mod:`nbkv.engine.prefill` and :mod:`nbkv.engine.calls`): they
read its fields, and none of them imports the scheduler. The requests, and the calls
waiting for the scheduler thread, are kept here under the table's lock; only the scheduler
thread changes the requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from nbkv.core.errors import EngineClosedError
from nbkv.engine.decoder import Replays
from nbkv.engine.rewrite import Rewriter
from nbkv.engine.slot_parking import Parker

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import EventBus
    from nbkv.engine.jobs import Job
    from nbkv.engine.native import Resources
    from nbkv.engine.proving import BackgroundProof
    from nbkv.engine.slots import EngineTable
    from nbkv.kv.spc import SystemPromptStore
    from nbkv.prompt.builder import PromptBuilder
    from nbkv.store.parking import ParkingLot

T = TypeVar("T")


@dataclass(eq=False)
class EngineCore:
    """The resources, settings, slots, caches and requests of one engine, and its thread's door.

    ``replays``, ``parker`` and ``rewriter`` are built from the other fields. ``queue`` and
    ``active`` (the requests waiting for a slot, and those placed in one), ``control`` (the
    calls waiting for the scheduler thread) and ``closed`` are guarded by ``table.lock``.
    """

    res: Resources
    settings: EngineSettings
    table: EngineTable
    events: EventBus
    spc: SystemPromptStore  # the system prompts' saved states
    parking: ParkingLot | None  # conversations that lost their slot (None: parking off)
    prompts: PromptBuilder | None = None  # turns a parked conversation's turn into a prompt
    #: pictures of recent prompts by hash (verify() re-decodes them from scratch)
    images: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    #: the exactness proof running in the background, if any (nbkv.engine.proving)
    proof: BackgroundProof | None = None
    queue: list[Job] = field(default_factory=list)
    active: list[Job] = field(default_factory=list)
    control: list[tuple[Callable[[], Any], Future[Any]]] = field(default_factory=list)
    closed: bool = False
    #: replies a re-run of the same prompt and settings may be answered with
    replays: Replays = field(init=False)
    #: parks slots' conversations, restores parked ones
    parker: Parker = field(init=False)
    #: finished replies' KV rewritten as canonical prefills, and the engine's pace
    rewriter: Rewriter = field(init=False)

    def __post_init__(self) -> None:
        self.replays = Replays(self.res, self.settings, self.table, self.events)
        self.parker = Parker(self.res, self.settings, self.table, self.parking, self.prompts,
                             self.replays)
        self.rewriter = Rewriter(self.res, self.settings, self.table, self.events)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between decode steps; return its result."""
        fut: Future[T] = Future()
        with self.table.lock:
            if self.closed:
                raise EngineClosedError("this engine is closed")
            self.control.append((fn, fut))
            self.table.lock.notify_all()
        return fut.result()

    def busy(self) -> bool:
        """Requests queued or running, or a reply's KV still to rewrite (scheduler thread)."""
        return bool(self.queue or self.active or self.rewriter.settling_slot() is not None)
