"""One word for each event: the code records carry, the words people read, colour and pattern.

Every surface (the figures line and its why line, ``%kvcache history`` / ``stats`` /
``slots`` / ``explain``, the legends, the widgets' hovers and slot cards, the static pages)
names an event through this table, so the same event never has two names. ``avoid`` lists
the spellings that used to name it: ``tests/test_vocabulary.py`` checks that no surface
uses them. Pure data: nothing here imports Jupyter or the engine.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nbkv.core.events import TIERS
from nbkv.ui.palette import (
    COLORS,
    INK,
    MEDIA_COLOR,
    NEUTRAL,
    PARKED_COLOR,
    REPLAYED_COLOR,
    RESTORED_COLOR,
    ROLE_COLORS,
    TODO_COLOR,
)


@dataclass(frozen=True)
class Term:
    r"""An event's code (what records carry), its words, tooltip, colour and pattern.

    ``pattern`` is a plotly bar pattern shape (empty: solid, or one of ``/ \ x - | + .``);
    the static pages draw the same shapes.
    """

    code: str
    words: str
    tip: str
    color: str = NEUTRAL
    pattern: str = ""
    avoid: tuple[str, ...] = ()  # former spellings that no surface may use


def _table(*terms: Term) -> dict[str, Term]:
    return {t.code: t for t in terms}


_BAR = COLORS["reused"]  # every bar of the salvage chart is "reused": the event is its pattern
# one hatch per kind of event, shapes that differ at bar size (dots, one diagonal, a cross,
# level lines, a grid, upright lines): solid, continued; ``.`` its start came from another
# conversation (copied, or shared and kept); ``/`` a message changed; ``x`` the cache was
# lost (evicted, cleared, proven, reloaded); ``-`` not kept (overflow, cache off); ``+`` back to a
# checkpoint; ``|`` the server's own cache

#: how a request was served and why (``record.reason``), one per request
EVENTS = _table(
    Term("first", "new conversation",
         "the session's first request here: nothing of its conversation was cached",
         _BAR, "", ("miss", "first request", "rebuilt")),
    Term("continued", "continued",
         "the conversation grew: everything cached was reused, only the new message was read",
         _BAR, "", ("hash-extend", "hash-hit", "conversation extended", "same messages")),
    Term("copied", "copied prefix",
         "a shared start (such as a system prompt) was copied from another conversation's "
         "slot instead of being read again", _BAR, ".",
         ("prefix-salvage", "token prefix salvaged")),
    Term("shared", "shared start kept",
         "a new conversation got a slot whose conversation starts the same way (such as a "
         "system prompt): those tokens were kept in place, nothing was copied", _BAR, "."),
    Term("reloaded", "engine reloaded",
         "the engine was loaded again (%kvcache load): its cache started empty, so the "
         "conversation was read again", _BAR, "x"),
    Term("evicted", "rebuilt after eviction",
         "another conversation's request took this conversation's slot, so it was read "
         "again", _BAR, "x"),
    Term("cleared", "rebuilt after clear",
         "the slot was cleared (%kvcache clear), so the conversation was read again",
         _BAR, "x"),
    Term("proven", "rebuilt after the proof",
         "nbkv proved this model's exactness in the background and dropped what it had "
         "cached before (grouped the unproven way), so the conversation was read again",
         _BAR, "x"),
    Term("edited", "edited message",
         "an earlier message changed: everything before it was kept, the rest read again",
         _BAR, "/"),
    Term("system-changed", "system prompt changed",
         "the system prompt changed, so the conversation was read again from there",
         _BAR, "/"),
    Term("template-drift", "template drift",
         "the same messages rendered to different tokens (e.g. a template that prints the "
         "date): the cache kept the tokens before the difference", _BAR, "/"),
    Term("image-changed", "image changed",
         "a different image at the same place: the conversation was read again from it",
         _BAR, "/"),
    Term("overflow", "oldest messages dropped",
         "the conversation outgrew its slot: the oldest messages were dropped to fit",
         _BAR, "-"),
    Term("checkpoint", "checkpoint restored",
         "this model's memory cannot be cut anywhere: it went back to the nearest saved "
         "checkpoint and read on from there", _BAR, "+"),
    Term("uncached", "not cached",
         "cache mode spc or off: conversations are not kept between requests", _BAR, "-",
         ("cache off", "system prompt restored")),
    Term("server", "server's cache",
         "the server chose what to reuse (its own prefix cache)", _BAR, "|"),
    # its own kind of bar: nothing read, nothing decoded
    Term("replayed", "replayed",
         "same prompt and settings, so the same reply: a cell run again with deterministic "
         "sampling got the reply the cache still held, streamed at once with nothing "
         "decoded, and the later turns' KV was kept", REPLAYED_COLOR, ""),
    # its own kind of bar: served from the parking lot, not from a slot
    Term("restored", "restored",
         "the conversation had been parked (kept in RAM or on disk when another request "
         "took its slot) and was put back into a slot: only the rest was read",
         RESTORED_COLOR, ""),
)

#: what a request did to KV positions (the request rows, the bars, the figures line)
STATES = _table(
    Term("reused", "reused", "its KV was already in the slot: not computed again",
         COLORS["reused"]),
    Term("prefilled", "read new", "prompt tokens the model had to read (prefill)",
         COLORS["prefilled"], "", ("read now", "prefilling")),
    Term("todo", "still to read", "prompt tokens of a request in flight not read yet",
         TODO_COLOR),
    Term("generated", "generated", "the reply's tokens", COLORS["generated"], "/"),
    Term("trimmed", "trimmed", "cut from the slot: the positions after the part kept",
         COLORS["trimmed"], "x"),
    Term("kept", "kept", "later turns the slot still holds: the request (a replay) left them "
                         "as they were", NEUTRAL),
)

#: who wrote a message (the message rows, the slot strips)
ROLES = _table(
    Term("system", "system", "the system prompt", ROLE_COLORS["system"]),
    Term("user", "user", "what the user wrote", ROLE_COLORS["user"]),
    Term("assistant", "assistant", "the model's replies", ROLE_COLORS["assistant"]),
    Term("tool", "tool", "a tool's result", ROLE_COLORS["tool"]),
    Term("image", "image", "the positions a picture's embeddings occupy", MEDIA_COLOR, "",
         ("media",)),
)

#: how a reply ended (``record.finish_reason``); a normal stop says nothing
ENDINGS = _table(
    Term("stop", "", "the model ended its reply"),
    Term("length", "stopped at the token limit",
         "the reply reached --max-tokens (or the end of the slot)", NEUTRAL, "",
         ("stopped at --max-tokens",)),
    Term("cancelled", "interrupted", "stopped by the user: the partial reply is kept"),
    Term("error", "failed", "the request failed"),
)

#: marks on the map and the strips
MARKS = _table(
    Term("checkpoint-mark", "checkpoint",
         "a saved state this model can go back to (hybrid and recurrent memory)", INK),
    Term("divergence", "where the prompt diverged",
         "where the prompt left the cached conversation: the first position where the new "
         "prompt differs from what the slot held", INK),
    Term("took-slot", "took another conversation's slot",
         "this request's slot held another conversation, which was dropped to make room",
         COLORS["trimmed"], "x", ("evictions",)),
    Term("server-held", "held by the server now",
         "a serving engine that keeps its own prefix cache (vLLM) still holds these blocks "
         "of the conversation, as its KV cache events say: the next turn can reuse them",
         COLORS["reused"]),
    Term("nothing-reused", "reused nothing",
         "a request that reused no cached token (the salvage chart marks it at 0)", NEUTRAL,
         "", ("nothing reused",)),
)

#: a slot's memory class (slot cards, ``%kvcache status``)
MEMORY = _table(
    Term("plain", "plain", "plain attention memory: the slot can go back to any earlier "
                           "position exactly, by cutting its KV there"),
    Term("sliding-window", "sliding-window",
         "sliding-window attention kept at full size: a slot can go back to any earlier "
         "position; a conversation put back from parking or a save holds only the window "
         "before its end, so it goes back further only to a checkpoint (each holds one "
         "window), then reads on"),
    Term("hybrid", "hybrid", "recurrent layers plus attention: the slot goes back only to "
                             "a saved checkpoint, then reads on"),
    Term("recurrent", "recurrent", "recurrent memory: the slot goes back only to a saved "
                                   "checkpoint, then reads on"),
)

#: conversations that lost their slot (the slot cards' shelf, ``%kvcache stats``)
PARKING = _table(
    Term("parked", "parked",
         "a conversation whose slot another request took, kept (its KV state, checkpoints "
         "and messages) to be restored instead of read again", PARKED_COLOR),
    Term("ram", TIERS["ram"], "parked in the kernel's memory (park_ram bytes, least recently used "
                       "out first)", PARKED_COLOR),
    Term("disk", TIERS["disk"], "parked on disk (park_dir), in the save format, after leaving RAM; "
                         "checked before it is restored", PARKED_COLOR),
    Term("spilled", "spilled to disk", "moved from RAM to disk to make room", PARKED_COLOR),
    Term("server-ram", TIERS["server-ram"], "llama-server's host-memory prompt cache "
         "(--cache-ram): a prompt leaving a server slot is kept there and loaded back into "
         "the slot it returns to", PARKED_COLOR),
)

GROUPS = {"events": EVENTS, "states": STATES, "roles": ROLES, "endings": ENDINGS,
          "marks": MARKS, "memory": MEMORY, "parking": PARKING}


def event(record: Any) -> Term:
    """The term for how ``record`` was served (its reason code; the first one if unknown)."""
    return EVENTS.get(getattr(record, "reason", "") or "", EVENTS["first"])


def reason_line(record: Any) -> str:
    """``edited message: kept 3 messages, re-read from ...``: the event's words and why."""
    term = event(record)
    detail = getattr(record, "reason_text", "")
    return f"{term.words}: {detail}" if detail else term.words


def ending(record: Any) -> str:
    """How the reply ended, in words (``""`` for a normal stop)."""
    term = ENDINGS.get(getattr(record, "finish_reason", "") or "stop")
    return term.words if term else ""


def took(record: Any) -> str:
    """``took bob's slot (125 tokens gone)`` when the request took another's slot, else ``""``.

    ``(125 tokens parked)`` when the conversation was parked rather than lost.
    """
    who = getattr(record, "evicted_session", None)
    if who is None or who == getattr(record, "session", None):
        return ""
    fate = PARKING["parked"].words if getattr(record, "evicted_parked", "") else "gone"
    return f"took {who}'s slot ({record.evicted_tokens} tokens {fate})"


def tier_words(tier: str) -> str:
    """``RAM`` or ``disk``: where a conversation was parked."""
    return PARKING[tier].words if tier in PARKING else tier


def restored(record: Any) -> str:
    """``restored alice's 1,204 tokens from RAM in 4 ms`` for a restore, else ``""``."""
    tier = getattr(record, "restored_from", "")
    if not tier:
        return ""
    who = getattr(record, "restored_session", None)
    whose = f"{who}'s " if who is not None else ""
    # the restore proper (unpark_s); restore_s also holds the admission around it and
    # parking the slot's previous conversation
    s = getattr(record, "unpark_s", 0.0) or record.restore_s - getattr(record, "park_s", 0.0)
    took = f" in {s * 1000:.0f} ms" if record.restore_s else ""  # (a server: no time)
    return (f"{EVENTS['restored'].words} {whose}{record.restored_tokens:,} tokens from "
            f"{tier_words(tier)}{took}")


def bar(record: Any) -> Term:
    """The timeline bar of a request: a restore is its own kind, else the event's.

    A replayed request is drawn as replayed even when a parked conversation was restored
    first (its figures line, ``explain`` and the charts all say "replayed").
    """
    if getattr(record, "reason", "") == "replayed":
        return EVENTS["replayed"]
    return EVENTS["restored"] if getattr(record, "restored_from", "") else event(record)


def parked_name(entry: Any) -> str:
    """A parked conversation's name: its session, or whose earlier branch it is.

    An edit's old branch is parked unnamed (``session`` None, ``branch_of`` the session it
    was cut from): ``bob's earlier branch``.
    """
    if getattr(entry, "session", None) is not None:
        return str(entry.session)
    who = getattr(entry, "branch_of", None)
    return f"{who}'s earlier branch" if who is not None else "an earlier branch"


def lru_tip(rank: int, used: int) -> str:
    """The tooltip of ``LRU 1 of 2`` on a slot card."""
    last = "the next one evicted" if rank == used and used > 1 else (
        "evicted last" if rank == 1 else "")
    return (f"least recently used order: {rank} of the {used} slots in use "
            f"(1 = used most recently{'' if not last else ', ' + last}); when every slot "
            "is taken, a new conversation replaces the least recently used one")


def counts(by_code: dict[str, int]) -> dict[str, int]:
    """Requests per event in words, most frequent first, from counts by reason code.

    ``by_code`` as an engine's ``stats()["events"]`` gives it.
    """
    by: dict[str, int] = {}
    for code, n in by_code.items():
        w = EVENTS.get(code, EVENTS["first"]).words
        by[w] = by.get(w, 0) + n
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))


def terms() -> Iterator[Term]:
    """Every term of every group."""
    for group in GROUPS.values():
        yield from group.values()


def misspellings(text: str) -> list[str]:
    """Former spellings of an event found in ``text`` (HTML tags ignored), for the tests.

    The table's own words are taken out first: ``rebuilt after eviction`` is a term, a bare
    ``rebuilt`` is not.
    """
    plain = html.unescape(re.sub(r"<[^>]+>", " ", text))
    for words in sorted({t.words for t in terms() if t.words}, key=len, reverse=True):
        plain = re.sub(re.escape(words), " ", plain, flags=re.I)
    found = []
    for t in terms():
        for bad in t.avoid:
            if re.search(r"(?<![\w-])" + re.escape(bad) + r"(?![\w-])", plain, re.I):
                found.append(f"{bad!r} (say {t.words!r})")
    return found
