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

PLAIN, SWA, HYBRID, RECURRENT = "plain", "sliding-window", "hybrid", "recurrent"
MEMORY_CLASSES = (PLAIN, SWA, HYBRID, RECURRENT)

NO_CUT = 1 << 62  # a floor no cut reaches: only the end itself, or a checkpoint


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
    ``checkpoints`` (positions); a slot also its ``cut_floor``; a parked conversation is
    put back whole, so its floor is :func:`restored_floor`'s.
    """

    units: Sequence[Any]
    rule: invariance.PrefillRule
    exact: bool
    kind: str
    n_swa: int = 0

    def __call__(self, c: Any, want: int, parked: bool) -> int:
        """Positions candidate ``c`` serves when it shares ``want`` of them (capped)."""
        n = len(c.tokens)
        settled = getattr(c, "settled", n)
        if want <= 0 or n == 0:
            return 0
        limit = min(want, settled if self.exact else n)
        floor = (restored_floor(self.kind, self.n_swa, n) if parked
                 else getattr(c, "cut_floor", 0))
        return reach(self.units, limit, self.rule, n, floor, tuple(c.checkpoints))
