"""What a cached candidate can really serve of a prompt: pure logic, no model, no llama.cpp.

A slot, a parked conversation or a donor shares a token prefix with a new prompt, but not
all of it can be served. In exact mode only its *settled* KV counts; a prefill must begin
where the canonical grouping allows (:func:`nbkv.kv.invariance.valid_start`); and the memory
must be able to go back there:

- ``plain`` attention cuts anywhere;
- ``sliding-window`` memory cuts anywhere its sliding-window layers still hold the window
  before the cut. A live slot keeps every cell (llama.cpp's full-size SWA cache), but a
  state put back from RAM, disk or a save holds only the window before its end
  (llama.cpp writes only those cells), so it cuts only at its end, or at a checkpoint;
- ``hybrid`` and ``recurrent`` memory cut only at a checkpoint (or not at all).

:func:`reach` is the decision :func:`nbkv.kv.slot_kv.trim_valid` carries out on the KV, as a
pure function; :class:`Judge` applies it to the policy's candidates, so that placement
compares what each option would really keep (:func:`nbkv.kv.policy.select`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbkv.kv import invariance
from nbkv.kv.policy import COPY, RESTORE

PLAIN, SWA, HYBRID, RECURRENT = "plain", "sliding-window", "hybrid", "recurrent"
MEMORY_CLASSES = (PLAIN, SWA, HYBRID, RECURRENT)

NO_CUT = 1 << 62  # a floor no cut reaches: only the end itself, or a checkpoint

#: llama.cpp writes a restored window into the first cells of the sequence's KV stream,
#: where a from-scratch decode has position ``p`` in cell ``p``; the CPU attention kernels
#: sum the cells in SIMD lanes (16 floats with AVX-512, 8 with AVX2), so later tokens
#: compute bit-identically only when the window starts a multiple of this many cells away
#: (the docs' model families page)
SWA_CELLS = 16


def restorable(kind: str, n_swa: int, pos: int) -> bool:
    """A whole state (or a checkpoint) of ``pos`` positions continues exactly once put back.

    Always on memory other than sliding-window; there, when the window is all of it
    (``pos <= n_swa``) or starts a multiple of :data:`SWA_CELLS` cells in.
    """
    return kind != SWA or pos <= n_swa or (pos - n_swa) % SWA_CELLS == 0


def restore_point(units: Sequence[Any], pos: int, rule: invariance.PrefillRule, kind: str,
                  n_swa: int) -> int:
    """The largest position ``<= pos`` where ``units``' KV can be saved and put back exactly.

    A settled chunk end (:func:`nbkv.kv.invariance.stable_end`) that is
    :func:`restorable`; 0 if there is none.
    """
    q = invariance.stable_end(units, max(0, min(pos, len(units))), rule)
    while q > 0 and not (invariance.stable_end(units, q, rule) == q
                         and restorable(kind, n_swa, q)):
        q -= 1
    return q


def restored_floor(kind: str, n_swa: int, n: int) -> int:
    """The lowest position a state of ``n`` positions put back whole can be cut to directly.

    ``plain``: 0. ``sliding-window``: llama.cpp saves the sliding-window layers' cells from
    ``n - n_swa`` on only; a token at ``p`` needs them from ``p - n_swa`` on, so only ``n``
    itself is reachable (0 while ``n <= n_swa``: every cell is there). Hybrid and recurrent:
    none (:data:`NO_CUT`).
    """
    if kind == PLAIN:
        return 0
    if kind == SWA:
        return 0 if n <= n_swa else n
    return NO_CUT


def window_floor(kind: str, n_swa: int, pos_min: int) -> int:
    """The lowest direct cut of a live sequence whose first held position is ``pos_min``.

    Mirrors :meth:`nbkv.kv.slot_kv.SlotKV._window_holds`: a cut at ``p`` needs the
    sliding-window layers to hold every position ``p - n_swa`` and on.
    """
    if kind == PLAIN:
        return 0
    if kind == SWA:
        return 0 if pos_min <= 0 else pos_min + n_swa
    return NO_CUT


def reach(units: Sequence[Any], want: int, rule: invariance.PrefillRule, n: int, floor: int,
          checkpoints: Sequence[int] = ()) -> int:
    """The most positions of ``units`` a candidate holding ``n`` of them can serve.

    ``want``: at most this many (the shared prefix, capped at what is servable); ``floor``:
    the lowest cut its memory makes directly (:func:`restored_floor`, :func:`window_floor`);
    ``checkpoints``: positions it can go back to otherwise. The result is a valid start of
    ``units`` that the memory reaches: :func:`nbkv.kv.slot_kv.trim_valid`'s answer.
    """
    k = max(0, min(want, n))
    while True:
        k = invariance.valid_start(units, k, rule)
        if k == 0 or k == n or k >= floor:
            return k
        kept = max((c for c in checkpoints if c <= k), default=0)
        if kept == k:
            return k
        k = kept


@dataclass(frozen=True)
class Judge:
    """What each candidate of :func:`nbkv.kv.policy.select` can serve of one prompt.

    ``exact``: only settled KV is servable. A candidate has ``tokens``, ``settled`` and
    ``checkpoints`` (positions); a slot also its ``cut_floor``. How it would serve matters:
    a parked conversation is put back whole (:func:`restored_floor`); a copy of
    sliding-window memory cannot go back to a checkpoint (:meth:`nbkv.kv.slot_kv.SlotKV.
    copy_from`: the copied cells arrive with the next decode, after any checkpoint).
    """

    units: Sequence[Any]
    rule: invariance.PrefillRule
    exact: bool
    kind: str
    n_swa: int = 0

    def __call__(self, c: Any, want: int, how: str) -> int:
        """Positions ``c`` serves of the ``want`` it shares, used ``how`` (policy.IN_PLACE...)."""
        n = len(c.tokens)
        if want <= 0 or n == 0:
            return 0
        limit = min(want, getattr(c, "settled", n) if self.exact else n)
        cps = () if how == COPY and self.kind == SWA else tuple(c.checkpoints)
        if how != RESTORE:
            return reach(self.units, limit, self.rule, n, getattr(c, "cut_floor", 0), cps)
        if not restorable(self.kind, self.n_swa, n):  # put back, it goes to a checkpoint
            cps = tuple(x for x in cps if restorable(self.kind, self.n_swa, x))
            return reach(self.units, min(limit, max(cps, default=0)), self.rule, n, NO_CUT,
                         cps)
        return reach(self.units, limit, self.rule, n, restored_floor(self.kind, self.n_swa, n),
                     cps)
