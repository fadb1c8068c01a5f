"""Steering llama-server so that the KV it serves is canonical: pure functions, no HTTP.

The in-kernel engine keeps every slot's KV *canonical* (:mod:`nbkv.kv.invariance`): each
prompt row computed in a chunk the calibration proved batch-invariant, and a reply's rows,
decoded one at a time, rewritten as a batch before anything reuses them. llama-server does
neither: with ``cache_prompt`` it keeps the longest common prefix of the slot's tokens and
the new prompt, whatever computed those rows, and prefills the rest from there in pieces of
its physical batch (``-ub``), down to a single row when a regenerated prompt is all cached.

nbkv cannot tell the server where to cut, but it knows what the slot holds, so it can make
the common prefix end where it wants: a *steering* request sends the prompt up to the
canonical start ``r`` followed by one *junk* token that differs from ``prompt[r]``. The
server keeps ``r`` rows, computes the junk row (one row, thrown away by the next request),
and the real request then finds exactly ``r`` rows in common and prefills the rest as a
batch from an aligned position. The same trick re-prefills a finished reply as a batch in
idle time, so that the next turn can keep it (the server's form of the kernel's rewrite).

What the server computes is modelled, not assumed: a prefill of ``[start, end)`` runs in
pieces of ``ubatch`` rows counted from ``start`` (:func:`pieces`), and :func:`settles` says
how many leading rows are canonical afterwards. :data:`UBATCH` is the smallest physical
batch nbkv plans for: a piece boundary of a larger power-of-two batch is also one of it, so
a plan that holds for 256 holds for 512 or 2048.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbkv.kv.invariance import PrefillRule
from nbkv.kv.policy import common_prefix

#: the smallest physical batch (``-ub``) a plan is made for (nbkv's launcher uses it)
UBATCH = 256
#: junk tokens, tried in order: the first that differs from the prompt's token there
JUNK = (0, 1, 2)
#: rows per idle-time rewrite request: what a new request may have to wait for
REWRITE_CHUNK = 64
#: most steering requests before a real request (each is one more round trip)
MAX_STEPS = 4
#: llama-server's ``--slot-prompt-similarity`` default: a request keeping no more than this
#: share of its prompt counts as keeping nothing (and may get a prefix from the prompt cache)
SIMILARITY = 0.1


def pieces(start: int, end: int, ubatch: int = UBATCH) -> list[tuple[int, int]]:
    """The pieces ``(lo, hi)`` in which the server computes rows ``[start, end)``."""
    return [(lo, min(lo + ubatch, end)) for lo in range(start, end, ubatch)]


def settles(start: int, end: int, rule: PrefillRule, *, junk: bool, ubatch: int = UBATCH
            ) -> int | None:
    """The canonical prefix after the server computes rows ``[start, end)`` of a prompt.

    The slot holds ``start`` canonical rows before. ``junk``: one more row follows the
    prompt's rows in the same request (a steering request); it is never canonical, and the
    rows it turns into a batch's remainder are not settled.

    Without junk (the real request, whose last row gives the reply's first token) returns
    None when a row would be computed outside the canonical grouping: the reply would not
    be exact. With junk it never fails: rows that are not canonical are simply not counted.
    """
    a, t = rule.align, rule.threshold
    if start % a:
        return None if not junk else start
    if not junk:
        if start == 0 and 0 < end < t:
            return 0  # a prompt shorter than a chunk: one chunk, exact for itself
        settled = start
        for lo, hi in pieces(start, end, ubatch):
            if hi - lo < t:
                return None
            settled = lo + (hi - lo) // a * a
        return settled
    settled = start
    for lo, hi in pieces(start, end + 1, ubatch):
        rows = hi - lo
        if rows < t:
            return settled
        settled = min(lo + rows // a * a, end)
        if hi < lo + ubatch:
            break
    return settled


def junk_for(tokens: Sequence[int], pos: int) -> int:
    """A junk token for position ``pos``: one that differs from ``tokens[pos]`` (if any)."""
    here = tokens[pos] if pos < len(tokens) else None
    return next(j for j in JUNK if j != here)


@dataclass(frozen=True)
class Step:
    """One request to the server: ``prompt[:end]`` (plus ``junk``) on the pinned slot.

    ``start``: where the server should start computing (its ``timings.cache_n``), and
    ``settled``: the slot's canonical prefix afterwards, if it does. ``fresh`` requests go
    with ``cache_prompt: false`` (the server computes everything from position 0).
    """

    end: int
    junk: int | None  # None: the real request (its reply is the user's)
    start: int
    settled: int
    fresh: bool = False

    @property
    def real(self) -> bool:
        """True for the request itself, False for a steering request."""
        return self.junk is None


def route(tokens: Sequence[int], held: Sequence[int], settled: int, rule: PrefillRule, *,
          ubatch: int = UBATCH, guard_restore: bool = True) -> list[Step] | None:
    """The requests that serve ``tokens`` exactly on a slot holding ``held``.

    ``settled``: leading rows of ``held`` that are canonical. The last step is the real
    request; before it, at most one steering request. Returns None when no plan keeps the
    reply exact (then nothing is claimed).

    ``guard_restore``: the server may have a host-memory prompt cache (``--cache-ram``), from
    which it loads a longer prefix into the slot when a request keeps less than half of the
    slot, or no more than :data:`SIMILARITY` of its prompt. Rows loaded that way under the
    real request would be unproven, so the real request always keeps more than half of the
    slot (a steering request goes first) and more than that share of its prompt (else it is
    computed from scratch, ``cache_prompt: false``, which no load can change).
    """
    n = len(tokens)
    if n == 0:
        return None
    lcp = common_prefix(held, tokens)
    a = rule.align
    r = min(lcp, settled, n - 1) // a * a
    floor = max(0, r - 2 * ubatch)
    while r > floor and not (guard_restore and r <= SIMILARITY * n):
        end = settles(r, n, rule, junk=False, ubatch=ubatch) \
            if n - r >= rule.threshold else None
        if end is not None:
            steer = lcp > r or (guard_restore and 2 * r <= len(held))
            pre = [Step(r, junk_for(tokens, r), r, r)] if steer else []
            return [*pre, Step(n, None, r, end)]
        r -= a
    return fresh_route(tokens, rule, ubatch=ubatch)


def fresh_route(tokens: Sequence[int], rule: PrefillRule, *, ubatch: int = UBATCH
                ) -> list[Step] | None:
    """The requests that compute ``tokens`` from scratch in canonical pieces, or None."""
    n = len(tokens)
    end = settles(0, n, rule, junk=False, ubatch=ubatch)
    if end is not None:
        return [Step(n, None, 0, end, fresh=True)]
    # the last piece from 0 would be too short: prefill up to a point from which the rest
    # is one canonical piece, then the rest
    a = rule.align
    e = (n - rule.threshold) // a * a
    while e > 0:
        last = settles(e, n, rule, junk=False, ubatch=ubatch)
        if last is not None and settles(0, e, rule, junk=True, ubatch=ubatch) == e:
            return [Step(e, junk_for(tokens, e), 0, e, fresh=True), Step(n, None, e, last)]
        e -= a
    return None


def rewrite_route(held: Sequence[int], settled: int, rule: PrefillRule, *,
                  ubatch: int = UBATCH, chunk: int = REWRITE_CHUNK) -> list[Step] | None:
    """Idle-time steps that make more of ``held`` canonical (a reply's rows), or None.

    Cut back to the settled prefix, then prefill the rest as a batch, ``chunk`` rows per
    request (what a new request may have to wait for), each with a junk row after it: the
    server's form of the kernel's rewrite of a reply (:mod:`nbkv.engine.rewrite`).
    """
    h = len(held)
    if h == 0 or settled >= h or any(t < 0 for t in held):
        return None
    a = rule.align
    c = settled // a * a
    if settles(c, h, rule, junk=True, ubatch=ubatch) <= settled:  # type: ignore[operator]
        return None
    step = max(chunk // a * a, rule.min_chunk)
    steps = [Step(c, junk_for(held, c), c, c)]
    pos = c
    while pos < h:
        end = h if h - pos < step + rule.threshold else pos + step
        got = settles(pos, end, rule, junk=True, ubatch=ubatch)
        steps.append(Step(end, junk_for(held, end), pos, got if got is not None else pos))
        pos = end
    return steps


# -- what the server may have copied into its host-memory prompt cache -----------------------


@dataclass
class Offered:
    """A state one of nbkv's slots held when the server may have saved it to ``--cache-ram``."""

    tokens: tuple[Any, ...]
    settled: int  # its canonical prefix
    session: str | None
    hashes: tuple[str, ...] = ()
    msg_ends: tuple[int, ...] = ()
    last_used: int = 0
    key: str = ""  # a name for the policy (nbkv.kv.policy.ParkedLike)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = f"server-ram:{hash(self.tokens) & 0xFFFFFFFF:08x}:{len(self.tokens)}"


class Ledger:
    """Every slot state llama-server may hold in its prompt cache, and its canonical prefix.

    llama-server copies a slot's state into its host-memory cache when a request would keep
    less than half of it, and (``--cache-idle-slots``, its default) every idle slot's state
    whenever a task starts; a later request may get any of them back. They all came from
    nbkv's own slots (another client's use is detected separately), so a restore is proven
    canonical up to the shortest canonical prefix of the states it may have come from.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._states: OrderedDict[tuple[int, ...], Offered] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def offer(self, state: Offered) -> None:
        """``state`` may have been copied into the server's cache (the least canonical wins)."""
        if not state.tokens or any(t < 0 for t in state.tokens):
            return
        old = self._states.pop(state.tokens, None)
        if old is not None:  # its first owner keeps it (a request may have claimed the slot)
            state = Offered(old.tokens, min(old.settled, state.settled), old.session,
                            old.hashes, old.msg_ends, max(old.last_used, state.last_used))
        self._states[state.tokens] = state
        while len(self._states) > self.size:
            self._states.popitem(last=False)

    def entries(self) -> list[Offered]:
        """The states, oldest first."""
        return list(self._states.values())

    def fits(self, sent: Sequence[int], cached: int) -> list[Offered]:
        """The states a restore that left ``cached`` rows of ``sent`` may have come from."""
        sent = tuple(sent)
        out = []
        for s in self._states.values():
            k = common_prefix(s.tokens, sent)
            if k == cached or (cached == len(sent) - 1 and k == len(sent)):
                out.append(s)
        return out

    def proven(self, sent: Sequence[int], cached: int) -> int:
        """Canonical rows of a restore that left ``cached`` rows of ``sent`` in the slot.

        The server restored a state whose common prefix with ``sent`` is ``cached`` rows
        (that is how it counts them); every state that fits is a candidate, and the rows are
        proven up to the shortest canonical prefix among them (0 when none fits: a state
        nbkv does not know, e.g. from another client).
        """
        fits = [s.settled for s in self.fits(sent, cached)]
        return min(min(fits), cached) if fits else 0

    def forget(self) -> None:
        """The server's cache is gone (a restart)."""
        self._states.clear()


def observed(sent: Sequence[int], told: int, held: Sequence[int], settled: int,
             rule: PrefillRule, *, junk: bool, ubatch: int = UBATCH,
             proven: int | None = None) -> tuple[int, bool]:
    """What a request did to the slot, from the rows the server says it kept (``told``).

    ``held`` and ``settled``: the slot before the request. ``proven``: when the server kept
    more rows than the slot shared with ``sent`` (it loaded a state from its prompt cache),
    how many of them are proven canonical (:meth:`Ledger.proven`); None when no cache can
    explain it. Returns the slot's canonical prefix afterwards, and whether every row the
    request used was canonical (for the real request: its reply is exact).
    """
    end = len(sent) - (1 if junk else 0)
    shared = common_prefix(held, sent)
    if told > shared:
        if proven is None or proven < told:
            return min(proven or 0, told, settled) // rule.align * rule.align, False
    elif told > settled:
        return settled, False  # the server kept rows nbkv knows are not canonical
    if junk:
        got = settles(told, end, rule, junk=True, ubatch=ubatch)
        return (told if got is None else got), True
    after = settles(told, end, rule, junk=False, ubatch=ubatch)
    if after is None:
        return told // rule.align * rule.align, False
    return after, True
