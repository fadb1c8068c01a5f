"""Recomputing a slot from its tokens: how the KV of an untrusted save becomes safe to serve.

A save that is not signed by this user's key (:mod:`nbkv.core.signing`) may hold any bytes
as a slot's KV: the KV of another conversation relabelled, or noise. Restored with
``trust=True``, each of its slots is recomputed on the scheduler thread before any request
can reach it: the slot's tokens are prefilled from scratch into it, in the canonical chunks
a request would use (:mod:`nbkv.kv.invariance`), with a checkpoint at each message end where
the memory needs them. The recomputed KV is what is served. The probe logits over the saved
KV are compared with those over the recomputed KV first, to tell the user whether the save
held the KV its tokens claim.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from nbkv.engine.prefill import extension_logits
from nbkv.kv.invariance import next_chunk, stable_end
from nbkv.kv.slot_kv import SlotKV

if TYPE_CHECKING:
    from nbkv.engine.core import EngineCore
    from nbkv.engine.slots import EngineSlot

PROBE = 42  # the token appended to compare the saved KV with the recomputed one


@dataclass(frozen=True)
class Recomputation:
    """One slot of an untrusted save, recomputed by a full prefill before it is served."""

    slot: int
    session: str | None
    tokens: int
    seconds: float  # the full prefill
    matched: bool | None  # the saved KV gave the recomputed KV's probe logits (None: unknown)
    max_diff: float = 0.0  # largest |logit difference| between the two
    error: str = ""  # why the slot could not be recomputed (it was emptied)

    def __str__(self) -> str:
        who = f"slot {self.slot} ({self.session or '-'})"
        if self.error:
            return (f"{who}: could not be recomputed ({self.error}); emptied, its next turn "
                    "rebuilds it")
        if self.matched:
            said = "the saved KV matched it"
        elif self.matched is None:
            said = "the saved KV could not be compared (the slot is full)"
        else:
            said = (f"the saved KV differed (max |logit diff| {self.max_diff:.4g}) and was "
                    "discarded")
        return (f"{who}: {self.tokens} tokens recomputed by a full prefill in "
                f"{self.seconds:.2f} s; {said}")


def recompute(core: EngineCore, index: int) -> Recomputation:
    """Replace slot ``index``'s KV by a full prefill of its tokens (scheduler thread)."""
    s: EngineSlot = core.table[index]
    session, tokens = s.session, list(s.kv.tokens)
    units = [*tokens, PROBE, PROBE]  # never a lone probe row
    fits = len(units) <= s.capacity
    t0 = 0.0
    try:
        if not all(isinstance(u, int) for u in tokens):
            raise ValueError("it holds an image, which is encoded only by a request")
        saved = extension_logits(core, s, units, len(tokens)) if fits else None
        s.kv.clear()
        t0 = time.perf_counter()
        prefill_all(core, s.kv, tokens, s.msg_ends)
        seconds = time.perf_counter() - t0
        if not s.kv.verify():
            raise RuntimeError("the recomputed KV does not hold the slot's positions")
        fresh = extension_logits(core, s, units, len(tokens)) if fits else None
    except Exception as e:  # noqa: BLE001 - the slot is emptied, the engine goes on serving
        core.table.reset(s)
        return Recomputation(index, session, len(tokens),
                             time.perf_counter() - t0 if t0 else 0.0, None,
                             error=f"{type(e).__name__}: {e}")
    if saved is None or fresh is None:
        return Recomputation(index, session, len(tokens), seconds, None)
    diff = float(np.abs(np.asarray(saved) - np.asarray(fresh)).max())
    return Recomputation(index, session, len(tokens), seconds,
                         bool(np.array_equal(saved, fresh)), diff)


def prefill_all(core: EngineCore, kv: SlotKV, tokens: Sequence[Any], stops: Iterable[int]
                ) -> None:
    """Prefill ``tokens`` (text only) into the empty ``kv`` as requests would.

    Canonical chunks that end at the message ends ``stops`` where the grouping allows, and
    a checkpoint there when the memory keeps them (hybrid, recurrent).
    """
    rule, batch = core.res.rule, core.res.batch
    ends = sorted(set(stops))
    while len(kv) < len(tokens):
        pos = len(kv)
        n = next_chunk(tokens, pos, rule, batch.capacity, ends)
        run = tokens[pos:pos + n]
        batch.clear()
        batch.add_run(run, pos, kv.seq_id, False)
        core.res.ctx.decode(batch)
        kv.extend(run, settled=stable_end(tokens, pos + n, rule))
        if pos + n in ends and kv.settled == pos + n:
            kv.checkpoint()
