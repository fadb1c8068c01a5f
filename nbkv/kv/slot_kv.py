"""The KV layer: the one owner of "a slot's recorded tokens == its KV".

A slot is one llama.cpp sequence. What can be done to a sequence exactly depends on the kind
of memory the model has (:func:`classify`):

- ``plain`` attention: any trim is exact (``seq_rm(n, -1)``).
- ``sliding-window`` (Gemma 3): a trim is exact while the SWA cache still holds the window
  before the cut (checked with ``seq_pos_min``). A live slot keeps every cell (full-size SWA
  cache), but a whole state put back (parked, saved, SPC) holds only the window before its
  end; such a slot goes back further through its *checkpoints*: the SWA layers' window at
  that position.
- ``hybrid`` (LFM2, Granite-H, Qwen3-Next) and ``recurrent`` (Mamba, RWKV): a recurrent
  state cannot be rolled back. The slot keeps *checkpoints*, partial states
  (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) taken at prefill-chunk boundaries, bounded in
  number and bytes (:class:`CheckpointSet`); a trim restores the newest checkpoint at or
  before the target and the caller prefills the gap.

Every operation ends by verifying ``seq_pos_max`` (and ``seq_pos_min`` where it means
something) against the recorded tokens; on any disagreement the slot is cleared: KV that
cannot be proven is never served. ``exact_len`` counts the leading positions whose KV is what
a canonical prefill of the tokens computes (:mod:`nbkv.kv.invariance`), ``settled`` those
that stay exact whatever follows; generated tokens are rewritten later by the engine
(:attr:`SlotKV.needs_rewrite`).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbkv.core.errors import ModelLoadError
from nbkv.kv import invariance
from nbkv.kv.policy import (
    HYBRID,
    MEMORY_CLASSES,
    PLAIN,
    RECURRENT,
    SWA,
    restorable,
    window_floor,
)
from nbkv.llama.backend import Batch, Context, Model

log = logging.getLogger("nbkv")

__all__ = ["HYBRID", "MEMORY_CLASSES", "PLAIN", "RECURRENT", "SWA", "Checkpoint",
           "CheckpointSet", "KVSnapshot", "MemoryInfo", "SlotKV", "classify", "probe_memory",
           "trim_valid"]


@dataclass(frozen=True)
class MemoryInfo:
    """What a model's memory allows, as llama.cpp reports it (never guessed from a name)."""

    kind: str  # one of MEMORY_CLASSES
    n_swa: int = 0
    can_trim: bool = True  # seq_rm(p0 > 0, -1) works (probed on a real sequence at load)

    @property
    def checkpoints(self) -> bool:
        """Trims go through checkpoints (the memory cannot drop a sequence's tail)."""
        return not self.can_trim

    @property
    def takes_checkpoints(self) -> bool:
        """Slots keep checkpoints: every trim needs one, or a restored sliding-window state."""
        return self.checkpoints or self.kind == SWA

    def describe(self) -> str:
        """One line for status tables."""
        extra = {
            PLAIN: "any trim is exact",
            SWA: f"window {self.n_swa}, full-size SWA cache, checkpoints at message boundaries",
            HYBRID: "attention + recurrent layers, checkpoints at message boundaries",
            RECURRENT: "recurrent state, checkpoints at message boundaries",
        }[self.kind]
        return f"{self.kind} ({extra})"


def classify(model: Model) -> str:
    """The model's memory class, from llama.cpp's own flags.

    Raises :class:`ModelLoadError` for models nbkv cannot serve as a chat engine.
    """
    if model.has_encoder or not model.has_decoder:
        raise ModelLoadError(
            f"{model.path.name} is an encoder-decoder or encoder-only model: nbkv serves "
            "decoder-only chat models (its KV cache holds one decoder sequence per slot)"
        )
    if model.is_hybrid:
        return HYBRID
    if model.is_recurrent:
        return RECURRENT
    if model.n_swa > 0:
        return SWA
    return PLAIN


def probe_memory(model: Model, ctx: Context, batch: Batch, seq: int = 0) -> MemoryInfo:
    """Classify the model and check on a real sequence whether its tail can be trimmed.

    As llama-server does at load: decode two tokens, try to remove the second. A model
    classified as attention-only that cannot trim is served with checkpoints, and a
    recurrent one that claims it can is not trusted (its state would be silently wrong).
    """
    kind = classify(model)
    tok = max(model.n_vocab // 2, 1)
    batch.clear()
    batch.add(tok, 0, seq, False)
    batch.add(tok, 1, seq, False)
    ctx.decode(batch)
    can_trim = ctx.try_seq_rm(seq, 1, -1)
    ctx.try_seq_rm(seq, -1, -1)
    if ctx.seq_pos_max(seq) != -1:
        raise ModelLoadError("could not empty a sequence after the load-time memory probe")
    if kind in (HYBRID, RECURRENT):
        can_trim = False
    elif not can_trim:
        log.warning("%s memory cannot trim a sequence's tail: serving it with checkpoints", kind)
    return MemoryInfo(kind, model.n_swa, can_trim)


@dataclass
class Checkpoint:
    """A partial state of a sequence holding its first ``pos`` positions."""

    pos: int
    data: Any  # opaque to this module's pure parts (a ctypes byte array in practice)
    nbytes: int
    used: int = 0  # logical clock of the last use (creation or restore)


@dataclass
class CheckpointSet:
    """A slot's checkpoints, bounded in number and bytes: the newest kept, older ones thinned.

    The positions :meth:`pin` names (where the prompt's messages start: a return to an
    earlier message resumes there) are thinned last, the first of them (the system prompt's
    end) only when nothing else is left. Pure bookkeeping: no llama.cpp here, so the choice
    of checkpoint is tested without one.
    """

    max_entries: int = 8
    items: list[Checkpoint] = field(default_factory=list)  # sorted by pos
    _clock: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    max_bytes: int | None = None  # None: no byte bound
    pinned: frozenset[int] = frozenset()  # message boundaries: thinned last

    @property
    def positions(self) -> tuple[int, ...]:
        """Positions with a checkpoint, ascending."""
        return tuple(c.pos for c in self.items)

    @property
    def nbytes(self) -> int:
        """Memory the checkpoints take."""
        return sum(c.nbytes for c in self.items)

    def add(self, pos: int, data: Any, nbytes: int) -> list[int]:
        """Keep a checkpoint at ``pos`` (replacing one there); returns evicted positions."""
        self.items = [c for c in self.items if c.pos != pos]
        self.items.append(Checkpoint(pos, data, nbytes, next(self._clock)))
        self.items.sort(key=lambda c: c.pos)
        evicted = []
        while self.items and (len(self.items) > self.max_entries or self._over_bytes()):
            # the newest few are where the next turn resumes (the prompt's end, the reply's
            # end and just before it): they stay; of the older ones, the one closest to its
            # predecessor goes (least recently used on ties), so what is left stays spread
            # over the conversation and an edit of an early message still finds one near it
            # (message boundaries last, the first of them never while another is left)
            old = self.items[: max(len(self.items) - self.keep_recent, 1)]
            first = min(self.pinned, default=-1)
            gaps = [(c.pos == first, c.pos in self.pinned, c.pos - (
                self.items[i - 1].pos if i else 0), c.used, i) for i, c in enumerate(old)]
            victim = self.items.pop(min(gaps)[4])
            evicted.append(victim.pos)
        return evicted

    def pin(self, positions: Iterable[int]) -> None:
        """The message boundaries of the prompt being served: thinned last (:meth:`add`)."""
        self.pinned = frozenset(positions)

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and self.nbytes > self.max_bytes

    @property
    def keep_recent(self) -> int:
        """How many of the newest checkpoints are never thinned."""
        return min(4, self.max_entries // 2)

    def at_or_before(self, n: int) -> Checkpoint | None:
        """The newest checkpoint at or before position ``n`` (marked used), or None."""
        best = None
        for c in self.items:
            if c.pos <= n:
                best = c
        if best is not None:
            best.used = next(self._clock)
        return best

    def drop_after(self, n: int) -> None:
        """Forget checkpoints past position ``n`` (their positions are gone)."""
        self.items = [c for c in self.items if c.pos <= n]

    def copy(self) -> CheckpointSet:
        """An independent set sharing the (immutable) checkpoint data."""
        out = CheckpointSet(self.max_entries, _clock=self._clock, max_bytes=self.max_bytes,
                            pinned=self.pinned)
        out.items = [Checkpoint(c.pos, c.data, c.nbytes, c.used) for c in self.items]
        return out

    def clear(self) -> None:
        """Forget every checkpoint."""
        self.items.clear()


@dataclass(frozen=True)
class KVSnapshot:
    """A slot's whole state and bookkeeping, taken by :meth:`SlotKV.snapshot`."""

    state: Any  # the whole sequence state (a ctypes byte array)
    tokens: tuple[Any, ...]
    settled: int
    exact_len: int
    checkpoints: CheckpointSet

    @property
    def nbytes(self) -> int:
        """The state's bytes plus its checkpoints'."""
        return ctypes.sizeof(self.state) + self.checkpoints.nbytes

    @classmethod
    def of(cls, state: Any, tokens: Sequence[Any], settled: int, exact_len: int,
           checkpoints: Sequence[tuple[int, Any]] = ()) -> KVSnapshot:
        """A snapshot from saved parts: a state, its tokens and ``(pos, data)`` checkpoints."""
        cps = CheckpointSet(max(len(checkpoints), 1))
        for pos, data in checkpoints:
            cps.add(pos, data, ctypes.sizeof(data))
        return cls(state, tuple(tokens), settled, exact_len, cps)


class SlotKV:
    """One sequence's KV and the tokens it holds, kept equal by every operation.

    ``tokens`` has one entry per KV position (a token id, or a media unit for image
    positions). Only this class changes the sequence's memory; the scheduler decodes into
    it and then calls :meth:`extend` with what was decoded.
    """

    def __init__(self, ctx: Context, seq_id: int, memory: MemoryInfo,
                 max_checkpoints: int = 8, checkpoint_bytes: int | None = None) -> None:
        self.ctx = ctx
        self.seq_id = seq_id
        self.memory = memory
        self.tokens: list[Any] = []
        self.settled = 0
        self.exact_len = 0
        self.checkpoints = CheckpointSet(max_checkpoints, max_bytes=checkpoint_bytes)
        self.last_restore: int | None = None  # position of the checkpoint the last trim used
        #: the lowest position a trim reaches without a checkpoint (see nbkv.kv.policy);
        #: kept up to date on the scheduler thread, read by slot snapshots
        self.cut_floor = self._empty_floor()
        #: changes whenever the KV, its tokens or its checkpoints do (a snapshot taken at one
        #: version is this slot exactly while the version stays the same)
        self.version = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def needs_rewrite(self) -> bool:
        """Trailing positions were decoded token by token and not yet rewritten."""
        return self.exact_len < len(self.tokens)

    # ------------------------------------------------------------------ operations

    def extend(self, units: Sequence[Any], *, exact: bool = True, settled: int | None = None
               ) -> None:
        """Record ``units`` as decoded at the end of the sequence (after a successful decode).

        ``exact``: decoded as a canonical prefill would (else token by token); ``settled``:
        the new settled length (:func:`nbkv.kv.invariance.stable_end`), when it changes.
        """
        self.version += 1
        if exact and self.exact_len == len(self.tokens):
            self.exact_len += len(units)
        self.tokens.extend(units)
        if settled is not None and exact:
            self.settled = min(settled, self.exact_len)

    def trim_to(self, n: int) -> int:
        """Keep at most the first ``n`` positions; returns how many remain (maybe fewer).

        Plain and sliding-window memory cut at ``n`` exactly (when the window allows);
        checkpointed memory goes back to the newest checkpoint at or before ``n``; with no
        way to cut exactly the slot is emptied.
        """
        self.last_restore = None
        n = max(0, min(n, len(self.tokens)))
        if n == len(self.tokens):
            return n
        return self._cut(n)

    def _cut(self, n: int) -> int:
        """Drop every position from ``n`` on, exactly, or as close below as possible."""
        self.version += 1
        if n == 0:
            self.clear()
            return 0
        if self.memory.can_trim and self._window_holds(n):
            if not self.ctx.try_seq_rm(self.seq_id, n, -1):
                log.warning("seq %d: llama.cpp refused a trim to %d; rebuilding", self.seq_id, n)
                self.clear()
                return 0
            kept = n
        else:
            # sliding-window memory: the window before ``n`` is gone (a restored state), but
            # a checkpoint holds the window before its own position
            cp = self.checkpoints.at_or_before(n) if self.memory.takes_checkpoints else None
            if cp is None:
                log.debug("seq %d: no exact way back to %d tokens; clearing", self.seq_id, n)
                self.clear()
                return 0
            if self.copy_queued and self.memory.can_trim:  # a copy admitted before this cut
                self.run_queued_copy()  # runs first, in order (its throwaway row is cut again)
            self.ctx.state_set(self.seq_id, cp.data, partial=True)
            if not self.ctx.try_seq_rm(self.seq_id, cp.pos, -1):
                self.clear()
                return 0
            kept = self.last_restore = cp.pos
            log.debug("checkpoint-restore: seq %d back to %d (asked %d)", self.seq_id, kept, n)
        del self.tokens[kept:]
        self.checkpoints.drop_after(kept)
        self.settled = min(self.settled, kept)
        self.exact_len = min(self.exact_len, kept)
        if not self.verify():
            log.error("seq %d: KV and tokens disagree after a trim; clearing", self.seq_id)
            self.clear()
            return 0
        return kept

    def copy_from(self, donor: SlotKV, n: int) -> int:
        """Hold the first ``n`` positions of ``donor`` (a whole-sequence copy, then a trim).

        Returns the positions kept. The donor is unchanged.

        With non-unified KV, llama.cpp only *queues* the buffer copy of the attention layers
        and runs it at the start of the next ``llama_decode``: until then the metadata is
        copied but the data is not (:attr:`copy_queued`). Nothing here reads or writes
        attention data in between (a trim edits metadata; a checkpoint restore on hybrid and
        recurrent memory writes only the recurrent state, which is copied at once); the
        caller must not write the donor's state, nor read this one's, before the next decode
        (the scheduler's admission order, :mod:`nbkv.engine.placement`; a request that ends
        before its first decode runs the copy with :meth:`run_queued_copy`). That is why a
        copy of sliding-window memory never goes back to a checkpoint (its checkpoints are
        attention cells): when the copy cannot be cut at ``n`` directly, the slot is emptied
        instead.
        """
        self.clear()
        self.ctx.seq_cp(donor.seq_id, self.seq_id)
        self.tokens = list(donor.tokens)
        self.settled, self.exact_len = donor.settled, donor.exact_len
        bound = self.checkpoints.max_entries, self.checkpoints.max_bytes
        self.checkpoints = donor.checkpoints.copy()
        self.checkpoints.max_entries, self.checkpoints.max_bytes = bound
        self.cut_floor = donor.cut_floor  # a whole-sequence copy: the same cells
        if self.memory.kind == SWA and 0 < n < len(self.tokens) and not self._window_holds(n):
            self.clear()
            return 0
        return self.trim_to(n)

    def swap(self, other: SlotKV) -> None:
        """Exchange sequences with ``other``: each then holds what the other held.

        Nothing is copied: the two objects trade their llama.cpp sequence and its
        bookkeeping (a shadow that rewrote a reply takes the slot's place this way).
        """
        if other.ctx is not self.ctx or other.memory != self.memory:
            raise ValueError("only sequences of one context and memory class can be swapped")
        for name in ("seq_id", "tokens", "settled", "exact_len", "checkpoints", "last_restore"):
            mine = getattr(self, name)
            setattr(self, name, getattr(other, name))
            setattr(other, name, mine)

    @property
    def copy_queued(self) -> bool:
        """A prefix copy from or into this sequence waits for the next decode."""
        return self.ctx.copy_queued(self.seq_id)

    def run_queued_copy(self) -> None:
        """Make llama.cpp run the queued copies now: decode one throwaway position, drop it.

        For a request that ended before its first decode, with a copy into its slot still
        queued (nothing else may decode soon). Memory that can be cut keeps its positions
        (the throwaway one goes after them); other memory is emptied first.
        """
        if not self.ctx.queued_copies:
            return
        if not self.memory.can_trim:
            self.clear()
        n = len(self.tokens)
        batch = Batch(1)
        try:
            batch.add(int(self.tokens[-1]) if n and isinstance(self.tokens[-1], int) else 0,
                      n, self.seq_id, False)
            self.ctx.decode(batch)
        finally:
            batch.close()
            if not self.ctx.try_seq_rm(self.seq_id, n, -1) or not self.verify():
                self.clear()

    def checkpoint(self) -> bool:
        """Save a checkpoint at the current end, where the memory needs them.

        Sliding-window memory only where its window puts back exactly (:func:`restorable`).
        """
        if not self.memory.takes_checkpoints or not self.tokens:
            return False
        n = len(self.tokens)
        if not self.restorable(n):
            return False
        if self.checkpoints.positions and self.checkpoints.positions[-1] == n:
            return False
        data = self.ctx.state_get(self.seq_id, partial=True)
        self.version += 1
        for pos in self.checkpoints.add(n, data, ctypes.sizeof(data)):
            log.debug("seq %d: checkpoint at %d evicted", self.seq_id, pos)
        return True

    def save_state(self) -> Any:
        """The whole state, for :meth:`load_state` into another (empty) slot."""
        return self.ctx.state_get(self.seq_id)

    def restorable(self, n: int) -> bool:
        """A state of this slot's first ``n`` positions continues exactly once put back."""
        return restorable(self.memory.kind, self.memory.n_swa, n)

    def load_state(self, state: Any, tokens: Sequence[Any]) -> None:
        """Replace the slot with a whole state saved by :meth:`save_state` holding ``tokens``.

        A sliding-window state that would not continue exactly (:meth:`restorable`) is
        not put back: the slot stays empty.
        """
        self.clear()
        if not self.restorable(len(tokens)):
            return
        self.ctx.state_set(self.seq_id, state)
        self.tokens = list(tokens)
        self.settled = self.exact_len = len(self.tokens)
        if not self.verify():
            self.clear()
            return
        self.checkpoint()

    def snapshot(self) -> KVSnapshot:
        """Everything needed to put this slot back exactly as it is (:meth:`put_back`)."""
        return KVSnapshot(self.ctx.state_get(self.seq_id), tuple(self.tokens), self.settled,
                          self.exact_len, self.checkpoints.copy())

    def put_back(self, snap: KVSnapshot) -> None:
        """Restore a :meth:`snapshot` of this slot (its KV, tokens and checkpoints).

        A sliding-window state that would not continue exactly (:meth:`restorable`) goes
        back to its newest checkpoint that does, or leaves the slot empty.
        """
        self.clear()
        self.ctx.state_set(self.seq_id, snap.state)
        self.tokens = list(snap.tokens)
        self.settled, self.exact_len = snap.settled, snap.exact_len
        cps = snap.checkpoints.copy()
        cps.max_entries, cps.max_bytes = self.checkpoints.max_entries, self.checkpoints.max_bytes
        self.checkpoints = cps
        if not self.verify():
            log.error("seq %d: a snapshot did not restore; clearing the slot", self.seq_id)
            self.clear()
            return
        n = len(self.tokens)
        if not self.restorable(n):
            # its window landed where later tokens would not compute as a fresh decode
            # does: back to the newest checkpoint that does (or empty)
            at = max((c for c in self.checkpoints.positions if self.restorable(c)), default=0)
            log.debug("seq %d: a sliding-window state of %d positions goes back to %d",
                      self.seq_id, n, at)
            self.trim_to(at)

    def clear(self) -> None:
        """Empty the sequence."""
        self.version += 1
        self.ctx.try_seq_rm(self.seq_id, -1, -1)
        self.tokens.clear()
        self.settled = self.exact_len = 0
        self.checkpoints.clear()
        self.cut_floor = self._empty_floor()

    def resync(self) -> None:
        """After a failed or partial decode: make the KV hold exactly :attr:`tokens` again."""
        n = len(self.tokens)
        if self.verify():
            return
        if self.memory.can_trim and self.ctx.try_seq_rm(self.seq_id, n, -1) and self.verify():
            return
        if self.memory.takes_checkpoints and n and self._cut(n):
            return  # the recurrent state moved past the tokens: back to a checkpoint
        log.error("seq %d: KV and token record disagree; clearing the slot", self.seq_id)
        self.clear()

    # ------------------------------------------------------------------ checks

    def verify(self) -> bool:
        """The memory holds exactly positions ``0..len(tokens)-1`` of this sequence."""
        n = len(self.tokens)
        if self.ctx.seq_pos_max(self.seq_id) + 1 != n:
            return False
        if self.memory.kind == PLAIN:
            return self.ctx.seq_pos_min(self.seq_id) == (0 if n else -1)
        if self.memory.kind == SWA:
            self.cut_floor = window_floor(SWA, self.memory.n_swa,
                                          self.ctx.seq_pos_min(self.seq_id))
        return True

    def _empty_floor(self) -> int:
        return window_floor(self.memory.kind, self.memory.n_swa, 0)

    def _window_holds(self, n: int) -> bool:
        """Sliding window: the SWA cache still holds every position a token at ``n`` sees."""
        if self.memory.kind != SWA:
            return True
        lo = self.ctx.seq_pos_min(self.seq_id)
        return 0 <= lo <= max(0, n - self.memory.n_swa)


def trim_valid(kv: SlotKV, units: Sequence[Any], n: int, rule: invariance.PrefillRule) -> int:
    """Cut ``kv`` back to where a canonical prefill of ``units`` may begin; returns it.

    ``kv`` holds a prefix of ``units``; the cut is the largest position ``<= n`` that is a
    valid start (:func:`nbkv.kv.invariance.valid_start`) and that its memory can go back to.
    Memory that cannot be cut goes back to a checkpoint, which must itself be such a
    position in *this* prompt, else further back.
    """
    restored = None
    while True:
        n = invariance.valid_start(units, n, rule)
        kept = kv.trim_to(n)
        restored = kv.last_restore if kv.last_restore is not None else restored
        if kept == n:
            kv.last_restore = restored  # the checkpoint this cut went back to, if any
            return kept
        n = kept
