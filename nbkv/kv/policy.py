"""Slot selection for the Incremental Message Cache: pure logic, no model, no llama.cpp.

A slot is anything with the attributes of :class:`SlotLike`. :func:`select` decides which
slot serves a request and how many of its cached tokens survive; the engine carries the
decision out (trim, copy, prefill). Keeping it pure makes every rule testable without a model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nbkv.core.codes import HASH_EXTEND, HASH_HIT, MISS, PREFIX_SALVAGE, common_prefix

log = logging.getLogger("nbkv.kv.policy")

__all__ = ["HASH_EXTEND", "HASH_HIT", "MISS", "PREFIX_SALVAGE", "common_prefix"]


class SlotLike(Protocol):
    """What the policy reads from a slot (read-only: snapshots are frozen)."""

    @property
    def index(self) -> int: ...
    @property
    def tokens(self) -> Sequence[Any]:
        """Token ids (or media units) held in KV positions 0..len-1."""
    @property
    def hashes(self) -> Sequence[str]:
        """Cumulative hashes of the cached messages (see ``messages.prefix_hashes``)."""
    @property
    def msg_ends(self) -> Sequence[int]:
        """Tokens that must match for ``hashes[k]`` to count as verified."""
    @property
    def session(self) -> str | None: ...
    @property
    def last_used(self) -> int:
        """Logical clock, larger = more recent."""
    @property
    def pending(self) -> bool:
        """A request is building or generating in this slot."""


@dataclass(frozen=True)
class Plan:
    """How a request will be served.

    ``reuse`` tokens of ``slot``'s KV are kept (after copying them from ``donor`` when
    ``donor`` is set, or restoring the parked conversation ``parked`` into the slot);
    everything after them is trimmed and the request's remaining tokens are prefilled.
    """

    strategy: str
    slot: int
    reuse: int
    donor: int | None = None
    matched_messages: int = 0
    evicted: str | None = None  # session whose conversation the target slot held and loses
    evicted_tokens: int = 0
    common_prefix: dict[int, int] = field(default_factory=dict)  # slot -> shared tokens
    parked: str | None = None  # key of the parked conversation restored into ``slot`` first


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


class ParkedLike(Protocol):
    """What the policy reads from a parked conversation (:class:`nbkv.store.parked.ParkedInfo`)."""

    key: str
    tokens: Sequence[Any]
    hashes: Sequence[str]
    msg_ends: Sequence[int]
    session: str | None
    last_used: int


def select(
    slots: Sequence[SlotLike],
    tokens: Sequence[int],
    hashes: Sequence[str],
    session: str | None = None,
    min_tokens: int = 100,
    parked: Sequence[ParkedLike] = (),
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

    ``parked`` conversations (any session's) are scanned the same way; the best one is
    restored into the slot a miss would take (``Plan.parked``) when it keeps strictly more
    tokens than the best choice among the slots.
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
    plan = _from_slots(free, tokens, hashes, session, min_tokens, limit, shared)
    if not parked:
        return plan
    kept = {p.key: common_prefix(p.tokens, tokens) for p in parked}
    found = _match(parked, kept, lambda p: p.key, hashes, session, min_tokens, "parked[%s]")
    if found is None:
        return plan
    entry, k = found
    reuse = min(kept[entry.key], limit)
    if reuse <= plan.reuse:
        log.debug("parked[%s] keeps %d tokens, a slot %d: not restored", entry.key, reuse,
                  plan.reuse)
        return plan
    target = empty_or_lru(free)
    log.debug("parked[%s] restored into slot[%d]: %d tokens", entry.key, target.index, reuse)
    return Plan(_strategy(k, hashes), target.index, reuse, None, k,
                evicted=target.session if target.tokens else None,
                evicted_tokens=len(target.tokens), common_prefix=shared, parked=entry.key)


def _strategy(matched: int, hashes: Sequence[str]) -> str:
    if not matched:
        return PREFIX_SALVAGE
    return HASH_HIT if matched >= len(hashes) else HASH_EXTEND


def _match(cands: Sequence[Any], shared: dict[Any, int], ident: Callable[[Any], Any],
           hashes: Sequence[str], session: str | None, min_tokens: int, label: str
           ) -> tuple[Any, int] | None:
    """The best candidate and the messages it matches (0: a token prefix only), or None.

    ``shared[ident(c)]`` is candidate ``c``'s common token prefix with the prompt.
    """
    best: tuple[Any, ...] | None = None
    for c in cands:
        if not c.hashes:
            continue
        k = common_prefix(c.hashes, hashes)
        if k == 0:
            continue
        n = shared.get(ident(c), 0)
        if n < c.msg_ends[k - 1]:
            log.debug(label + " hash matches %d messages but tokens diverge at %d < %d "
                      "(template drift)", ident(c), k, n, c.msg_ends[k - 1])
            continue
        score = (k, session is not None and c.session == session, n, c.last_used)
        if best is None or score > best[0]:
            best = (score, c, k)
    if best is not None:
        log.debug(label + " hash match: %d/%d messages", ident(best[1]), best[2], len(hashes))
        return best[1], best[2]
    ok = [c for c in cands if c.tokens and shared.get(ident(c), 0) >= min_tokens]
    if not ok:
        log.debug("no usable token prefix match (min %d tokens)", min_tokens)
        return None
    c = max(ok, key=lambda c: (shared[ident(c)], c.session == session, c.last_used))
    log.debug(label + " token prefix match: %d tokens", ident(c), shared[ident(c)])
    return c, 0


def _from_slots(free: Sequence[SlotLike], tokens: tuple[Any, ...], hashes: Sequence[str],
                session: str | None, min_tokens: int, limit: int, shared: dict[int, int]
                ) -> Plan:
    """The best plan among the slots alone (:func:`select`'s steps 1 to 3)."""
    found = _match(free, shared, lambda s: s.index, hashes, session, min_tokens, "slot[%d]")
    if found is not None:
        donor, k = found
        return _place(_strategy(k, hashes), donor, min(shared[donor.index], limit), k, free,
                      session, shared)
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
