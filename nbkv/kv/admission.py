"""A request's admission as data: where its reused KV comes from and the KV steps, in order.

The policy (:func:`nbkv.kv.policy.select`) chooses the slot and the candidate; :func:`admit`
turns that choice into one complete decision, an :class:`Admission`: its source, the ordered
KV steps that make the slot hold exactly the reusable prefix, and the length kept. It is pure
(no model, no llama.cpp): the engine's executor (:mod:`nbkv.engine.admit`) applies the steps
in the order stated, and the request's record is built from the admission and the outcome.

The steps, always in this order (:data:`STEP_ORDER`): the conversation the slot held is
parked (a read of its state); a parked conversation is restored into it (a whole-state
write); a donor's prefix is copied into it; the system prompt's state is loaded (SPC) or the
slot cleared (cache off); the branch an edit leaves is parked (where the first step parked
nothing); the slot is trimmed to what is kept. A reply the slot already holds for this very
prompt (a replay) ends the steps before the branch is parked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbkv.kv import invariance, policy

#: where the reused KV comes from: kept in the slot, copied from another slot, a parked
#: conversation put back, the system prompt's saved state, or nothing (a miss)
IN_PLACE, COPY_SOURCE, RESTORE_SOURCE, SPC, MISS = (
    policy.IN_PLACE, policy.COPY, policy.RESTORE, "spc", policy.MISS)

#: the KV steps, each named for what it does to the slot
PARK, RESTORE, COPY, LOAD_SPC, CLEAR, PARK_BRANCH, TRIM = (
    "park", "restore", "copy", "load-spc", "clear", "park-branch", "trim")
STEP_ORDER = (PARK, RESTORE, COPY, LOAD_SPC, CLEAR, PARK_BRANCH, TRIM)


@dataclass(frozen=True)
class Holder:
    """What :func:`admit` reads of the slot (or donor) a request takes KV from."""

    tokens: Sequence[Any]
    session: str | None = None
    msg_ends: Sequence[int] = ()
    redo: int = 0  # trailing positions out of the KV while a reply is rewritten
    settled: int = 1 << 30  # positions whose KV a canonical prefill would give
    exact_len: int = 1 << 30  # positions decoded as a canonical prefill decodes them

    @property
    def held(self) -> int:
        """Positions it holds, those being rewritten included."""
        return len(self.tokens) + self.redo


@dataclass(frozen=True)
class Admission:
    """How one request is admitted: the complete decision the executor carries out.

    ``plan`` is the policy's choice (slot, donor, parked entry, strategy). ``source`` is one of
    :data:`IN_PLACE`, :data:`COPY_SOURCE`, :data:`RESTORE_SOURCE`, :data:`SPC`, :data:`MISS`.
    ``steps`` is a subsequence of :data:`STEP_ORDER`. ``keep`` is the length the slot keeps
    (where a canonical prefill of the prompt may begin, settled KV only when exact);
    ``wanted`` is what the plan shares with the prompt, ``absorbed`` what of it a rewrite of
    the last reply would have served (exact mode). ``taken``: a restore takes the parked entry
    back (else it reads a copy and the entry stays parked). ``prev_len`` and
    ``prev_prompt_len`` are what the source held, and of it the prompt before its last reply.
    """

    plan: policy.Plan
    source: str
    steps: tuple[str, ...]
    keep: int
    wanted: int
    absorbed: int = 0
    taken: bool = False
    prev_len: int = 0
    prev_prompt_len: int = 0

    def __post_init__(self) -> None:
        order = [STEP_ORDER.index(s) for s in self.steps]
        if order != sorted(set(order)):
            raise ValueError(f"steps out of order: {self.steps}")

    @property
    def parks(self) -> bool:
        """The slot's conversation is parked first (another conversation takes the slot)."""
        return PARK in self.steps


def admit(plan: policy.Plan, slot: Holder, donor: Holder | None, session: str | None,
          tokens: Sequence[Any], rule: invariance.PrefillRule, *, cache: str, exact: bool,
          taken: bool = False) -> Admission:
    """The admission of a request with prompt ``tokens`` into ``plan``'s slot (pure).

    ``slot`` is the target slot as it is, ``donor`` the slot ``plan`` copies from (None: no
    copy); ``taken`` whether a restored parked entry is taken back
    (:func:`nbkv.kv.policy.takes_parked`). ``cache`` is the engine's mode: ``"imc"``,
    ``"spc"`` or ``"off"``; ``exact``: only settled KV is served.
    """
    restoring = plan.parked is not None
    source_slot = donor if donor is not None else slot
    prev_len = source_slot.held
    prev_prompt_len = slot.msg_ends[-1] if slot.msg_ends and donor is None else prev_len
    if restoring:  # what is reused is the parked conversation, not the slot's
        prev_len = prev_prompt_len = 0
    reuse = wanted = plan.reuse
    absorbed = 0
    if exact and not restoring:  # a reply decoded one token at a time is not servable
        absorbed = max(min(wanted, prev_len) - source_slot.exact_len, 0)
        reuse = min(reuse, source_slot.settled)
    keep = invariance.valid_start(tokens, min(reuse, policy.reuse_limit(len(tokens))), rule)
    parks = displaced(slot, plan, session)
    steps = [PARK] if parks else []
    if restoring:
        steps.append(RESTORE)
    if donor is not None:
        steps.append(COPY)
    if cache == "spc":
        steps.append(LOAD_SPC)
    elif cache == "off":
        steps.append(CLEAR)
    elif cache == "imc" and not restoring and donor is None:
        steps.append(PARK_BRANCH)  # an edit: its old branch's replies stay
    steps.append(TRIM)
    if restoring:
        source = RESTORE_SOURCE
    elif donor is not None:
        source = COPY_SOURCE
    elif cache == "spc":
        source = SPC
    else:
        source = IN_PLACE if cache == "imc" and keep else MISS
    return Admission(plan, source, tuple(steps), keep, wanted, absorbed, taken and restoring,
                     prev_len, prev_prompt_len)


def displaced(slot: Holder, plan: policy.Plan, session: str | None) -> bool:
    """``slot`` holds a conversation that serving ``plan`` would take over: park it first.

    Any conversation but the session's own (which the new one supersedes): another
    session's, even one the request carries on in place (a fork at its end: the fork may
    later be edited or cut). An unnamed conversation that an unnamed request carries on in
    place is that request's own.
    """
    if not slot.held:
        return False
    if slot.session is not None:
        return slot.session != session
    held = slot.msg_ends[-1] if slot.msg_ends else slot.held
    continued = plan.donor is None and plan.parked is None and plan.reuse >= held
    return not (session is None and continued)


def reply_reuse(adm: Admission, reuse: int) -> tuple[int, int]:
    """(reply positions the source held, of them reused) once ``reuse`` positions are kept.

    The previous reply, as generated, against its re-tokenization in this prompt.
    """
    cached = max(adm.prev_len - adm.prev_prompt_len, 0) if adm.plan.donor is None else 0
    return cached, min(max(reuse - adm.prev_prompt_len, 0), cached)
