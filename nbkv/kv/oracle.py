"""The correctness oracle: logits computed from scratch, to hold a cached slot's KV against.

A slot's KV is right when the logits the model gives a probe token after it equal, bit for
bit, the logits after the slot's recorded units decoded into a brand-new context, grouped the
canonical way (:mod:`nbkv.kv.invariance`): :meth:`nbkv.Engine.probe` against
:func:`scratch_logits`. :meth:`nbkv.Engine.verify` runs the comparison; the tests and
the benchmark's exactness checks use it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nbkv.kv import invariance
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.backend import Batch, Context, Model
from nbkv.media.units import MediaUnit

N_BATCH = 256  # prompt rows per decode of a from-scratch run


def scratch_logits(model: Model, units: Sequence[Any], probe: int, **kw: Any) -> np.ndarray:
    """Logits of ``probe`` after ``units``, decoded from scratch in a fresh context.

    The probe is appended twice (never a lone row); see :func:`scratch_rows` for ``kw``.
    """
    return scratch_rows(model, [*units, probe, probe], [len(units)], **kw)[len(units)]


def scratch_rows(model: Model, units: Sequence[Any], rows: Sequence[int], *,
                 projector: Any = None, images: Mapping[str, Any] | None = None,
                 rule: PrefillRule | None = None, n_batch: int = N_BATCH,
                 **context: Any) -> dict[int, np.ndarray]:
    """The logits of ``rows`` (text positions) when ``units`` are decoded from scratch.

    ``units`` are token ids, or :class:`~nbkv.media.units.MediaUnit` runs of ``images`` (by image
    hash), each encoded by ``projector``. Text is grouped by ``rule`` (default: the one the
    model was calibrated with), in batches of ``n_batch``, in a brand-new context with
    ``context`` settings (:class:`~nbkv.llama.backend.Context` keywords: KV types, threads, ...).
    """
    rule = rule or model.prefill_rule or PrefillRule()
    want = set(rows)
    n_ctx = max(2048, -(-len(units) // 256) * 256)
    ctx, batch = Context(model, n_ctx, 1, n_batch, **context), Batch(n_batch)
    out: dict[int, np.ndarray] = {}
    try:
        i = 0
        while i < len(units):
            u = units[i]
            if isinstance(u, MediaUnit):
                if projector is None or images is None:
                    raise ValueError("units hold an image: pass projector= and images=")
                with projector.tokenize(projector.marker, [images[u.key.image_hash]],
                                        use_cache=False) as mp:
                    projector.decode_chunk(ctx, mp.image_chunks()[u.key.sub_index], 0, i)
                i += u.key.n_pos
                continue
            n = invariance.next_chunk(units, i, rule, n_batch)
            batch.clear()
            for k in range(i, i + n):
                batch.add(units[k], k, 0, k in want)
            ctx.decode(batch)
            for k in range(i, i + n):
                if k in want:
                    out[k] = np.array(ctx.logits(k - i))
            i += n
    finally:
        batch.close()
        ctx.close()
    missing = want - out.keys()
    if missing:
        raise ValueError(f"rows {sorted(missing)} are not text positions of units")
    return out


@dataclass(frozen=True)
class Verification:
    """What :meth:`nbkv.Engine.verify` found for one slot."""

    slot: int
    session: str | None
    tokens: int  # positions checked
    identical: bool  # probe logits bit-identical to a from-scratch decode
    max_diff: float  # largest |logit difference| (0.0 when identical)
    first_diff: tuple[int, int] | None = None  # the first difference lies in [lo, hi)
    claimed: bool = True  # the engine claims this KV exact (exact mode, a proven rule)

    def __str__(self) -> str:
        who = f" ({self.session})" if self.session else ""
        return f"slot {self.slot}{who}, {self.tokens} positions: {self.finding()}"

    def finding(self) -> str:
        """What the comparison found, in words (without the slot)."""
        if self.identical:
            return "bit-identical to a from-scratch decode"
        where = ""
        if self.first_diff is not None:
            lo, hi = self.first_diff
            where = (f"; first difference at position {lo}" if hi - lo <= 1 else
                     f"; first difference between positions {lo} and {hi}")
        note = "" if self.claimed else " (the engine did not claim it exact)"
        return f"differs: max |logit diff| {self.max_diff:.4g}{where}{note}"
