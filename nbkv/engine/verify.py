"""Checking that a slot's cached KV is bit-identical to a from-scratch decode.

Each slot's probe logits (a request extending it, :func:`nbkv.engine.prefill.extension_logits`)
are compared with a decode of its tokens in a temporary context (:mod:`nbkv.kv.oracle`); where
they differ, the first differing position is narrowed down by bisection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nbkv.core.errors import NbkvError
from nbkv.engine.prefill import extension_logits
from nbkv.engine.slots import SlotPhase, servable
from nbkv.kv import invariance
from nbkv.kv.oracle import Verification, scratch_logits, scratch_rows
from nbkv.media.units import MediaUnit

if TYPE_CHECKING:
    from nbkv.engine.core import EngineCore
    from nbkv.engine.slots import EngineSlot


def ready_slot(core: EngineCore, index: int) -> EngineSlot:
    """Slot ``index`` with its pending rewrite done (scheduler thread).

    Its KV is then what a request would be served.
    """
    s = core.table[index]
    if s.phase is SlotPhase.SERVING:
        raise NbkvError(f"slot {index} is serving a request")
    while s.phase is SlotPhase.REWRITING or (core.settings.exactness.exact
                                             and s.phase is SlotPhase.UNSETTLED):
        core.rewriter.settle(s)
    return s


def probe(core: EngineCore, index: int, token: int) -> list[float]:
    """Logits of ``token`` appended to slot ``index`` (scheduler thread; KV unchanged)."""
    s = ready_slot(core, index)
    units = [*s.kv.tokens, token, token]
    if len(units) > s.capacity:
        raise NbkvError(f"slot {index} is full")
    return list(extension_logits(core, s, units, len(s.kv)))


def scratch_settings(core: EngineCore, units: Sequence[Any]) -> dict[str, Any]:
    """Keywords for :func:`nbkv.kv.oracle.scratch_rows` matching this engine.

    Its grouping, batch, context settings and, for images, projector and pictures.
    """
    res = core.res
    kw: dict[str, Any] = {"rule": res.rule, "n_batch": res.batch.capacity, **res.settings}
    hashes = {u.key.image_hash for u in units if isinstance(u, MediaUnit)}
    if hashes:
        if hashes - core.images.keys():
            raise NbkvError("cannot verify: the slot holds an image this engine no "
                            "longer keeps")
        kw.update(projector=res.projector, images=dict(core.images))
    return kw


def verify_slot(core: EngineCore, index: int, probe_token: int) -> Verification:
    """Compare slot ``index``'s probe logits with a fresh decode (caller's thread)."""
    def take() -> tuple[list[Any], str | None, int, np.ndarray]:
        s = ready_slot(core, index)
        units = [*s.kv.tokens, probe_token, probe_token]
        if len(units) > s.capacity:
            raise NbkvError(f"slot {index} is full")
        return (list(s.kv.tokens), s.session, servable(core.settings.exactness.exact, s.kv),
                extension_logits(core, s, units, len(s.kv)))
    tokens, session, kept, cached = core.call(take)
    fresh = scratch_logits(core.res.model, tokens, probe_token,
                           **scratch_settings(core, tokens))
    same = bool(np.array_equal(cached, fresh))
    first = None
    if not same and core.res.memory.can_trim:
        first = _first_difference(core, index, tokens, kept)
    return Verification(index, session, len(tokens), same,
                        float(np.abs(cached - fresh).max()), first,
                        core.settings.exactness.exact and core.res.rule.exact)


def _first_difference(core: EngineCore, index: int, tokens: list[Any], kept: int
                      ) -> tuple[int, int] | None:
    """Narrow down where ``index``'s KV first differs from a fresh decode.

    Rows ending on the grid are recomputed over the cached KV before them and compared
    with a fresh run (bisection; the slot must not change meanwhile).
    """
    rule = core.res.rule
    step = max(16 // rule.align, 1) * rule.align
    ends = sorted({g for g in (invariance.valid_start(tokens, x, rule)
                               for x in range(step, kept + 1, step))
                   if g >= rule.min_chunk and invariance.stable_end(tokens, g, rule) == g
                   and isinstance(tokens[g - 1], int)})
    if not ends:
        return (0, len(tokens))
    fresh = scratch_rows(core.res.model, tokens, [g - 1 for g in ends],
                         **scratch_settings(core, tokens))

    def kept_equal(g: int) -> tuple[bool, int]:
        def run() -> tuple[bool, int]:
            s = core.table[index]
            if s.pending or s.kv.tokens[:g] != tokens[:g]:
                raise NbkvError("the slot changed during verification")
            v = invariance.valid_start(
                tokens[:g], min(servable(core.settings.exactness.exact, s.kv), g - 1), rule)
            return bool(np.array_equal(extension_logits(core, s, tokens[:g], g - 1),
                                       fresh[g - 1])), v
        return core.call(run)

    lo_i, hi_i, lo_pos, hi_pos = -1, len(ends), 0, len(tokens)
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        ok, v = kept_equal(ends[mid])
        if ok:
            lo_i, lo_pos = mid, v
        else:
            hi_i, hi_pos = mid, v
    return (lo_pos, hi_pos)
