"""The in-kernel conversation store: named sessions, their turns, and the engine they use.

Nothing here imports Jupyter. The ``%%chat`` magic and plain Python share one store::

    import nbkv
    s = nbkv.session("alice")          # created on first use
    s.messages[1]["content"] = "..."   # edit an earlier turn; the cache salvages what it can
    s.chat("And then?", max_tokens=32) # the same as a %%chat alice cell, without the display

A session is its system prompt and a list of :class:`Turn` s, each a user message and its
reply. In a notebook a turn remembers the cell that sent it, and **cells are turns**: the
conversation is the session's cells in the order they were first run. Running a cell again
replaces its turn, answered on the turns before it; the turns after it are kept but marked
*stale* (answered on a history that has since changed): they are left out of what the model
sees until their own cells run again. A turn sent with no cell (Python, a terminal, a
frontend that sends no cell id) is appended.

A turn is committed when its reply ends. An interrupted turn keeps the partial reply; a turn
that failed, or was interrupted before its first token, leaves the session unchanged.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbkv.core.errors import InvalidRequestError
from nbkv.core.events import EventBus, Notice
from nbkv.notebook.turns import (  # noqa: F401 - the session model, re-exported
    LIVE,
    STALE,
    CellRef,
    MessageList,
    Reply,
    Turn,
    TurnChange,
    cut_from,
)
from nbkv.store.session_state import use_default_sessions

if TYPE_CHECKING:
    from nbkv.core.events import RequestRecord
    from nbkv.core.protocol import EngineLike
    from nbkv.core.streams import ChatStream
    from nbkv.engine.facade import Engine
    from nbkv.remote.llama_server import LlamaServerEngine
    from nbkv.remote.openai import OpenAIEngine

DEFAULT_SESSION = "default"


@dataclass(eq=False)
class Session:
    """One named conversation: a system prompt and its turns, in cell order."""

    name: str
    store: SessionStore | None = field(default=None, repr=False)
    #: the session this one was forked from, and after how many of its turns
    parent: tuple[str, int] | None = None
    #: bumped on every change of the turns (views redraw, stale message lists refuse edits)
    version: int = 0

    def __post_init__(self) -> None:
        self._system: dict[str, Any] | None = None
        self._turns: list[Turn] = []

    # ------------------------------------------------------------------ reading

    @property
    def turns(self) -> tuple[Turn, ...]:
        """Every turn in cell order (the order their cells first ran), live and stale."""
        return tuple(self._turns)

    @property
    def messages(self) -> MessageList:
        """The live conversation: the system prompt, then each live turn's messages.

        The dicts are the turns' own: edit one and the next request sends the edit (the
        cache keeps what comes before it). Changing the list itself rebuilds the turns.
        """
        out = [self._system] if self._system is not None else []
        out += [m for t in self._turns if t.live for m in t.messages]
        return MessageList(self, out)

    @messages.setter
    def messages(self, msgs: Sequence[Mapping[str, Any]]) -> None:
        given = list(msgs)
        dicts = [m for m in given if isinstance(m, dict)]
        if len(dicts) != len(given):
            raise InvalidRequestError(f"{self.name}: messages must be dicts")
        msgs = dicts
        system = msgs.pop(0) if msgs and msgs[0].get("role") == "system" else None
        keep = {id(t.user): t for t in self._turns if t.live and t.user is not None}
        turns = []
        for chunk in _exchanges(msgs):
            t = keep.pop(id(chunk[0]), None)
            if t is None:
                t = Turn(chunk)
            else:
                t.messages = chunk
            turns.append(t)
        self._system, self._turns = system, turns
        self._changed()

    @property
    def records(self) -> list[RequestRecord]:
        """The request records of the live turns, in order (restored turns have none)."""
        return [t.record for t in self._turns if t.live and t.record is not None]

    @property
    def system(self) -> str | None:
        """The system prompt, or None."""
        return self._system.get("content") if self._system is not None else None

    @system.setter
    def system(self, text: str | None) -> None:
        new = None if text is None else {"role": "system", "content": text}
        if new != self._system:
            self._system = new
            self._changed()

    def turn(self, cell: str) -> Turn | None:
        """The turn that cell ``cell`` (an id) sent to this session (a fork's copies aside)."""
        return next((t for t in self._turns if t.cell is not None and t.cell.id == cell
                     and t.source is None), None)

    def _number(self, turn: int | Turn, what: str) -> int:
        """A turn number (0..len) from a number or a :class:`Turn` of this session."""
        if isinstance(turn, Turn):
            for i, t in enumerate(self._turns):
                if t is turn:
                    return i + 1
            raise InvalidRequestError(f"{what}: that turn is not one of {self.name}'s")
        if isinstance(turn, bool) or not isinstance(turn, int):
            raise InvalidRequestError(f"{what}: give a turn number, not {turn!r}")
        if not 0 <= turn <= len(self._turns):
            raise InvalidRequestError(
                f"{what}: {self.name} has {len(self._turns)} turn(s), so a turn is "
                f"0..{len(self._turns)}, not {turn}")
        return turn

    # ------------------------------------------------------------------ changing

    def reset(self, system: str | None = None) -> None:
        """Forget the conversation; keep the system prompt unless ``system`` replaces it."""
        keep = self.system if system is None else system
        self._turns.clear()
        self.parent = None
        self._system = None if keep is None else {"role": "system", "content": keep}
        self._changed()

    def rewind(self, turn: int | Turn) -> None:
        """Go back to just after turn ``turn`` (0: the system prompt alone).

        The turns after it become stale: left out of the conversation, kept in the list so
        that running one of their cells again refreshes it on the new history.
        """
        n = self._number(turn, "rewind")
        changed = False
        for t in self._turns[n:]:
            if t.live:
                t.state, t.stale_since, changed = STALE, n, True
        if changed:
            self._changed()

    def fork(self, name: str, at: int | Turn | None = None) -> Session:
        """A session ``name`` that starts with this one's first ``at`` turns (default: all).

        It shares their KV: its first request finds them in this session's slot and copies
        them (a donor copy), so only its new message is read. Forking again into the same
        name replaces the shared turns; the fork's own turns after them become stale.
        """
        if name == self.name:
            raise InvalidRequestError(f"cannot fork {self.name} into itself")
        if self.store is None:
            raise InvalidRequestError(f"cannot fork {self.name}: it belongs to no session store")
        n = len(self._turns) if at is None else self._number(at, f"fork {self.name}")
        new = self.store.get(name)
        base = [Turn(copy.deepcopy(t.messages), t.cell, None, LIVE, t.runs, None,
                     t.source or self.name) for t in self._turns[:n] if t.live]
        own = [t for t in new._turns if t.source is None]
        for t in own:
            if t.live:
                t.state, t.stale_since = STALE, n
        new._system = copy.deepcopy(self._system)
        new._turns = base + own
        new.parent = (self.name, n)
        new._changed()
        return new

    def start(self, engine: EngineLike, content: Any, *, new: bool = False,
              system: str | None = None, cell: CellRef | None = None, replay: bool = False,
              **sampling: Any) -> PendingTurn:
        """Send ``content`` as a user message; returns the streaming :class:`PendingTurn`.

        With ``cell``, the turns of the cells before it are the history and its own turn is
        replaced when the reply ends; without, it is the next turn. ``new`` starts the
        conversation over first; ``system`` sets its system prompt. ``replay``: a cell that
        runs again may get the reply the cache holds for the same prompt and settings
        (:mod:`nbkv.engine.decoder`), on an engine that can replay.
        """
        if new:
            self.reset(system)
        elif system is not None:
            self.system = system
        own = self.turn(cell.id) if cell is not None else None
        n = self._turns.index(own) if own is not None else len(self._turns)
        history = [self._system] if self._system is not None else []
        layout = [0] * len(history)
        for i, t in enumerate(self._turns[:n], start=1):
            if t.live:
                history += t.messages
                layout += [i] * len(t.messages)
        user = {"role": "user", "content": content}
        if replay and own is not None and getattr(engine, "replays", False):
            sampling["replay"] = True
        stream = engine.chat(history + [user], session=self.name, stream=True, **sampling)
        if self.store is not None:
            self.store._started(stream.request_id, self.name, cell)
        return PendingTurn(self, user, stream, cell, tuple(layout) + (n + 1,))

    def chat(self, content: Any, engine: EngineLike | None = None, **sampling: Any) -> Reply:
        """Send ``content`` and wait for the whole reply (the store's engine by default)."""
        engine = engine or (self.store.require_engine() if self.store is not None else None)
        if engine is None:
            raise RuntimeError("no engine: pass engine= or load one with %kvcache load")
        with self.start(engine, content, **sampling) as turn:
            for _ in turn:
                pass
        return turn.reply

    def _commit(self, turn: Turn, layout: tuple[int, ...] = ()) -> TurnChange:
        """Put a finished turn in place: its cell's turn is replaced, later ones go stale."""
        old = self.turn(turn.cell.id) if turn.cell is not None else None
        if old is None:
            self._turns.append(turn)
            change = TurnChange(self.name, len(self._turns), "appended", turn.cell,
                                layout=layout)
        elif old.live and old.messages == turn.messages:
            # the same exchange again (a replay): the later turns were answered on it
            i = self._turns.index(old)
            turn.runs = old.runs + 1
            self._turns[i] = turn
            change = TurnChange(self.name, i + 1, "repeated", turn.cell, (), layout)
        else:
            i = self._turns.index(old)
            turn.runs = old.runs + 1
            self._turns[i] = turn
            stale = []
            for j, t in enumerate(self._turns[i + 1:], start=i + 2):
                if t.live:
                    t.state, t.stale_since = STALE, i + 1
                    stale.append(j)
            change = TurnChange(self.name, i + 1, "refreshed" if not old.live else "replaced",
                                turn.cell, tuple(stale), layout)
        self._changed(change)
        if turn.cell is not None and self.store is not None:  # a cell is one session's turn
            for other in self.store:
                if other is not self:
                    other._release(turn.cell.id)
        return change

    def _release(self, cell: str) -> None:
        """Cell ``cell`` now sends another session's turn: drop ours; later ones go stale."""
        old = self.turn(cell)
        if old is None:
            return
        i = self._turns.index(old)
        del self._turns[i]
        for t in self._turns[i:]:
            if t.live:
                t.state, t.stale_since = STALE, i
        self._changed()

    def _changed(self, change: TurnChange | None = None) -> None:
        self.version += 1
        if self.store is not None:
            self.store.events.publish(TurnsChanged(self.name, change))

    # ------------------------------------------------------------------ saving

    def state_dict(self) -> dict[str, Any]:
        """The session as JSON-ready data: system prompt, turns (cells, states), fork origin.

        ``messages`` (the live conversation) is kept as well, for readers of older saves.
        """
        return {"name": self.name, "messages": list(self.messages), "system": self._system,
                "turns": [t.state_dict() for t in self._turns],
                "parent": list(self.parent) if self.parent else None}

    def load_state(self, d: Mapping[str, Any]) -> None:
        """Replace this session's content with :meth:`state_dict`'s data.

        An older save's plain ``messages`` work too. ValueError when the data is malformed,
        and nothing changes then.
        """
        if "turns" not in d:
            msgs = d.get("messages")
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise ValueError(f"session {self.name!r}: malformed messages")
            self.messages = msgs
            return
        system, raw, parent = d.get("system"), d.get("turns"), d.get("parent")
        if system is not None and not isinstance(system, dict) or not isinstance(raw, list):
            raise ValueError(f"session {self.name!r}: malformed turns")
        turns = [Turn.from_state(t) for t in raw]
        if parent is not None and not (isinstance(parent, list) and len(parent) == 2):
            raise ValueError(f"session {self.name!r}: malformed fork origin {parent!r}")
        self._system, self._turns = system, turns
        self.parent = (str(parent[0]), int(parent[1])) if parent else None
        self._changed()

    def forks(self) -> list[Session]:
        """The sessions forked from this one, and theirs, in the same store."""
        out: list[Session] = []
        names = {self.name}
        for s in self.store or ():
            p, seen = s.parent, {s.name}
            while p is not None and p[0] not in names and p[0] not in seen and \
                    self.store is not None and p[0] in self.store:
                seen.add(p[0])
                p = self.store[p[0]].parent
            if p is not None and p[0] in names and s.name not in names:
                out.append(s)
        return out

    def __repr__(self) -> str:
        stale = sum(1 for t in self._turns if not t.live)
        return (f"Session({self.name!r}, {len(self.messages)} messages, {len(self._turns)} "
                f"turns{f' ({stale} stale)' if stale else ''})")


def _exchanges(msgs: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Messages cut into turns: each user message starts one.

    What precedes the first user message, if anything, is a turn of its own.
    """
    out: list[list[dict[str, Any]]] = []
    for m in msgs:
        if m.get("role") == "user" or not out:
            out.append([m])
        else:
            out[-1].append(m)
    return out


class PendingTurn:
    """A user message on its way: iterate for the reply's text deltas.

    The session is updated when the reply ends, is closed, or is interrupted
    (``KeyboardInterrupt`` while iterating); the engine's slot stays consistent either way.
    :attr:`change` then says what it did to the session's turns.
    """

    def __init__(self, session: Session, user: dict[str, Any], stream: ChatStream,
                 cell: CellRef | None = None, layout: tuple[int, ...] = ()) -> None:
        self.session = session
        self.user = user
        self.stream = stream
        self.cell = cell
        self.layout = layout  # the turn of each message sent (0: system prompt)
        self.committed = False
        self.change: TurnChange | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self.stream
        except BaseException as e:
            self.close(interrupted=isinstance(e, KeyboardInterrupt))
            raise
        self.close()

    @property
    def text(self) -> str:
        """Reply text received so far."""
        return self.stream.text

    @property
    def record(self) -> RequestRecord | None:
        """The request's record, once it ended."""
        return self.stream.record

    @property
    def reply(self) -> Reply:
        """The reply text with its record."""
        return Reply(self.stream.text, self.stream.record, self.stream.finish_reason)

    @property
    def note(self) -> str:
        """What the turn did to the session, in words ("" for a plain new turn)."""
        return self.change.describe(self.record) if self.change is not None else ""

    def close(self, interrupted: bool = True) -> None:
        """Stop the request if it still runs, then commit the turn to the session."""
        self.stream.close()
        if self.committed:
            return
        self.committed = True
        rec = self.stream.record
        if rec is not None and rec.error is None and (self.stream.text or not interrupted):
            turn = Turn([self.user, {"role": "assistant", "content": self.stream.text}],
                        self.cell, rec)
            self.change = self.session._commit(turn, self.layout)

    def __enter__(self) -> PendingTurn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class TurnsChanged(Notice):
    """A session's turns changed (a turn committed, a reset, rewind, fork, edit or restore).

    ``change`` says what a committed turn did; None for the other changes. ``session`` is
    None when sessions were dropped.
    """

    session: str | None
    change: TurnChange | None = None


class SessionStore:
    """Sessions by name, plus the engine they talk to (set by ``%kvcache load``).

    :attr:`events` publishes :class:`TurnsChanged` whenever a session changes
    (``store.events.subscribe(callback)``); the dashboard's conversation view follows it.
    """

    #: requests whose cell is remembered, for ``%kvcache history``
    ORIGINS = 1000

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self.engine: EngineLike | None = None
        self.autosaver: Any = None  # nbkv.store.autosave.Autosaver while autosave is on
        self.events = EventBus()
        self._origins: dict[int, tuple[str, CellRef | None]] = {}
        #: the model file and arguments the engine was loaded with (None: loaded otherwise)
        self.load_args: tuple[str, tuple[tuple[str, Any], ...]] | None = None

    def __getitem__(self, name: str) -> Session:
        return self._sessions[name]

    def __contains__(self, name: object) -> bool:
        return name in self._sessions

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, name: str | None = None) -> Session:
        """The session called ``name`` (default session if None), created when missing."""
        name = name or DEFAULT_SESSION
        if name not in self._sessions:
            self._sessions[name] = Session(name, store=self)
        return self._sessions[name]

    @staticmethod
    def check_state(name: str, state: Mapping[str, Any]) -> None:
        """Raise ValueError if ``state`` would not load into a session (checked on a scratch)."""
        Session(name).load_state(state)

    def subscribe(self, callback: Callable[[TurnsChanged], None]) -> Callable[[], None]:
        """Call ``callback`` on every :class:`TurnsChanged`; returns the unsubscribe function."""
        return self.events.subscribe(callback)  # type: ignore[arg-type]  # any event type

    def drop(self, name: str) -> None:
        """Forget a session (its KV stays cached until evicted)."""
        if self._sessions.pop(name, None) is not None:
            self.events.publish(TurnsChanged(None))

    def clear(self) -> None:
        """Forget every session."""
        self._sessions.clear()
        self._origins.clear()
        self.events.publish(TurnsChanged(None))

    def cell_of(self, record: RequestRecord) -> CellRef | None:
        """The notebook cell that sent the request of ``record`` (None: not from a cell)."""
        origin = self._origins.get(record.id)
        return origin[1] if origin is not None and origin[0] == record.session else None

    def _started(self, request_id: int, session: str, cell: CellRef | None) -> None:
        self._origins[request_id] = (session, cell)
        while len(self._origins) > self.ORIGINS:
            del self._origins[next(iter(self._origins))]

    def load(self, model_path: str | None = None, **engine_kwargs: Any) -> Engine:
        """Close the current engine (freeing its memory), then load and keep a new one.

        ``engine_kwargs`` go to :class:`~nbkv.Engine`. Sessions keep their messages: the
        next turn of each rebuilds its cache in the new engine.
        """
        from nbkv.engine.facade import Engine

        self.close_engine()
        self.engine = engine = Engine(model_path, **engine_kwargs)
        args = _settings(engine_kwargs)
        self.load_args = (str(engine.model.path.resolve()), tuple(sorted(args.items())))
        return engine

    def loaded(self, model_path: str, engine_kwargs: Mapping[str, Any]) -> bool:
        """True when the engine loaded (and still open) has this model file and arguments."""
        args = _settings(engine_kwargs)
        return (self.engine is not None and not getattr(self.engine, "closed", True)
                and self.load_args == (model_path, tuple(sorted(args.items()))))

    def connect(self, url: str, **kwargs: Any) -> LlamaServerEngine | OpenAIEngine:
        """Connect to a serving engine (:func:`nbkv.connect`), then close the old one.

        The old engine stays if the connection fails. Sessions keep their messages.
        """
        from nbkv.remote.connect import connect

        engine = connect(url, **kwargs)
        self.close_engine()
        self.engine = engine
        self.load_args = None
        return engine

    def autosave(self, path: Any, interval: float = 30.0) -> None:
        """Save the engine and sessions to ``path`` after requests, in the background.

        ``None`` stops it. Follows the loaded engine; only an in-kernel engine is autosaved
        (a server's slots are saved on demand: ``%kvcache save``).
        """
        from nbkv.store.autosave import Autosaver

        saver, engine = self.autosaver, self.engine
        if saver is not None and (path is None or saver.engine is not engine
                                  or saver.interval != interval or saver.path != path):
            saver.stop()
            self.autosaver = saver = None
        from nbkv.engine.facade import Engine

        if saver is None and path is not None and isinstance(engine, Engine):
            self.autosaver = Autosaver(engine, path, self, interval=interval)

    def close_engine(self) -> None:
        """Close the engine, if any, and return its memory to the system now."""
        if self.autosaver is not None:
            self.autosaver.stop()
            self.autosaver = None
        engine, self.engine = self.engine, None
        self.load_args = None
        self._origins.clear()  # request ids start again with the next engine
        if engine is not None:
            engine.close()
            del engine
            gc.collect()  # views and records may still point at it: free the native memory now

    def require_engine(self) -> EngineLike:
        """The loaded engine; raises RuntimeError when there is none."""
        if self.engine is None:
            raise RuntimeError(
                "no engine loaded: run %kvcache load in a notebook, or set "
                "nbkv.notebook.sessions.STORE.engine = nbkv.Engine()"
            )
        return self.engine


#: The kernel's store, shared by the magics, the widgets and ``nbkv.session()``.
STORE = SessionStore()
use_default_sessions(lambda: STORE)  # saves made without sessions= carry the kernel's


def session(name: str | None = None) -> Session:
    """The in-kernel session called ``name`` (the default session if None)."""
    return STORE.get(name)


def current_engine() -> EngineLike | None:
    """The engine loaded by ``%kvcache load``, or None."""
    return STORE.engine


def _settings(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments that make an engine what it is (not where its progress goes)."""
    return {k: v for k, v in engine_kwargs.items() if k not in ("on_load_progress", "progress")}
