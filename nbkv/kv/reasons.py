"""Why a request reused what it reused: a reason code, plain words, and the divergence point.

The code is decided with the admission (:func:`nbkv.kv.admission.decide`), from what the
placement did and what the engine remembers of the session (:class:`Whereabouts`); this module
only puts a :class:`Decision` into words (:func:`words`) and keeps the data types both read.
Token text is detokenized only when someone asks (:meth:`Divergence.excerpts`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
    REASONS,
    RELOADED,
    REPLAYED,
    RESTORED,
    REUSED,
    SHARED,
    SYSTEM_CHANGED,
    TEMPLATE_DRIFT,
    UNCACHED,
    Divergence,
    common_prefix,
    counted,
    tier_words,
)

__all__ = ["CHECKPOINT", "CLEARED", "CONTINUED", "COPIED", "EDITED", "EVICTED", "FIRST",
           "IMAGE_CHANGED", "OVERFLOW", "PARKED", "PROVEN", "REASONS", "RELOADED", "REPLAYED",
           "RESTORED", "SHARED", "SYSTEM_CHANGED", "TEMPLATE_DRIFT", "UNCACHED", "Decision",
           "Divergence"]


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
        return _restored(d, who)
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


def _restored(d: Decision, who: str) -> str:
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
