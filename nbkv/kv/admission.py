"""A request's admission as data: where its reused KV comes from and the KV steps, in order.

The policy (:func:`nbkv.kv.policy.select`) chooses the slot and the candidate; :func:`admit`
turns that choice into one complete decision, an :class:`Admission`: its source, the ordered
KV steps that make the slot hold exactly the reusable prefix, and the length kept. It is pure
(no model, no llama.cpp): the engine's executor (:mod:`nbkv.engine.placement`) applies the steps
in the order stated, and the request's record is built from the admission and the outcome.
Its reason is decided here too (:func:`decide`): the code and the facts its words need, from
the admission, what the steps kept and what the engine remembers of the session (a
:class:`Story`, with the session's :class:`Whereabouts`); :func:`words` puts a decided
:class:`Decision` into plain words and derives nothing. Token text is detokenized only when
someone asks (:meth:`Divergence.excerpts`).

The steps, always in this order (:data:`STEP_ORDER`): the conversation the slot held is
parked (a read of its state); a parked conversation is restored into it (a whole-state
write); a donor's prefix is copied into it; the system prompt's state is loaded (SPC) or the
slot cleared (cache off); the branch an edit leaves is parked (where the first step parked
nothing; of a parked conversation taken back, the entry itself); the slot is trimmed to what
is kept. A reply the slot already holds for this very prompt (a replay) ends the steps before
the branch is parked.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbkv.core.events import (
    CHECKPOINT,
    CLEARED,
    CONTINUED,
    COPIED,
    EDITED,
    EVICTED,
    FIRST,
    IMAGE_CHANGED,
    OVERFLOW,
    PARKED,
    PROVEN,
    RELOADED,
    REPLAYED,
    RESTORED,
    REUSED,
    SHARED,
    SYSTEM_CHANGED,
    TEMPLATE_DRIFT,
    UNCACHED,
    WINDOW,
    Divergence,
    common_prefix,
    counted,
    tier_words,
)
from nbkv.kv import invariance, policy

#: the reason codes (defined with the records, :mod:`nbkv.core.events`) are read from here
#: with the admission that decides them
__all__ = ["CHECKPOINT", "CLEARED", "CONTINUED", "COPIED", "EDITED", "EVICTED", "FIRST",
           "IMAGE_CHANGED", "OVERFLOW", "PARKED", "PROVEN", "RELOADED", "REPLAYED", "RESTORED",
           "SHARED", "SYSTEM_CHANGED", "TEMPLATE_DRIFT", "UNCACHED", "Admission", "Cached",
           "Decision", "Divergence", "Explanation", "Holder", "Reason", "Restored", "Story",
           "Whereabouts", "admit", "decide", "displaced", "explain_request", "find_divergence",
           "reply_reuse", "words"]


@dataclass(frozen=True)
class Reason:
    """A request's reason code, the details in plain words, and the divergence point if any.

    ``text`` reads after the code's words (:func:`nbkv.ui.vocabulary.reason_line`).
    """

    code: str
    text: str
    divergence: Divergence | None = None


@dataclass
class Whereabouts:
    """What the engine remembers of a session: its last request, and its slot's fate since."""

    request: int
    #: EVICTED, CLEARED, PROVEN or RELOADED once the conversation was lost; PARKED when the request
    #: that took its slot parked it (:mod:`nbkv.store.parking`)
    fate: str | None = None
    by_session: str | None = None
    by_request: int | None = None
    slot: int | None = None  # the slot that was taken
    first: str | None = None  # hash of the lost conversation's first message


@dataclass(frozen=True)
class Cached:
    """The session's own slot as it was when the request arrived."""

    tokens: Sequence[Any]
    hashes: Sequence[str]
    msg_ends: Sequence[int]


@dataclass(frozen=True)
class Restored:
    """The parked conversation a request restored into its slot (:mod:`nbkv.store.parking`)."""

    session: str | None  # whose conversation it was
    tier: str  # where it was parked: "ram" or "disk"
    cached: Cached  # what it held


@dataclass(frozen=True)
class Decision:
    """A request's reason as decided (:func:`nbkv.kv.admission.decide`): its code and facts.

    :func:`words` puts it into words and derives nothing. ``basis`` is, under
    :data:`CHECKPOINT`, the code whose words come first; ``shortfall`` the tokens a
    checkpoint further back cost (0: none). ``donor`` is the session the kept tokens were
    copied from, where the words say so; ``parked`` (:data:`EVICTED` after a park) says
    whether the parked state was ``"still"`` there or ``"gone"``; ``trace`` is what took
    the session's slot, where the words tell it; ``own``: the conversation restored was
    the session's own.
    """

    code: str
    session: str | None = None
    reuse: int = 0
    divergence: Divergence | None = None
    basis: str = ""
    shortfall: int = 0
    donor: str | None = None
    cache: str = "imc"
    dropped: int = 0
    trace: Whereabouts | None = None
    parked: str = ""
    kept_from: str | None = None
    restored: Restored | None = None
    own: bool = False


def _whose(session: str | None) -> str:
    """``bob's``, or ``an unnamed`` for a request without a session."""
    return f"{session}'s" if session is not None else "an unnamed"


def words(d: Decision) -> Reason:
    """``d`` in plain words: the :class:`Reason` a record carries."""
    who = f"session {d.session}" if d.session is not None else "this request"
    text = _lost(d, who) if d.code in (EVICTED, CLEARED, PROVEN, RELOADED) else _words(d, who)
    if d.shortfall:
        text += (f"; this model's memory cannot be cut there, so a checkpoint {d.shortfall} "
                 "tokens earlier was restored")
    return Reason(d.code, text, d.divergence)


def _words(d: Decision, who: str) -> str:
    code, div, copied = d.basis or d.code, d.divergence, _copied(d)
    if code == UNCACHED:
        return f"cache mode {d.cache}: conversations are not kept between requests"
    if code == OVERFLOW:
        oldest = ("the oldest message was" if d.dropped == 1
                  else f"the {d.dropped} oldest messages were")
        return (f"the conversation outgrew its slot: {oldest} dropped, so the cache matched "
                f"only up to where they were{copied}")
    if code == RESTORED:
        return _restored_words(d, who)
    if code == COPIED and not d.own:
        return (f"{who} was not cached; its first {d.reuse} tokens (the shared start) were "
                f"copied from {d.donor}'s slot")
    if code == COPIED:
        what = (f"{who}'s own slot served less of this prompt than {d.donor}'s, so its first "
                f"{d.reuse} tokens were copied from there")
        return what if div is None else (f"{what} (its own slot leaves the prompt in message "
                                         f"{div.message} ({div.role}), token {div.position})")
    if code == SHARED:
        held = f"{d.kept_from}'s conversation" if d.kept_from else "another conversation"
        return (f"{who} was not cached; the slot it got held {held}, whose first {d.reuse} "
                f"tokens it shares, so those were kept")
    if code == FIRST:
        return f"nothing of {who} was cached"
    if code == CONTINUED or div is None:
        return f"everything cached for {who} was reused"
    k = div.message
    if code == TEMPLATE_DRIFT:
        return (f"the same messages rendered to different tokens in message {k} ({div.role}), "
                f"token {div.position}")
    if code == IMAGE_CHANGED:
        return f"a different image in message {k} ({div.role}), token {div.position}"
    if code == SYSTEM_CHANGED:
        return f"the system prompt changed at token {div.position}"
    return (f"kept {counted(k, 'message')}, re-read from message {k} ({div.role}, edited) at "
            f"token {div.position}")


def _copied(d: Decision) -> str:
    return (f"; its first {d.reuse} tokens were copied from {d.donor}'s slot"
            if d.donor is not None else "")


def _lost(d: Decision, who: str) -> str:
    """The words when the session's conversation left its slot (evicted, cleared, ...)."""
    copied, trace = _copied(d), d.trace
    if d.code == EVICTED and trace is not None:
        parked = ""
        if d.parked == "still":
            parked = (" and its conversation parked, but the parked state could not serve "
                      "this prompt")
        elif d.parked:
            parked = (" and its conversation parked, but the parked copy was gone (over the "
                      "parking budget, or unreadable)")
        return (f"{who}'s slot was taken by {_whose(trace.by_session)} request "
                f"#{trace.by_request}{parked}, so its conversation was read again{copied}")
    if d.code == CLEARED:
        return (f"{who}'s slot was cleared by the user, so its conversation was read "
                f"again{copied}")
    if d.code == PROVEN:
        return (f"nbkv proved this model's exact grouping in the background since {who}'s "
                "last turn, and dropped what it had cached before (grouped the unproven way), "
                f"so the conversation was read again{copied}")
    return (f"the engine was loaded again since {who}'s last turn: its cache started empty, "
            f"so the conversation was read again{copied}")


def _restored_words(d: Decision, who: str) -> str:
    """``alice's conversation was parked when bob's request #5 took slot 0; restored ...``."""
    r, reuse, trace = d.restored, d.reuse, d.trace
    assert r is not None
    where = tier_words(r.tier)
    if not d.own:
        owner = f"{r.session}'s" if r.session is not None else "a"
        return (f"{who} was not cached; {reuse:,} tokens of {owner} parked conversation were "
                f"restored from {where}")
    total = len(r.cached.tokens)
    amount = f"its {reuse:,} tokens" if reuse == total else f"{reuse:,} of its {total:,} tokens"
    when = ""
    if trace is not None:
        slot = f"slot {trace.slot}" if trace.slot is not None else "its slot"
        when = f" when {_whose(trace.by_session)} request #{trace.by_request} took {slot}"
    text = f"{who}'s conversation was parked{when}; restored {amount} from {where}"
    if not reuse:
        text = (f"{who}'s conversation was parked{when}, but its state from {where} could not "
                f"be cut back to where this prompt leaves it (no checkpoint before that "
                f"point), so it was read again")
    div = d.divergence
    if div is not None:
        text += f", then read on from message {div.message} ({div.role}), token {div.position}"
    return text


@dataclass(frozen=True)
class Explanation:
    """What :meth:`nbkv.Engine.explain` returns: a record and both renderings.

    ``cached_head`` equals ``new_head`` (the shared part); ``cached_tail`` and ``new_tail``
    are where they part.
    """

    record: Any  # nbkv.core.events.RequestRecord
    cached_head: str
    cached_tail: str
    new_head: str
    new_tail: str
    #: what became of ``cached_tail``: "trimmed" (cut from the slot), or "reused" for a
    #: replayed request (its reply given again, the later turns kept)
    tail_state: str = "trimmed"


#: requests whose cached and new units are kept for :func:`explain_request`
EXPLAINED = 32


def explain_request(records: Sequence[Any], compared: Mapping[int, tuple[Sequence[Any],
                    Sequence[Any]]], text_of: Callable[[Sequence[Any]], str],
                    request: int | None = None) -> Explanation:
    """The story of request ``request`` (default: the latest) from the engine's history.

    ``compared`` maps a request id to (the cached units it was compared with, its prompt);
    ``text_of`` renders units as text. Raises ``InvalidRequestError`` when there is nothing
    to explain.
    """
    from nbkv.core.errors import InvalidRequestError

    if not records:
        raise InvalidRequestError("no request yet: nothing to explain")
    rec = records[-1] if request is None else next(
        (r for r in records if r.id == request), None)
    if rec is None:
        raise InvalidRequestError(f"no request #{request} in the history")
    pair = compared.get(rec.id)
    if pair is None:
        raise InvalidRequestError(
            f"request #{rec.id} is too old to explain (the last {EXPLAINED} are kept)")
    cached, new = pair
    cut = rec.divergence.position if rec.divergence is not None else min(
        common_prefix(cached, new), len(cached))
    return Explanation(rec, text_of(cached[:cut]), text_of(cached[cut:]), text_of(new[:cut]),
                       text_of(new[cut:]),
                       REUSED if getattr(rec, "reason", "") == REPLAYED else "trimmed")


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
    ``held_by`` is the session the slot held (whose conversation a park displaces),
    ``donor_session`` the donor's, ``cache`` the engine's mode.
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
    held_by: str | None = None
    donor_session: str | None = None
    cache: str = "imc"

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
    elif cache == "imc" and donor is None and (taken or not restoring):
        # an edit: its old branch's replies stay (an entry read as a copy stays parked anyway)
        steps.append(PARK_BRANCH)
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
                     prev_len, prev_prompt_len, slot.session,
                     donor.session if donor is not None else None, cache)


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


@dataclass(frozen=True)
class Story:
    """What the engine knows of a request beyond its admission, for the reason's decision.

    The prompt's units, message hashes, ends, roles and the messages it dropped; ``trace``
    what became of the session's slot (:class:`~nbkv.kv.Whereabouts`); ``own`` the
    session's slot if it still holds the conversation; ``cache`` the engine's mode;
    ``kept_from`` whose conversation the target slot held; ``still_parked``: the session's
    conversation is parked (though it could not serve this prompt).
    """

    session: str | None
    tokens: Sequence[Any]
    hashes: Sequence[str]
    ends: Sequence[int]
    roles: Sequence[str]
    dropped: int = 0
    trace: Whereabouts | None = None
    own: Cached | None = None
    cache: str = "imc"
    kept_from: str | None = None
    still_parked: bool = False


def decide(s: Story, *, reuse: int, wanted: int, donor_session: str | None = None,
           can_trim: bool = True, restored: Restored | None = None
           ) -> Decision:
    """Why a request placed with ``reuse`` tokens of KV kept kept them: its reason code.

    ``wanted`` is what the placement would have kept on memory that can be cut anywhere
    (``reuse`` is less where ``can_trim`` is False and a checkpoint further back was
    restored); ``donor_session`` whose slot the kept tokens were copied from; ``restored``
    the parked conversation put back into the slot first, if any.
    """
    if s.cache != "imc":
        return Decision(UNCACHED, s.session, cache=s.cache)
    d = Decision("", s.session, reuse,
                         donor=donor_session if donor_session is not None and reuse else None)
    if s.dropped:
        own = s.own
        div = find_divergence(own.tokens, s.tokens, s.ends, s.roles) if own is not None else None
        return replace(d, code=OVERFLOW, dropped=s.dropped, divergence=div)
    short = wanted - reuse if not can_trim and reuse < wanted else 0
    if restored is not None:
        return _restored(s, d, restored, short)
    trace = s.trace
    if trace is not None and trace.first is not None and tuple(s.hashes[:1]) != (trace.first,):
        trace = None  # a new conversation: what became of the old one does not explain it
    if trace is not None and trace.fate in (EVICTED, PARKED):
        parked = "" if trace.fate != PARKED else "still" if s.still_parked else "gone"
        return replace(d, code=EVICTED, trace=trace, parked=parked)
    if trace is not None and (trace.fate in (CLEARED, PROVEN) or (
            s.own is None and trace.fate == RELOADED)):
        return replace(d, code=trace.fate)
    if s.own is None:
        if d.donor is not None:
            return replace(d, code=COPIED)
        return replace(d, code=SHARED if reuse else FIRST,
                       kept_from=s.kept_from if reuse else None)
    div = _branch(s.own, s.tokens, s.ends, s.roles)
    if donor_session is not None:  # the own slot lost to another's (it served less)
        code = COPIED
        d = replace(d, donor=donor_session, own=True)
    else:
        code = CONTINUED if div is None else _what_changed(div, s.own.hashes, s.hashes)
    if short:
        return replace(d, code=CHECKPOINT, basis=code, divergence=div, shortfall=short)
    return replace(d, code=code, divergence=div)


def _restored(s: Story, d: Decision, r: Restored, short: int
              ) -> Decision:
    """The reason of a request whose slot a parked conversation was put back into."""
    if s.session is None or r.session != s.session:
        return replace(d, code=RESTORED, donor=None, restored=r)
    trace = s.trace if s.trace is not None and s.trace.fate == PARKED else None
    return replace(d, code=RESTORED, donor=None, restored=r, own=True, trace=trace,
                   divergence=_branch(r.cached, s.tokens, s.ends, s.roles), shortfall=short)


def find_divergence(cached: Sequence[Any], new: Sequence[Any], ends: Sequence[int],
                    roles: Sequence[str]) -> Divergence | None:
    """The first position where ``new`` differs from ``cached`` (None if it extends it)."""
    n = common_prefix(cached, new)
    if n >= len(cached) or n >= len(new):
        return None
    message = min(bisect.bisect_right(ends, n), len(roles) - 1)  # ends are exclusive
    lo = max(n - WINDOW, 0)
    return Divergence(n, message, roles[message] if roles else "?",
                      tuple(cached[lo : n + WINDOW]), tuple(new[lo : n + WINDOW]), lo)


def _branch(cached: Cached, tokens: Sequence[Any], ends: Sequence[int],
            roles: Sequence[str]) -> Divergence | None:
    """Where the prompt leaves ``cached``; None where it only extends it."""
    div = find_divergence(cached.tokens, tokens, ends, roles)
    tail = max(len(cached.tokens) - cached.msg_ends[-1], 0) if cached.msg_ends else 0
    if div is not None and div.position >= len(cached.tokens) - tail:
        return None  # the previous reply re-tokenized differently: not a branch
    return div


def _what_changed(div: Divergence, own_hashes: Sequence[str], hashes: Sequence[str]) -> str:
    """The code for where a prompt leaves its own slot's conversation."""
    k = div.message
    same_messages = k < len(own_hashes) and k < len(hashes) and own_hashes[k] == hashes[k]
    if same_messages or k >= len(own_hashes):
        return TEMPLATE_DRIFT
    at = div.position - div.start
    if not isinstance(div.new[at], int) or (at < len(div.cached)
                                            and not isinstance(div.cached[at], int)):
        return IMAGE_CHANGED
    if k == 0 and div.role == "system":
        return SYSTEM_CHANGED
    return EDITED
