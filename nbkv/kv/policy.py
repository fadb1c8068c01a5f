"""Slot selection for the Incremental Message Cache: pure logic, no model, no llama.cpp.

A slot is anything with the attributes of :class:`SlotLike`. :func:`select` decides which
slot serves a request and how many of its cached tokens survive; the engine carries the
decision out (trim, copy, prefill). Keeping it pure makes every rule testable without a model.

What a candidate (a slot, a parked conversation, a donor) can really serve of the prompt it
shares a prefix with: in exact mode only its *settled* KV counts; a prefill must begin where
the canonical grouping allows (:func:`nbkv.kv.invariance.valid_start`); and the memory must
be able to go back there:

- ``plain`` attention cuts anywhere;
- ``sliding-window`` memory cuts anywhere its sliding-window layers still hold the window
  before the cut. A live slot keeps every cell (llama.cpp's full-size SWA cache), but a
  state put back from RAM, disk or a save holds only the window before its end
  (llama.cpp writes only those cells), so it cuts only at its end, or at a checkpoint;
- ``hybrid`` and ``recurrent`` memory cut only at a checkpoint (or not at all).

:func:`reach` is that decision, which :func:`nbkv.kv.slot_kv.trim_valid` carries out on the
KV; :class:`Judge` applies it to the candidates, so that :func:`select` compares what each
option would really keep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nbkv.core.events import HASH_EXTEND, HASH_HIT, MISS, PREFIX_SALVAGE, common_prefix
from nbkv.kv import invariance

log = logging.getLogger("nbkv.kv.policy")

__all__ = ["HASH_EXTEND", "HASH_HIT", "MISS", "PREFIX_SALVAGE", "common_prefix"]


class Held(Protocol):
    """What the policy reads from any conversation held in KV: a slot's or a parked one.

    Read-only (properties), so frozen records (snapshots, :class:`nbkv.store.parked.ParkedInfo`)
    fit.
    """

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


class SlotLike(Held, Protocol):
    """What the policy reads from a slot (read-only: snapshots are frozen)."""

    @property
    def index(self) -> int: ...
    @property
    def pending(self) -> bool:
        """A request is building or generating in this slot."""


@dataclass(frozen=True)
class Plan:
    """How a request will be served.

    ``reuse`` tokens of ``slot``'s KV are shared with the prompt (after copying them from
    ``donor`` when ``donor`` is set, or restoring the parked conversation ``parked`` into the
    slot); ``served`` of them can really be kept (settled KV, where a canonical prefill may
    begin, where the memory can be cut: :class:`nbkv.kv.policy.Judge`). Everything after is
    trimmed and the request's remaining tokens are prefilled.
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
    served: int = -1  # what the chosen option really serves (-1: ``reuse``; see Judge)

    def __post_init__(self) -> None:
        if self.served < 0:
            object.__setattr__(self, "served", self.reuse)


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


class ParkedLike(Held, Protocol):
    """What the policy reads from a parked conversation (:class:`nbkv.store.parked.ParkedInfo`)."""

    @property
    def key(self) -> str:
        """The entry's key in the parking lot."""


#: how a candidate would serve a request: kept in its slot, copied into another slot, or a
#: parked conversation put back whole into a slot
IN_PLACE, COPY, RESTORE = "in-place", "copy", "restore"

#: positions a copy from another slot must serve beyond what a slot serves in place to be
#: chosen: llama.cpp copies a slot's whole KV stream (all of its cells, used or not), whose
#: cost is a few tokens of prefill on ~4k-position slots (the docs' measurement notes)
COPY_MARGIN = 32

#: ``judge(candidate, shared, how)``: the positions ``candidate`` really serves when it shares
#: ``shared`` of the prompt (already capped by :func:`reuse_limit`), served ``how``
#: (:class:`Judge`: settled KV, the canonical grouping, the memory class)
Serves = Callable[[Any, int, str], int]


def select(
    slots: Sequence[SlotLike],
    tokens: Sequence[int],
    hashes: Sequence[str],
    session: str | None = None,
    min_tokens: int = 100,
    parked: Sequence[ParkedLike] = (),
    judge: Serves | None = None,
) -> Plan | None:
    """Choose the slot for a request with prompt ``tokens`` and message prefix ``hashes``.

    Every free slot and parked conversation sharing a prefix with the prompt is a candidate
    when it shares at least one whole message (its message hashes match *and* its tokens
    really match up to the end of those messages: a template that renders the same messages
    differently matches fewer of them) or ``min_tokens`` tokens. Each is scored by what it
    really serves, as it would be used: ``judge`` says so (by default, the shared prefix).

    1. Among the slots, the one serving the most wins (then: the session's own, more
       messages, more recent). A match that would cut another conversation short is copied
       into an empty (or the least recently used) slot instead, so that conversation
       survives; the score is the copy's, and it must beat serving in place by
       :data:`COPY_MARGIN` positions.
    2. Otherwise an empty slot, else the least recently used one, is rebuilt.
    3. The best parked conversation is restored into the slot a miss would take
       (``Plan.parked``) when it serves strictly more than the slots' best plan: a restore
       that cannot be served never beats a continuation or a copy.

    On a tie, the session's own parked conversation wins over another session's slot: it is
    the same KV, and the other conversation keeps its slot.

    Returns ``None`` when every slot is pending: the caller waits and asks again.
    """
    free = [s for s in slots if not s.pending]
    if not free:
        return None
    tokens = tuple(tokens)
    limit = reuse_limit(len(tokens))
    score = judge or (lambda c, n, how: n)
    shared = {s.index: common_prefix(s.tokens, tokens) for s in free if s.tokens}
    for i, n in shared.items():
        log.debug("slot[%d] common-prefix %d/%d tokens", i, n, len(tokens))
    plan = _from_slots(free, hashes, session, min_tokens, limit, shared, score)
    if not parked:
        return plan
    best: tuple[Any, ...] | None = None
    for p in parked:
        n = common_prefix(p.tokens, tokens)
        k = _verified(p, n, hashes)
        if not p.tokens or (k == 0 and n < min_tokens):
            continue
        served = score(p, min(n, limit), RESTORE)
        log.debug("parked[%s] shares %d tokens, %d messages; serves %d", p.key, n, k, served)
        key = (served, session is not None and p.session == session, k, p.last_used)
        if best is None or key > best[0]:
            best = (key, p, k, min(n, limit))
    if best is None:
        return plan
    (served, *_), entry, k, reuse = best
    holder = plan.donor if plan.donor is not None else plan.slot
    theirs = next((s.session for s in free if s.index == holder), None) != session
    own = session is not None and entry.session == session and theirs
    if served < plan.served or (served == plan.served and not own):
        log.debug("parked[%s] serves %d tokens, a slot %d: not restored", entry.key, served,
                  plan.served)
        return plan
    target = empty_or_lru(free)
    log.debug("parked[%s] restored into slot[%d]: %d tokens", entry.key, target.index, served)
    return Plan(_strategy(k, hashes), target.index, reuse, None, k,
                evicted=target.session if target.tokens else None,
                evicted_tokens=len(target.tokens), common_prefix=shared, parked=entry.key,
                served=served)


def _strategy(matched: int, hashes: Sequence[str]) -> str:
    if not matched:
        return PREFIX_SALVAGE
    return HASH_HIT if matched >= len(hashes) else HASH_EXTEND


def _verified(c: Any, n: int, hashes: Sequence[str]) -> int:
    """Leading messages ``c`` shares with the prompt: hashes equal, and tokens up to their end.

    ``n`` is ``c``'s common token prefix with the prompt. Where the hashes match further than
    the tokens (a template drift, or a reply whose start re-tokenizes differently), only the
    messages the tokens confirm count.
    """
    if not c.hashes:
        return 0
    k = common_prefix(c.hashes, hashes)
    while k and n < c.msg_ends[k - 1]:
        k -= 1
    return k


def _from_slots(free: Sequence[SlotLike], hashes: Sequence[str], session: str | None,
                min_tokens: int, limit: int, shared: dict[int, int], score: Serves) -> Plan:
    """The best plan among the slots alone (:func:`select`'s steps 1 and 2)."""
    best: tuple[Any, ...] | None = None
    for s in free:
        n = shared.get(s.index, 0)
        k = _verified(s, n, hashes)
        if not n or (k == 0 and n < min_tokens):
            continue
        reuse = min(n, limit)
        target = _copy_target(s, reuse, n, session, free)
        served = score(s, reuse, IN_PLACE if target is None else COPY)
        log.debug("slot[%d] shares %d tokens, %d messages; serves %d%s", s.index, n, k, served,
                  "" if target is None else f" copied into slot[{target.index}]")
        # a copy moves the donor's whole KV stream: it must serve clearly more
        bonus = COPY_MARGIN if target is None else 0
        key = (served + bonus, session is not None and s.session == session, k, s.last_used)
        if served and (best is None or key > best[0]):
            best = (key, s, k, reuse, target, served)
    if best is not None:
        _, donor, k, reuse, target, served = best
        strategy = _strategy(k, hashes)
        if target is None:
            taken = donor.session is not None and donor.session != session and (
                reuse < len(donor.tokens) - _tail_allowance(donor))
            return Plan(strategy, donor.index, reuse, None, k,
                        evicted=donor.session if taken else None,
                        evicted_tokens=len(donor.tokens) - reuse if taken else 0,
                        common_prefix=shared, served=served)
        return Plan(strategy, target.index, reuse, donor.index, k,
                    evicted=target.session if target.tokens else None,
                    evicted_tokens=len(target.tokens), common_prefix=shared, served=served)
    target = empty_or_lru(free)
    reuse = min(shared.get(target.index, 0), limit)
    served = score(target, reuse, IN_PLACE) if reuse else 0
    return Plan(
        MISS, target.index, reuse,
        evicted=target.session if target.tokens else None,
        evicted_tokens=len(target.tokens) - reuse if target.tokens else 0,
        common_prefix=shared, served=served,
    )


def _copy_target(donor: SlotLike, reuse: int, shared: int, session: str | None,
                 free: Sequence[SlotLike]) -> SlotLike | None:
    """Where ``donor``'s prefix is copied to serve the request; None: served in place.

    In place when the request carries the donor's conversation on (``reuse`` keeps all of
    it; or it is the session's own), or when there is no other slot to copy into (the donor
    is cut short: the plan says whose conversation that evicts). An unnamed request that
    sends an unnamed slot's whole prompt again (all ``shared`` tokens, before
    :func:`reuse_limit`'s cap) is that conversation's own re-run: in place too. Another
    session's exact prompt is copied, and leaves that session its slot.
    """
    held = len(donor.tokens) - _tail_allowance(donor)
    whole = reuse >= held or (session is None and donor.session is None and shared >= held)
    if whole or (session is not None and donor.session == session):
        return None
    target = empty_or_lru(free)
    return None if target.index == donor.index else target


def _tail_allowance(slot: SlotLike) -> int:
    """Tokens at the end of a slot that a continuing request may legitimately re-tokenize.

    A slot's last cached message is often the model's own reply, whose re-tokenized text
    can differ from the generated tokens; losing those few tokens is not a branch.
    """
    if not slot.msg_ends:
        return 0
    return max(len(slot.tokens) - slot.msg_ends[-1], 0)


def takes_parked(entry: ParkedLike, session: str | None, tokens: Sequence[Any]) -> bool:
    """A request restoring parked ``entry`` takes it out of the lot (else it reads a copy).

    Its own session takes its conversation back; an unnamed request takes an unnamed entry
    only when its prompt carries all of it on. Any other conversation that starts the same
    way (a shared system prompt) restores a copy and leaves the entry parked.
    """
    if entry.session is not None:
        return entry.session == session
    if session is not None:
        return False
    end = entry.msg_ends[-1] if entry.msg_ends else len(entry.tokens)
    return common_prefix(entry.tokens, tokens) >= end


# -- what a candidate can really serve (see the module docstring) --------------------------

PLAIN, SWA, HYBRID, RECURRENT = "plain", "sliding-window", "hybrid", "recurrent"
MEMORY_CLASSES = (PLAIN, SWA, HYBRID, RECURRENT)

NO_CUT = 1 << 62  # a floor no cut reaches: only the end itself, or a checkpoint

#: llama.cpp writes a restored window into the first cells of the sequence's KV stream,
#: where a from-scratch decode has position ``p`` in cell ``p``; the CPU attention kernels
#: sum the cells in SIMD lanes (16 floats with AVX-512, 8 with AVX2), so later tokens
#: compute bit-identically only when the window starts a multiple of this many cells away
#: (the docs' model families page)
SWA_CELLS = 16


def restorable(kind: str, n_swa: int, pos: int) -> bool:
    """A whole state (or a checkpoint) of ``pos`` positions continues exactly once put back.

    Always on memory other than sliding-window; there, when the window is all of it
    (``pos <= n_swa``) or starts a multiple of :data:`SWA_CELLS` cells in.
    """
    return kind != SWA or pos <= n_swa or (pos - n_swa) % SWA_CELLS == 0


def restore_point(units: Sequence[Any], pos: int, rule: invariance.PrefillRule, kind: str,
                  n_swa: int) -> int:
    """The largest position ``<= pos`` where ``units``' KV can be saved and put back exactly.

    A settled chunk end (:func:`nbkv.kv.invariance.stable_end`) that is
    :func:`restorable`; 0 if there is none.
    """
    q = invariance.stable_end(units, max(0, min(pos, len(units))), rule)
    while q > 0 and not (invariance.stable_end(units, q, rule) == q
                         and restorable(kind, n_swa, q)):
        q -= 1
    return q


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
    ``checkpoints`` (positions); a slot also its ``cut_floor``. How it would serve matters:
    a parked conversation is put back whole (:func:`restored_floor`); a copy of
    sliding-window memory cannot go back to a checkpoint (:meth:`nbkv.kv.slot_kv.SlotKV.
    copy_from`: the copied cells arrive with the next decode, after any checkpoint).
    """

    units: Sequence[Any]
    rule: invariance.PrefillRule
    exact: bool
    kind: str
    n_swa: int = 0

    def __call__(self, c: Any, want: int, how: str) -> int:
        """Positions ``c`` serves of the ``want`` it shares, used ``how`` (policy.IN_PLACE...)."""
        n = len(c.tokens)
        if want <= 0 or n == 0:
            return 0
        limit = min(want, getattr(c, "settled", n) if self.exact else n)
        cps = () if how == COPY and self.kind == SWA else tuple(c.checkpoints)
        if how != RESTORE:
            return reach(self.units, limit, self.rule, n, getattr(c, "cut_floor", 0), cps)
        if not restorable(self.kind, self.n_swa, n):  # put back, it goes to a checkpoint
            cps = tuple(x for x in cps if restorable(self.kind, self.n_swa, x))
            return reach(self.units, min(limit, max(cps, default=0)), self.rule, n, NO_CUT,
                         cps)
        return reach(self.units, limit, self.rule, n, restored_floor(self.kind, self.n_swa, n),
                     cps)
