"""Prompt runs into the KV outside a request, in the canonical chunks of :mod:`nbkv.kv.invariance`.

A request's own chunks are :meth:`nbkv.engine.decoder.Decoder.prefill`'s. :func:`prefill_run`
decodes a run of text (the probe, a recomputation); :func:`extension_logits` computes what a
request extending a slot would see, then puts the slot back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nbkv.core.errors import NbkvError
from nbkv.engine.slots import servable
from nbkv.kv import invariance
from nbkv.kv.slot_kv import trim_valid

if TYPE_CHECKING:
    from nbkv.engine.core import EngineCore
    from nbkv.engine.slots import EngineSlot


def prefill_run(core: EngineCore, units: Sequence[Any], pos: int, seq: int, row: int | None
                ) -> Iterator[tuple[int, int]]:
    """Prefill ``units[pos:]`` (text) into ``seq`` in canonical chunks.

    Yields each decoded chunk's ``(from, to)``; ``row`` is the one position whose logits
    are computed.
    """
    b = core.res.batch
    while pos < len(units):
        if not isinstance(units[pos], int):
            raise NbkvError("an image after a slot's settled KV cannot be re-read here")
        n = invariance.next_chunk(units, pos, core.res.rule, b.capacity)
        b.clear()
        for k in range(pos, pos + n):
            b.add(units[k], k, seq, k == row)
        core.res.ctx.decode(b)
        yield pos, pos + n
        pos += n


def extension_logits(core: EngineCore, s: EngineSlot, units: Sequence[Any], row: int
                     ) -> np.ndarray:
    """The logits of ``units[row]`` prefilled over ``s``'s KV, as a request would.

    ``units`` are prefilled canonically on top of what ``s`` holds of them (its settled
    KV, or all of it without exact mode); then ``s`` holds its tokens again: memory that
    can be cut is cut and its tail prefilled again (canonically), other memory gets its
    whole state back (scheduler thread).
    """
    kv, rule = s.kv, core.res.rule
    core.res.ctx.sampling.use(())  # the host reads this row (the next step attaches again)
    tokens = list(kv.tokens)
    snap = kv.snapshot() if kv.memory.checkpoints else None
    out = None
    try:
        pos = trim_valid(kv, units, min(servable(core.settings.exactness.exact, kv), row), rule)
        for lo, hi in prefill_run(core, units, pos, kv.seq_id, row):
            if lo <= row < hi:
                out = np.array(core.res.ctx.logits(row - lo))
    finally:
        if snap is not None:
            kv.put_back(snap)
        else:  # a state copy would keep only the window of sliding-window layers
            kv.resync()
            if len(kv) < len(tokens):
                # from where a canonical prefill of the slot's own tokens may begin: the cut
                # made for ``units`` can leave too few rows of ``tokens`` for one chunk
                trim_valid(kv, tokens, len(kv), rule)
            for lo, hi in prefill_run(core, tokens, len(kv), kv.seq_id, None):
                kv.extend(tokens[lo:hi], settled=invariance.stable_end(tokens, hi, rule))
    assert out is not None
    return out
