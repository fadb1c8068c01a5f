"""What each scheduler step decodes: pure planning, no model, no llama.cpp.

A step is at most two ``llama_decode`` calls:

- a *generation* decode with the next token of every generating request (one row per
  sequence, plus a guess where speculative decoding is on), in increasing sequence-id
  order so that llama.cpp evaluates them as one micro-batch;
- a *prefill* decode of one chunk of one prompt, shortest remaining prompt first (the
  least mean time to first token: a chat turn does not wait behind a long document).

They are separate calls because llama.cpp's micro-batch split (``split_equal``) gives every
sequence of a mixed batch the same number of rows: a prompt chunk decoded beside one
generated token would lose its first token to a one-row micro-batch, which rounds
differently from a batched prefill. A chunk that finishes a prompt runs alone, so its
first token waits for nobody.

How many rows a chunk takes is decided by the canonical grouping (:mod:`nbkv.kv.invariance`):
the engine passes each prompt's next chunk in :attr:`Prefilling.take`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Prefilling:
    """A request with prompt positions still to decode."""

    key: int  # the request's id (also breaks ties: first come first served)
    remaining: int  # positions left to prefill
    ready: bool = True  # False while its next image is being encoded
    image_next: bool = False  # the next position starts an image
    take: int = 0  # rows its next text chunk holds (nbkv.kv.invariance.next_chunk)


@dataclass(frozen=True)
class StepPlan:
    """One scheduler step."""

    prefill: int | None = None  # key of the request whose prompt advances
    take: int = 0  # prompt positions it decodes (0 for an image: the projector decides)
    image: bool = False  # the prefill decodes an image
    generate: bool = False  # run the generation decode

    @property
    def idle(self) -> bool:
        """Nothing to decode."""
        return self.prefill is None and not self.generate


def plan_step(prefilling: Sequence[Prefilling], generating: int) -> StepPlan:
    """Plan one step given the prompts in progress and the number of generating requests."""
    ready = [p for p in prefilling if p.ready and p.remaining > 0]
    if not ready:
        return StepPlan(generate=generating > 0)
    job = min(ready, key=lambda p: (p.remaining, p.key))
    if job.image_next:
        return StepPlan(job.key, 0, True, generating > 0)
    take = min(job.take, job.remaining)
    last = take >= job.remaining
    return StepPlan(job.key, take, False, generating > 0 and not last)
