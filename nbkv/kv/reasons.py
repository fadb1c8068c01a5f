"""Why a request reused what it reused: a reason code, plain words, and the divergence point.

Pure logic, computed when the engine places a request, from what the policy already knows:
the session's own slot (if it still holds the conversation), what happened to that slot since
(evicted by whom, cleared), the prompt's tokens, message hashes and boundaries. Token text is
detokenized only when someone asks (:meth:`Divergence.excerpts`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbkv.core.codes import (
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
    REASONS,
    RELOADED,
    REPLAYED,
    RESTORED,
    SHARED,
    SYSTEM_CHANGED,
    TEMPLATE_DRIFT,
    UNCACHED,
    common_prefix,
    counted,
    tier_words,
)
from nbkv.core.events import REUSED, WINDOW, Divergence

__all__ = ["CHECKPOINT", "CLEARED", "CONTINUED", "COPIED", "EDITED", "EVICTED", "FIRST",
           "IMAGE_CHANGED", "OVERFLOW", "PARKED", "REASONS", "RELOADED", "REPLAYED", "RESTORED",
           "SHARED", "SYSTEM_CHANGED", "TEMPLATE_DRIFT", "UNCACHED", "Divergence"]


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
    #: EVICTED, CLEARED or RELOADED once the conversation was lost; PARKED when the request
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


def _whose(session: str | None) -> str:
    """``bob's``, or ``an unnamed`` for a request without a session."""
    return f"{session}'s" if session is not None else "an unnamed"


def _unit_is_media(u: Any) -> bool:
    return not isinstance(u, int)


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


def explain(
    *,
    session: str | None,
    trace: Whereabouts | None,
    own: Cached | None,
    tokens: Sequence[Any],
    hashes: Sequence[str],
    ends: Sequence[int],
    roles: Sequence[str],
    reuse: int,
    wanted: int,
    donor_session: str | None,
    dropped: int,
    can_trim: bool,
    cache: str = "imc",
    restored: Restored | None = None,
    kept_from: str | None = None,
    still_parked: bool = False,
) -> Reason:
    """The reason for a request placed with ``reuse`` tokens of KV kept.

    ``own`` is the session's slot if it still holds the conversation; ``trace`` what
    happened to that slot; ``wanted`` what the placement would have kept on memory that can
    be cut anywhere (``reuse`` is less when a checkpoint had to be restored further back).
    ``restored`` is the parked conversation put back into the slot first, if any;
    ``kept_from`` whose conversation the slot held when the prompt keeps its start in place;
    ``still_parked``: the session's conversation is parked, but could not serve this prompt.
    """
    who = f"session {session}" if session is not None else "this request"
    if cache != "imc":
        return Reason(UNCACHED, f"cache mode {cache}: conversations are not kept between "
                                "requests")
    copied = (f"; its first {reuse} tokens were copied from {donor_session}'s slot"
              if donor_session is not None and reuse else "")
    if dropped:
        div = find_divergence(own.tokens, tokens, ends, roles) if own is not None else None
        oldest = ("the oldest message was" if dropped == 1
                  else f"the {dropped} oldest messages were")
        return Reason(OVERFLOW, f"the conversation outgrew its slot: {oldest} dropped, so the "
                                f"cache matched only up to where they were{copied}", div)
    if restored is not None:
        return _restored(who, session, trace, restored, tokens, ends, roles, reuse, wanted,
                         can_trim)
    if trace is not None and trace.first is not None and tuple(hashes[:1]) != (trace.first,):
        trace = None  # a new conversation: what became of the old one does not explain it
    lost = _lost(who, trace, own is None, copied, still_parked)
    if lost is not None:
        return lost
    if own is None:
        return _not_cached(who, reuse, donor_session, kept_from)
    div = _branch(own, tokens, ends, roles)
    if donor_session is not None:  # the own slot lost to another's (it served less)
        what = (f"{who}'s own slot served less of this prompt than {donor_session}'s, so "
                f"its first {reuse} tokens were copied from there")
        code, text = COPIED, what
        if div is not None:
            text = (f"{what} (its own slot leaves the prompt in message {div.message} "
                    f"({div.role}), token {div.position})")
    elif div is None:
        code, text = CONTINUED, f"everything cached for {who} was reused"
    else:
        code, text = _what_changed(div, own.hashes, hashes)
    if not can_trim and reuse < wanted:
        return Reason(CHECKPOINT, text + _checkpoint_note(reuse, wanted), div)
    return Reason(code, text, div)


def _lost(who: str, trace: Whereabouts | None, gone: bool, copied: str,
          still_parked: bool) -> Reason | None:
    """The reason when the session's conversation left its slot (None: it did not).

    ``gone``: the slot no longer holds it; ``copied`` the words on a donor's copy, if any.
    """
    if trace is None:
        return None
    if trace.fate in (EVICTED, PARKED):
        parked = ""
        if trace.fate == PARKED:
            parked = (" and its conversation parked, but the parked state could not serve "
                      "this prompt" if still_parked else " and its conversation parked, but "
                      "the parked copy was gone (over the parking budget, or unreadable)")
        return Reason(EVICTED, f"{who}'s slot was taken by {_whose(trace.by_session)} request "
                               f"#{trace.by_request}{parked}, so its conversation was read "
                               f"again{copied}")
    if trace.fate == CLEARED:
        return Reason(CLEARED, f"{who}'s slot was cleared by the user, so its conversation "
                               f"was read again{copied}")
    if gone and trace.fate == RELOADED:
        return Reason(RELOADED, f"the engine was loaded again since {who}'s last turn: its "
                                f"cache started empty, so the conversation was read again"
                                f"{copied}")
    return None


def _not_cached(who: str, reuse: int, donor_session: str | None,
                kept_from: str | None) -> Reason:
    """The reason for a request nothing of which was cached for it."""
    if donor_session is not None and reuse:
        return Reason(COPIED, f"{who} was not cached; its first {reuse} tokens (the "
                              f"shared start) were copied from {donor_session}'s slot")
    if reuse:  # the start it shares with the conversation the slot held, kept in place
        held = f"{kept_from}'s conversation" if kept_from else "another conversation"
        return Reason(SHARED, f"{who} was not cached; the slot it got held {held}, whose "
                              f"first {reuse} tokens it shares, so those were kept")
    return Reason(FIRST, f"nothing of {who} was cached")


def _what_changed(div: Divergence, own_hashes: Sequence[str],
                  hashes: Sequence[str]) -> tuple[str, str]:
    """(code, words) for where a prompt leaves its own slot's conversation."""
    k = div.message
    same_messages = k < len(own_hashes) and k < len(hashes) and own_hashes[k] == hashes[k]
    if same_messages or k >= len(own_hashes):
        return TEMPLATE_DRIFT, (f"the same messages rendered to different tokens in message "
                                f"{k} ({div.role}), token {div.position}")
    if _unit_is_media(div.new[div.position - div.start]) or (
            div.position - div.start < len(div.cached)
            and _unit_is_media(div.cached[div.position - div.start])):
        return IMAGE_CHANGED, f"a different image in message {k} ({div.role}), token {div.position}"
    if k == 0 and div.role == "system":
        return SYSTEM_CHANGED, f"the system prompt changed at token {div.position}"
    return EDITED, (f"kept {counted(k, 'message')}, re-read from message {k} ({div.role}, "
                    f"edited) at token {div.position}")


def _checkpoint_note(reuse: int, wanted: int) -> str:
    return (f"; this model's memory cannot be cut there, so a checkpoint {wanted - reuse} "
            "tokens earlier was restored")


def _branch(cached: Cached, tokens: Sequence[Any], ends: Sequence[int],
            roles: Sequence[str]) -> Divergence | None:
    """Where the prompt leaves ``cached``; None where it only extends it."""
    div = find_divergence(cached.tokens, tokens, ends, roles)
    tail = max(len(cached.tokens) - cached.msg_ends[-1], 0) if cached.msg_ends else 0
    if div is not None and div.position >= len(cached.tokens) - tail:
        return None  # the previous reply re-tokenized differently: not a branch
    return div


def _restored(who: str, session: str | None, trace: Whereabouts | None, r: Restored,
              tokens: Sequence[Any], ends: Sequence[int], roles: Sequence[str], reuse: int,
              wanted: int, can_trim: bool) -> Reason:
    """``alice's conversation was parked when bob's request #5 took slot 0; restored ...``."""
    where = tier_words(r.tier)
    if session is None or r.session != session:
        owner = f"{r.session}'s" if r.session is not None else "a"
        return Reason(RESTORED, f"{who} was not cached; {reuse:,} tokens of {owner} parked "
                                f"conversation were restored from {where}")
    total = len(r.cached.tokens)
    amount = f"its {reuse:,} tokens" if reuse == total else f"{reuse:,} of its {total:,} tokens"
    when = ""
    if trace is not None and trace.fate == PARKED:
        slot = f"slot {trace.slot}" if trace.slot is not None else "its slot"
        when = f" when {_whose(trace.by_session)} request #{trace.by_request} took {slot}"
    text = f"{who}'s conversation was parked{when}; restored {amount} from {where}"
    if not reuse:
        text = (f"{who}'s conversation was parked{when}, but its state from {where} could not "
                f"be cut back to where this prompt leaves it (no checkpoint before that "
                f"point), so it was read again")
    div = _branch(r.cached, tokens, ends, roles)
    if div is not None:
        text += f", then read on from message {div.message} ({div.role}), token {div.position}"
    if not can_trim and reuse < wanted:
        text += _checkpoint_note(reuse, wanted)
    return Reason(RESTORED, text, div)


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
