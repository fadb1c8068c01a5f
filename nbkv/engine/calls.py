"""The engine's control calls: what changes or reads the caches between decode steps.

Parking by hand, clearing, the probe, the rewrite of finished replies on demand, and the
caches as data (a save's and a restore's :mod:`nbkv.engine.state`, the replies a save
keeps). Each runs on the scheduler thread (:meth:`~nbkv.engine.core.EngineCore.call`), over
the engine's :class:`~nbkv.engine.core.EngineCore`: the :class:`~nbkv.engine.facade.Engine`
inherits them from :class:`ControlCalls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nbkv.core import api
from nbkv.core.errors import InvalidRequestError
from nbkv.core.events import SlotsChanged, counted
from nbkv.engine import state as engine_state
from nbkv.engine import verify

if TYPE_CHECKING:
    from nbkv.core.config import EngineSettings
    from nbkv.core.events import EventBus
    from nbkv.engine.core import EngineCore
    from nbkv.engine.slots import EngineTable
    from nbkv.kv.slot_table import EngineState, SlotState
    from nbkv.kv.spc import SavedPrompt, SystemPromptStore
    from nbkv.llama.backend import Model
    from nbkv.store.parking import ParkingLot


class ControlCalls:
    """The engine's control calls, over its core: slots, caches and thread (a mixin)."""

    core: EngineCore
    table: EngineTable
    spc: SystemPromptStore
    parking: ParkingLot | None
    events: EventBus
    model: Model
    settings: EngineSettings

    def park(self, session: str | None = None, all: bool = False) -> str:  # noqa: A002
        """Park ``session``'s slot (or every idle slot with ``all``) now: by hand, to show it."""
        lot = self._parking_lot()
        text = self.core.call(lambda: self.core.parker.park_sessions(lot, session, all))
        self.events.publish(SlotsChanged("parked"))
        return text

    def unpark(self, session: str | None = None, all: bool = False) -> str:  # noqa: A002
        """Bring parked conversations back into slots now (an empty slot, else the LRU's)."""
        lot = self._parking_lot()
        text = self.core.call(lambda: self.core.parker.unpark_sessions(lot, session, all))
        self.events.publish(SlotsChanged("unparked"))
        return text

    def _parking_lot(self) -> ParkingLot:
        if self.parking is None:
            raise InvalidRequestError(f"parking is off for this engine (cache mode "
                                      f"{self.settings.slots.cache!r}, or park_ram=0 without "
                                      "park_dir)")
        return self.parking

    def clear(self, slot: int | None = None, *, parked: bool = False) -> str:
        """Empty one slot (or every idle one, and the system prompt cache); says what went.

        Parked conversations stay parked unless ``parked`` (then they are forgotten too,
        in RAM and on disk). A busy slot can't be cleared.
        """
        if slot is not None:
            self.table.index(slot)

        def do() -> tuple[list[str], int, int]:
            with self.table.lock:
                targets = self.table.clear_targets(slot)
                gone = [f"{s.session or f'slot {s.index}'} ({len(s.tokens):,} tokens)"
                        for s in targets if s.tokens]
                self.table.cleared(targets)
                for s in targets:
                    s.reset()
            spc = 0
            if slot is None:
                spc = len(self.spc)
                self.spc.clear()
            forgot = self.parking.clear() if parked and self.parking is not None else 0
            return gone, spc, forgot

        gone, spc, forgot = self.core.call(do)
        self.events.publish(SlotsChanged("cleared"))
        what = (f"slot {slot}" if slot is not None else "every idle slot") + (
            f": {', '.join(gone)}" if gone else " (empty)")
        if spc:
            what += f"; {counted(spc, 'system prompt')}"
        kept = len(self.parking) if self.parking is not None else 0
        if parked:
            what += f"; {counted(forgot, 'parked conversation')}"
        elif kept:
            what += (f"; {counted(kept, 'parked conversation')} kept (clear(parked=True) "
                     "forgets them)")
        return "cleared " + what

    def clear_parked(self) -> str:
        """Forget every parked conversation, in RAM and on disk; the slots stay as they are."""
        lot = self._parking_lot()
        n = self.core.call(lot.clear)
        self.events.publish(SlotsChanged("cleared"))
        return f"forgot {counted(n, 'parked conversation')}"

    def probe(self, slot: int, token: int) -> list[float]:
        """Logits the model gives ``token`` appended to ``slot``'s cached tokens (KV unchanged).

        Computed as a request extending the slot would: its settled KV is kept, the rest and
        the probe (twice: never a lone row) are prefilled canonically, then the slot is put
        back as it was. They must equal a from-scratch decode of the slot's tokens plus the
        probe (:func:`nbkv.kv.oracle.scratch_logits`); :meth:`verify` compares them.
        """
        index = self.table.index(slot)
        token = api.token("token", token, self.model.n_vocab)
        return self.core.call(lambda: verify.probe(self.core, index, token))

    def settle(self) -> None:
        """Rewrite every finished reply's KV now instead of in idle time (exact mode).

        Afterwards every idle slot's KV equals a batched prefill of its tokens. The engine
        does this on its own when it has nothing else to do; call it to measure, or before
        reading the KV directly.
        """
        self.core.call(self.core.rewriter.settle_now)

    def export_state(self, only_if_idle: bool = False) -> EngineState:
        """Every idle slot's KV and bookkeeping, and the system prompt cache, as data.

        Finished replies are rewritten first (exact mode), so what is exported is proven KV.
        ``only_if_idle``: raise :class:`~nbkv.engine.state.EngineBusy` instead of waiting
        for requests in flight.
        """
        return self.core.call(lambda: engine_state.export_state(self.core, only_if_idle))

    def import_state(self, placed: Sequence[tuple[int, SlotState]],
                     spc: Sequence[tuple[str, SavedPrompt]] = (), recompute: bool = False
                     ) -> list[Any]:
        """Replace every slot with ``placed`` (slot index, state) and the SPC with ``spc``.

        All or nothing: on failure the slots are as they were and
        :class:`~nbkv.core.errors.RestoreError` says why. ``recompute``: then replace each
        placed slot's KV by a full prefill of its tokens before any request can use it (an
        untrusted save); returns a :class:`~nbkv.engine.recompute.Recomputation` per slot.
        """
        return self.core.call(lambda: engine_state.import_state(self.core, placed, spc,
                                                                recompute))

    def export_replies(self, holders: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
        """The replies ``holders`` still hold, as JSON (what a save keeps).

        ``holders``: the units of the saved slots and parked conversations. A cell run again
        after a restore is then replayed.
        """
        return self.core.call(
            lambda: [m.as_json() for m in self.core.replays.replies.kept_by(holders)])

    def import_replies(self, memos: Sequence[Any]) -> None:
        """Remember replies a save kept (checked :class:`~nbkv.kv.replies.ReplyMemo` s)."""
        self.core.call(lambda: self.core.replays.replies.imported(memos))
