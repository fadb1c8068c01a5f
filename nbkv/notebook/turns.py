"""A session's turns: one user message and its reply each, and the cell that sent it.

Pure data and small helpers for :mod:`nbkv.notebook.sessions`: nothing here imports Jupyter or the
engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nbkv.core.errors import InvalidRequestError
from nbkv.ui import vocabulary as vocab

if TYPE_CHECKING:
    from nbkv.core.events import RequestRecord

LIVE, STALE = "live", "stale"


class Session(Protocol):
    """What a :class:`MessageList` needs of its session (``nbkv.notebook.sessions.Session``)."""

    name: str
    version: int
    messages: Any  # assigning a list rebuilds the session's turns


class Reply(str):
    """A reply's text (a ``str``) that also carries its request record and finish reason."""

    record: RequestRecord | None
    finish_reason: str | None

    def __new__(cls, text: str, record: RequestRecord | None = None,
                finish_reason: str | None = None) -> Reply:
        """Wrap ``text`` with its record."""
        self = super().__new__(cls, text)
        self.record = record
        self.finish_reason = finish_reason
        return self

    @property
    def text(self) -> str:
        """The reply as a plain ``str``."""
        return str.__str__(self)


@dataclass(frozen=True)
class CellRef:
    """The notebook cell a turn came from: its id, and its execution count (``In [N]``).

    ``count`` is None when the frontend ran it without storing history (nbval does).
    """

    id: str
    count: int | None = None

    @property
    def label(self) -> str:
        """``[3]``, or the start of the cell's id when it has no execution count."""
        return f"[{self.count}]" if self.count is not None else f"cell {self.id[:8]}"


@dataclass(eq=False)
class Turn:
    """One exchange of a session: the user message, the reply, and the cell that sent them.

    ``messages`` is the user message then the reply (a conversation set from Python may put
    other messages in a turn: a turn is a user message and whatever follows it). ``state``
    is ``"live"``, or ``"stale"`` when an earlier turn was re-run after it was answered:
    a stale turn is left out of the history sent to the model until its cell runs again.
    """

    messages: list[dict[str, Any]]
    cell: CellRef | None = None
    record: RequestRecord | None = None
    state: str = LIVE
    runs: int = 1  # how many times its cell has produced it (a re-run replaces the turn)
    stale_since: int | None = None  # the turn whose re-run made this one stale
    source: str | None = None  # the session it was copied from by a fork

    @property
    def live(self) -> bool:
        """True unless the turn is stale."""
        return self.state == LIVE

    @property
    def user(self) -> dict[str, Any] | None:
        """The user message, or None for a turn that has none."""
        m = self.messages[0] if self.messages else None
        return m if m is not None and m.get("role") == "user" else None

    @property
    def question(self) -> str:
        """The user message's text (images left out)."""
        return message_text(self.user.get("content")) if self.user else ""

    @property
    def reply(self) -> str:
        """The reply's text ("" if the turn has none)."""
        for m in reversed(self.messages):
            if m.get("role") == "assistant":
                return message_text(m.get("content"))
        return ""

    def state_dict(self) -> dict[str, Any]:
        """The turn as JSON-ready data (records are not kept)."""
        return {"messages": self.messages, "cell": self.cell.id if self.cell else None,
                "execution_count": self.cell.count if self.cell else None,
                "state": self.state, "runs": self.runs, "stale_since": self.stale_since,
                "source": self.source}

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> Turn:
        """A turn from :meth:`state_dict`'s data; ValueError when it is malformed."""
        msgs = d.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("a turn needs a non-empty list of messages")
        cell, count = d.get("cell"), d.get("execution_count")
        if cell is not None and not isinstance(cell, str) or \
                count is not None and not isinstance(count, int):
            raise ValueError(f"a turn's cell is malformed: {cell!r} [{count!r}]")
        state = d.get("state", LIVE)
        if state not in (LIVE, STALE):
            raise ValueError(f"a turn's state is {state!r}, not live or stale")
        since, source = d.get("stale_since"), d.get("source")
        return cls(msgs, CellRef(cell, count) if cell else None, None, state,
                   int(d.get("runs", 1)), int(since) if since is not None else None,
                   str(source) if source is not None else None)

    def __repr__(self) -> str:
        cell = f" {self.cell.label}" if self.cell else ""
        return f"Turn({self.question[:30]!r}{cell}, {self.state})"


@dataclass(frozen=True)
class TurnChange:
    """What committing a turn did to its session: for the why line and the dashboard."""

    session: str
    turn: int  # the turn's number (1-based, in the session's cell order)
    #: "appended", "replaced" (a live turn's cell ran again), "repeated" (... and gave the
    #: same exchange: the later turns stay live) or "refreshed" (a stale turn's cell ran again)
    action: str
    cell: CellRef | None = None
    stale: tuple[int, ...] = ()  # turns that this run made stale
    #: the turn each message of the request belonged to (0: the system prompt)
    layout: tuple[int, ...] = ()

    def describe(self, record: RequestRecord | None = None) -> str:
        """What the run did, in words ("" for a plain append).

        ``re-ran cell [3]: replaced turn 2 of alice · cut 88 tokens from turn 2's question
        onwards · turn 3 is now stale``.
        """
        if self.action == "appended" and not self.stale:
            return ""
        where = self.cell.label if self.cell else "a turn"
        if self.action == "repeated":
            parts = [f"re-ran cell {where}: turn {self.turn} of {self.session} is the same as "
                     "before, so the turns after it stay"]
        else:
            parts = [f"re-ran cell {where}: {self.action} turn {self.turn} of {self.session}"
                     + (" on the new history" if self.action == "refreshed" else "")]
        if record is not None and record.trimmed_tokens:
            spot = cut_from(record, self.layout)
            # the vocabulary's one word for it (the legend's, the KV map's)
            parts.append(f"{vocab.STATES['trimmed'].words} {record.trimmed_tokens} tokens"
                         + (f" from {spot} onwards" if spot else ""))
        if self.stale:
            parts.append(f"{span_text(self.stale)} now stale")
        return " · ".join(parts)


def span_text(numbers: Sequence[int]) -> str:
    """``turn 3 is``, ``turns 3–4 are``, ``turns 2, 4 are``."""
    n = sorted(numbers)
    if len(n) == 1:
        return f"turn {n[0]} is"
    if n == list(range(n[0], n[-1] + 1)):
        return f"turns {n[0]}–{n[-1]} are"
    return "turns " + ", ".join(map(str, n)) + " are"


def cut_from(record: RequestRecord, layout: Sequence[int]) -> str:
    """Where a request's cut began, in turns: ``turn 2's question``, ``turn 1's reply``.

    Read from the record's KV map (the first position not reused, and its message);
    ``layout`` gives the turn of each message of the request (0: the system prompt). What
    was cut runs from there to the end of what the slot held: that turn's rest and every
    later turn.
    """
    segs = sorted((s for s in record.segments if s.state != "reused"), key=lambda s: s.start)
    if not segs or not layout:
        return ""
    first, k = segs[0], segs[0].message
    if k >= len(layout):  # the generation prompt: where the turn's reply began
        return f"turn {layout[-1]}'s reply"
    if layout[k] == 0:
        return "the system prompt"
    return f"turn {layout[k]}'s " + ("question" if first.role == "user" else "reply")


class MessageList(list):
    """``Session.messages``: the live conversation, as a list whose changes go to the session.

    Editing a message's content (``s.messages[3]["content"] = ...``) edits the turn in place.
    Changing the list (append, delete, assign, insert, ...) rebuilds the session's turns from
    it: turns whose user message is still there keep their cell; stale turns are dropped.
    A list read before the session changed refuses to change it (read it again).
    """

    def __init__(self, session: Session, items: Iterable[dict[str, Any]]) -> None:
        super().__init__(items)
        self._session = session
        self._version = session.version

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copies and pickles are plain lists: never the session (and its engine) behind it
        return (list, (list(self),))

    def _apply(self, name: str, *args: Any, **kw: Any) -> Any:
        if self._version != self._session.version:
            raise InvalidRequestError(
                f"this list of {self._session.name}'s messages is out of date (the session "
                "changed since it was read): read session.messages again")
        out = getattr(list, name)(self, *args, **kw)
        self._session.messages = list(self)
        self._version = self._session.version
        return self if name in ("__iadd__", "__imul__") else out

    def __setitem__(self, i: Any, v: Any) -> None:
        self._apply("__setitem__", i, v)

    def __delitem__(self, i: Any) -> None:
        self._apply("__delitem__", i)

    def __iadd__(self, other: Any) -> MessageList:  # type: ignore[misc]
        return self._apply("__iadd__", other)

    def __imul__(self, n: Any) -> MessageList:  # type: ignore[misc]
        return self._apply("__imul__", n)

    def append(self, m: Any) -> None:
        """Append a message to the session."""
        self._apply("append", m)

    def extend(self, ms: Any) -> None:
        """Append messages to the session."""
        self._apply("extend", ms)

    def insert(self, i: Any, m: Any) -> None:
        """Insert a message into the session."""
        self._apply("insert", i, m)

    def pop(self, i: Any = -1) -> Any:
        """Remove and return a message of the session."""
        return self._apply("pop", i)

    def remove(self, m: Any) -> None:
        """Remove a message from the session."""
        self._apply("remove", m)

    def clear(self) -> None:
        """Empty the session (its system prompt included)."""
        self._apply("clear")

    def sort(self, *a: Any, **kw: Any) -> None:
        """Reorder the session's messages."""
        self._apply("sort", *a, **kw)

    def reverse(self) -> None:
        """Reverse the session's messages."""
        self._apply("reverse")


def message_text(content: Any) -> str:
    """The text of a message's content (string, or the text parts of a list)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content
                        if isinstance(p, dict) and p.get("type") == "text")
    return ""
