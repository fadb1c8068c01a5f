"""Slot selection for the Incremental Message Cache: pure logic, no model, no llama.cpp.

A slot is anything with the attributes of :class:`SlotLike`. :func:`select` decides which
slot serves a request and how many of its cached tokens survive; the engine carries the
decision out (trim, copy, prefill). Keeping it pure makes every rule testable without a model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("nbkv.policy")

HASH_HIT = "hash-hit"
HASH_EXTEND = "hash-extend"
PREFIX_SALVAGE = "prefix-salvage"
MISS = "miss"


class SlotLike(Protocol):
    """What the policy reads from a slot."""

    index: int
    tokens: Sequence[int]  # token ids held in KV positions 0..len-1
    hashes: Sequence[str]  # cumulative hashes of the cached messages (see messages.prefix_hashes)
    msg_ends: Sequence[int]  # tokens that must match for hashes[k] to count as verified
    session: str | None
    last_used: int  # logical clock, larger = more recent
    pending: bool  # a request is building or generating in this slot


@dataclass(frozen=True)
class Plan:
    """How a request will be served.

    ``reuse`` tokens of ``slot``'s KV are kept (after copying them from ``donor`` when
    ``donor`` is set); everything after them is trimmed and the request's remaining
    tokens are prefilled.
    """

    strategy: str
    slot: int
    reuse: int
    donor: int | None = None
    matched_messages: int = 0
    evicted: str | None = None  # session whose conversation the target slot held and loses
    evicted_tokens: int = 0
    common_prefix: dict[int, int] = field(default_factory=dict)  # slot -> shared tokens


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (C-speed slice compares).

    The one such function: token lists, hash lists and strings (template renderings) alike.
    """
    if not (isinstance(a, (str, tuple)) and type(a) is type(b)):
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def reuse_limit(n_tokens: int) -> int:
    """Most prompt positions a request may take from cache: all but the last.

    The last prompt token is always decoded, because its logits give the reply's first
    token; a KV entry alone has no logits.
    """
    return max(n_tokens - 1, 0)


def lru(slots: Sequence[SlotLike]) -> SlotLike:
    """The least recently used slot (lowest index on ties)."""
    return min(slots, key=lambda s: (s.last_used, s.index))


def empty_or_lru(free: Sequence[SlotLike]) -> SlotLike:
    """Where a conversation goes when no slot holds its prefix: an empty slot, else the LRU."""
    return next((s for s in free if not s.tokens), None) or lru(free)


def pick_free(slots: Sequence[SlotLike], session: str | None) -> SlotLike | None:
    """A slot to serve a request that reuses nothing: the session's own, an empty one, else LRU."""
    free = [s for s in slots if not s.pending]
    if not free:
        return None
    if session is not None:
        own = [s for s in free if s.session == session]
        if own:
            return max(own, key=lambda s: s.last_used)
    return empty_or_lru(free)


def select(
    slots: Sequence[SlotLike],
    tokens: Sequence[int],
    hashes: Sequence[str],
    session: str | None = None,
    min_tokens: int = 100,
) -> Plan | None:
    """Choose the slot for a request with prompt ``tokens`` and message prefix ``hashes``.

    1. Hash scan: the slot sharing the longest run of leading messages wins, provided its
       tokens really match up to the end of those messages (a template that renders the
       same messages differently fails this check).
    2. Token scan: otherwise the slot with the longest common token prefix, if at least
       ``min_tokens`` long.
    3. Otherwise an empty slot, else the least recently used one, rebuilt.

    A match that would cut another conversation short is copied into an empty (or the LRU)
    slot instead of trimming the donor in place, so the donor's conversation survives.
    Returns ``None`` when every slot is pending: the caller waits and asks again.
    """
    free = [s for s in slots if not s.pending]
    if not free:
        return None
    tokens = tuple(tokens)
    limit = reuse_limit(len(tokens))
    shared = {s.index: common_prefix(s.tokens, tokens) for s in free if s.tokens}
    for i, n in shared.items():
        log.debug("slot[%d] common-prefix %d/%d tokens", i, n, len(tokens))

    best: tuple | None = None
    for s in free:
        if not s.hashes:
            continue
        k = common_prefix(s.hashes, hashes)
        if k == 0:
            continue
        if shared[s.index] < s.msg_ends[k - 1]:
            log.debug(
                "slot[%d] hash matches %d messages but tokens diverge at %d < %d (template drift)",
                s.index, k, shared[s.index], s.msg_ends[k - 1],
            )
            continue
        score = (k, session is not None and s.session == session, shared[s.index], s.last_used)
        if best is None or score > best[0]:
            best = (score, s, k)
    if best is not None:
        _, donor, k = best
        strategy = HASH_HIT if k >= len(hashes) else HASH_EXTEND
        log.debug("slot[%d] hash match: %d/%d messages", donor.index, k, len(hashes))
        return _place(strategy, donor, min(shared[donor.index], limit), k, free, session, shared)

    log.debug("no slot matched, trying token prefix match")
    cands = [s for s in free if s.tokens and shared[s.index] >= min_tokens]
    if cands:
        donor = max(cands, key=lambda s: (shared[s.index], s.session == session, s.last_used))
        log.debug("token prefix match found: slot[%d] %d tokens", donor.index, shared[donor.index])
        return _place(
            PREFIX_SALVAGE, donor, min(shared[donor.index], limit), 0, free, session, shared
        )
    log.debug("no usable token prefix match (min %d tokens)", min_tokens)

    target = empty_or_lru(free)
    reuse = min(shared.get(target.index, 0), limit)
    return Plan(
        MISS, target.index, reuse,
        evicted=target.session if target.tokens else None,
        evicted_tokens=len(target.tokens) - reuse if target.tokens else 0,
        common_prefix=shared,
    )


def _place(
    strategy: str,
    donor: SlotLike,
    reuse: int,
    matched: int,
    free: Sequence[SlotLike],
    session: str | None,
    shared: dict[int, int],
) -> Plan:
    """Serve in the donor slot, or copy its prefix elsewhere when trimming would lose work."""
    whole = reuse >= len(donor.tokens) - _tail_allowance(donor)
    if whole or (session is not None and donor.session == session):
        return Plan(strategy, donor.index, reuse, None, matched, common_prefix=shared)
    target = empty_or_lru(free)
    if target.index == donor.index:  # no other slot to copy into: cut the donor short
        taken = donor.session is not None and donor.session != session
        return Plan(strategy, donor.index, reuse, None, matched,
                    evicted=donor.session if taken else None,
                    evicted_tokens=len(donor.tokens) - reuse if taken else 0,
                    common_prefix=shared)
    return Plan(
        strategy, target.index, reuse, donor.index, matched,
        evicted=target.session if target.tokens else None,
        evicted_tokens=len(target.tokens),
        common_prefix=shared,
    )


def _tail_allowance(slot: SlotLike) -> int:
    """Tokens at the end of a slot that a continuing request may legitimately re-tokenize.

    A slot's last cached message is often the model's own reply, whose re-tokenized text
    can differ from the generated tokens; losing those few tokens is not a branch.
    """
    if not slot.msg_ends:
        return 0
    return max(len(slot.tokens) - slot.msg_ends[-1], 0)
