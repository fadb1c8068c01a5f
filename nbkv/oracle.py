"""The correctness oracle: logits computed from scratch, to hold a cached slot's KV against.

A slot's KV is right when the logits the model gives a probe token after it equal, bit for
bit, the logits after the slot's recorded units decoded into a brand-new context
(:meth:`nbkv.engine.Engine.probe` against :func:`scratch_logits`). The tests and the
benchmark's exactness checks both use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .backend import Batch, Context, Model
from .media import MediaUnit

CHUNK = 200  # text positions per decode (never a lone-token batch: see the README)


def scratch_logits(model: Model, units: Sequence[Any], probe: int, *,
                   projector: Any = None, images: Mapping[str, Any] | None = None,
                   **context: Any) -> np.ndarray:
    """Logits of ``probe`` after ``units``, decoded from scratch in a fresh context.

    ``units`` are token ids, or :class:`~nbkv.media.MediaUnit` runs of ``images`` (by image
    hash), each freshly encoded by ``projector`` (give it its own embedding cache).
    ``context``: :class:`~nbkv.backend.Context` settings (KV types, flash attention).
    """
    seq = list(units) + [probe, probe]
    target = len(units)
    n_ctx = max(2048, -(-len(seq) // 256) * 256)
    ctx, batch = Context(model, n_ctx, 1, 256, **context), Batch(256)
    out = None
    try:
        i = 0
        while i < len(seq):
            u = seq[i]
            if isinstance(u, MediaUnit):
                if projector is None or images is None:
                    raise ValueError("units hold an image: pass projector= and images=")
                with projector.tokenize(projector.marker, [images[u.key.image_hash]],
                                        use_cache=False) as mp:
                    projector.decode_chunk(ctx, mp.image_chunks()[u.key.sub_index], 0, i)
                i += u.key.n_pos
                continue
            run = i
            while run < len(seq) and not isinstance(seq[run], MediaUnit):
                run += 1
            n = min(CHUNK, run - i)
            if run - i - n == 1:
                n -= 1
            batch.clear()
            for k in range(i, i + n):
                batch.add(seq[k], k, 0, k == target)
            ctx.decode(batch)
            if i <= target < i + n:
                out = np.array(ctx.logits(target - i))
            i += n
    finally:
        batch.close()
        ctx.close()
    assert out is not None
    return out
