"""The in-kernel engine's slots, and the one place their shared state changes under the lock.

A slot's bookkeeping is read by the caller's threads (``Engine.slots()``, the views) while
the scheduler thread changes it, so every change that a snapshot must see whole (the tokens
and the KV, a reply's messages and map, the pending flag) is an :class:`EngineTable` method
that takes the table's lock; the scheduler's parts call those methods and never take the
lock themselves.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbkv.core.events import Segment
from nbkv.kv.invariance import PrefillRule
from nbkv.kv.slot_kv import KVSnapshot, SlotKV, trim_valid
from nbkv.kv.slot_table import SlotInfo, SlotState, SlotTable, TableSlot
from nbkv.prompt.builder import Prompt


class SlotPhase(enum.Enum):
    """Where a slot is between requests, or that it serves one (``EngineSlot.phase``)."""

    EMPTY = "empty"  # holds nothing
    SERVING = "serving"  # a request is placed in it (its own state: nbkv.engine.jobs)
    REWRITING = "rewriting"  # its last reply cut back, chunks of it still to prefill (redo)
    UNSETTLED = "unsettled"  # ends with token-by-token decodes (exact mode rewrites them)
    SETTLED = "settled"  # idle, its KV as a canonical prefill computes it


#: the phases in which a slot's last reply is (being) rewritten in exact mode
TO_REWRITE = frozenset({SlotPhase.REWRITING, SlotPhase.UNSETTLED})
#: checkpointed (hybrid, recurrent) memory: a checkpoint this many positions before the end of
#: a rewritten reply, so that a reply whose last word re-tokenizes differently still reuses the rest
REPLY_TAIL = 4


@dataclass
class EngineSlot(TableSlot):
    """A slot of the in-kernel engine: its KV (the one owner of tokens == KV) and rewrite."""

    kv: SlotKV = None  # type: ignore[assignment]
    redo: list[Any] = field(default_factory=list)  # positions being rewritten (settling)
    rewrite_n: int = 0  # positions the current rewrite covers
    rewrite_s: float = 0.0  # the time the current rewrite has taken so far
    #: the prompt and reply of its last request: where its next turn resumes (parking)
    last_turn: tuple[Any, str] | None = None
    #: a snapshot of its KV taken in idle time, and the KV version it shows: parking the
    #: slot then costs no copy (nbkv.engine.slot_parking.prepark)
    preparked: tuple[int, KVSnapshot | None] | None = None
    rewrite_mixed: int = 0  # positions of the rewrite done while the reply was generated
    t_replied: float = 0.0  # when its last reply ended (time.perf_counter)
    reply_rows: int = 0  # positions that rewriting its last reply's KV takes

    @property
    def phase(self) -> SlotPhase:
        """Its phase, read from what it holds (``pending``, ``redo`` and its KV)."""
        if self.pending:
            return SlotPhase.SERVING
        if self.redo:
            return SlotPhase.REWRITING
        if not self.kv.tokens:
            return SlotPhase.EMPTY
        return SlotPhase.UNSETTLED if self.kv.needs_rewrite else SlotPhase.SETTLED

    @property
    def seq_id(self) -> int:
        """The llama.cpp sequence of this slot."""
        return self.kv.seq_id

    @property
    def tokens(self) -> list[Any]:
        """What the KV holds, one unit per position."""
        return self.kv.tokens

    def snapshot(self) -> SlotInfo:
        """An immutable copy for the caller's thread."""
        kv = self.kv  # a reply being rewritten is still this slot's (see nbkv.engine.rewrite)
        return SlotInfo(
            self.index, kv.seq_id, self.capacity,
            self.conversation((*kv.tokens, *self.redo), kv.settled, kv.checkpoints.positions),
            self.pending, kv.checkpoints.nbytes, kv.memory.kind, len(self.redo),
            cut_floor=kv.cut_floor,
        )

    def reset(self) -> None:
        """Forget everything (the KV too)."""
        self.kv.clear()
        self.redo.clear()
        self.last_turn = None
        self.preparked = None
        self.forget_messages()


class EngineTable(SlotTable[EngineSlot]):
    """The engine's slot table: the changes to its slots that take the lock (see above)."""

    def serve(self, slot: EngineSlot, on: bool) -> None:
        """``slot`` serves a request (``on``), or no longer does."""
        with self.lock:
            slot.pending = on

    def show(self, slot: EngineSlot, segments: Sequence[Segment]) -> None:
        """``slot``'s KV map is ``segments`` now."""
        with self.lock:
            slot.segments = tuple(segments)

    def release(self, slot: EngineSlot, segments: Sequence[Segment]) -> None:
        """``slot``'s request ended with ``segments`` as its map; the slot is free."""
        with self.lock:
            slot.segments = tuple(segments)
            slot.pending = False

    def reset(self, slot: EngineSlot) -> None:
        """Empty ``slot``: its KV and its bookkeeping."""
        with self.lock:
            slot.reset()

    def replied(self, slot: EngineSlot, prompt: Prompt, reply: str, n: int,
                segments: Sequence[Segment] = (), t_replied: float = 0.0,
                reply_rows: int = 0) -> None:
        """``slot``'s request ended: it holds ``n`` positions of ``prompt`` and ``reply``.

        Its messages, its last turn (where the next one resumes), its map, when the reply
        ended and how many positions rewriting it takes; the slot is free.
        """
        with self.lock:
            super().replied(slot, prompt, reply, n)
            slot.last_turn = (prompt, reply)
            slot.segments = tuple(segments)
            slot.pending = False
            slot.t_replied = t_replied
            slot.reply_rows = reply_rows

    def put_back(self, slot: EngineSlot, state: SlotState) -> None:
        """Give ``slot`` back the bookkeeping it had (``state``: a failed restore's backup)."""
        with self.lock:
            slot.session, slot.hashes, slot.msg_ends = (state.session, list(state.hashes),
                                                         list(state.msg_ends))
            slot.segments, slot.last_used, slot.last_request = (state.segments,
                                                                state.last_used,
                                                                state.last_request)
            slot.used_at = state.used_at

    # ------------------------------------------------------------- the rewrite

    def drop_rewrite(self, slot: EngineSlot) -> None:
        """Forget the part of ``slot``'s reply still to rewrite (its KV is cut already)."""
        with self.lock:
            slot.redo.clear()

    def begin_rewrite(self, slot: EngineSlot, rule: PrefillRule) -> bool:
        """Cut ``slot`` back to where a canonical prefill of its settled prefix may begin.

        What is cut becomes its rewrite (``redo``); False (and nothing to rewrite) if that
        would re-read an image: the next request rebuilds it.
        """
        kv = slot.kv
        tokens = list(kv.tokens)
        with self.lock:
            kept = trim_valid(kv, tokens, kv.settled, rule)
            slot.redo = tokens[kept:]
            if not all(isinstance(t, int) for t in slot.redo):
                slot.redo = []
                return False
        return True

    def rewrote(self, slot: EngineSlot, tokens: Sequence[Any], settled: int) -> None:
        """The next ``tokens`` of ``slot``'s rewrite are in its KV (``settled``: see extend)."""
        with self.lock:
            slot.kv.extend(list(tokens), settled=settled)
            del slot.redo[:len(tokens)]

    def cut_back(self, slot: EngineSlot, rule: PrefillRule, at: int | None = None) -> None:
        """Abandon ``slot``'s rewrite: its KV back to ``at``, or (None) its proven prefix."""
        kv = slot.kv
        with self.lock:
            slot.redo.clear()
            if at is not None:
                kv.trim_to(at)
            else:
                trim_valid(kv, list(kv.tokens), kv.settled, rule)

    def take_over(self, slot: EngineSlot, kv: SlotKV, units: Sequence[Any], start: int,
                  seconds: float, mixed: int) -> None:
        """``kv`` (the shadow) swaps in as ``slot``'s KV; what it lacks of ``units`` is left.

        That is ``slot``'s rewrite now: it began at ``start`` and took ``seconds``, ``mixed``
        rows of it while the reply was generated.
        """
        with self.lock:
            slot.kv.swap(kv)
            slot.redo = list(units[len(slot.kv):])
            slot.rewrite_n = len(units) - start
            slot.rewrite_s = seconds
            slot.rewrite_mixed = mixed


def servable(exact: bool, kv: SlotKV) -> int:
    """Leading positions of ``kv`` a request may keep: its settled KV in ``exact`` mode."""
    return kv.settled if exact else len(kv)
