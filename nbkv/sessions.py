"""The in-kernel conversation store: named sessions, their messages, and the engine they use.

Nothing here imports Jupyter. The ``%%chat`` magic and plain Python share one store::

    import nbkv
    s = nbkv.session("alice")          # created on first use
    s.messages[1]["content"] = "..."   # edit an earlier turn; the cache salvages what it can
    s.chat("And then?", max_tokens=32) # the same as a %%chat alice cell, without the display

A session's ``messages`` is the whole conversation (system prompt first, if any). A turn is
committed when its reply ends: the user message and the reply are appended together. An
interrupted turn keeps the partial reply; a turn that failed, or was interrupted before its
first token, leaves the history unchanged.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine
    from .events import RequestRecord
    from .protocol import EngineLike
    from .streams import ChatStream

DEFAULT_SESSION = "default"


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


@dataclass
class Session:
    """One named conversation: its messages (editable) and the records of its turns."""

    name: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    store: SessionStore | None = field(default=None, repr=False, compare=False)

    @property
    def system(self) -> str | None:
        """The system prompt, or None."""
        if self.messages and self.messages[0].get("role") == "system":
            return self.messages[0].get("content")
        return None

    @system.setter
    def system(self, text: str | None) -> None:
        has = bool(self.messages) and self.messages[0].get("role") == "system"
        if text is None:
            if has:
                del self.messages[0]
        elif has:
            self.messages[0] = {"role": "system", "content": text}
        else:
            self.messages.insert(0, {"role": "system", "content": text})

    def reset(self, system: str | None = None) -> None:
        """Forget the conversation; keep the system prompt unless ``system`` replaces it."""
        keep = self.system if system is None else system
        self.messages.clear()
        self.records.clear()
        self.system = keep

    @property
    def turns(self) -> int:
        """Number of user messages."""
        return sum(1 for m in self.messages if m.get("role") == "user")

    def start(self, engine: EngineLike, content: Any, *, new: bool = False,
              system: str | None = None, **sampling: Any) -> Turn:
        """Send ``content`` as the next user message; returns the streaming :class:`Turn`.

        ``new`` starts the conversation over first; ``system`` sets its system prompt.
        """
        if new:
            self.reset(system)
        elif system is not None:
            self.system = system
        user = {"role": "user", "content": content}
        stream = engine.chat(self.messages + [user], session=self.name, stream=True, **sampling)
        return Turn(self, user, stream)

    def chat(self, content: Any, engine: EngineLike | None = None, **sampling: Any) -> Reply:
        """Send ``content`` and wait for the whole reply (the store's engine by default)."""
        engine = engine or (self.store.require_engine() if self.store else None)
        if engine is None:
            raise RuntimeError("no engine: pass engine= or load one with %kvcache load")
        with self.start(engine, content, **sampling) as turn:
            for _ in turn:
                pass
        return turn.reply

    def __repr__(self) -> str:
        return f"Session({self.name!r}, {len(self.messages)} messages, {self.turns} turns)"


class Turn:
    """A user message and its streaming reply; iterate for text deltas.

    The session is updated when the reply ends, is closed, or is interrupted
    (``KeyboardInterrupt`` while iterating); the engine's slot stays consistent either way.
    """

    def __init__(self, session: Session, user: dict[str, Any], stream: ChatStream) -> None:
        self.session = session
        self.user = user
        self.stream = stream
        self.committed = False

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

    def close(self, interrupted: bool = True) -> None:
        """Stop the request if it still runs, then commit the turn to the session."""
        self.stream.close()
        if self.committed:
            return
        self.committed = True
        rec = self.stream.record
        if rec is not None and rec.error is None and (self.stream.text or not interrupted):
            self.session.messages.append(self.user)
            self.session.messages.append({"role": "assistant", "content": self.stream.text})
            self.session.records.append(rec)

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SessionStore:
    """Sessions by name, plus the engine they talk to (set by ``%kvcache load``)."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self.engine: EngineLike | None = None
        self.autosaver: Any = None  # nbkv.persist.Autosaver while autosave is on

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

    def drop(self, name: str) -> None:
        """Forget a session (its KV stays cached until evicted)."""
        self._sessions.pop(name, None)

    def clear(self) -> None:
        """Forget every session."""
        self._sessions.clear()

    def load(self, model_path: str | None = None, **engine_kwargs: Any) -> Engine:
        """Close the current engine (freeing its memory), then load and keep a new one.

        ``engine_kwargs`` go to :class:`~nbkv.engine.Engine`. Sessions keep their messages: the
        next turn of each rebuilds its cache in the new engine.
        """
        from .engine import Engine

        self.close_engine()
        self.engine = Engine(model_path, **engine_kwargs)
        return self.engine

    def connect(self, url: str, **kwargs: Any) -> EngineLike:
        """Connect to a serving engine (:func:`nbkv.remote.connect`), then close the old one.

        The old engine stays if the connection fails. Sessions keep their messages.
        """
        from .remote import connect

        engine = connect(url, **kwargs)
        self.close_engine()
        self.engine = engine
        return engine

    def autosave(self, path: Any, interval: float = 30.0) -> None:
        """Save the engine and sessions to ``path`` after requests, in the background.

        ``None`` stops it. Follows the loaded engine; only an in-kernel engine is autosaved
        (a server's slots are saved on demand: ``%kvcache save``).
        """
        from .persist import Autosaver

        saver, engine = self.autosaver, self.engine
        if saver is not None and (path is None or saver.engine is not engine
                                  or saver.interval != interval or saver.path != path):
            saver.stop()
            self.autosaver = saver = None
        if saver is None and path is not None and engine is not None \
                and hasattr(engine, "_native"):  # an in-kernel engine
            self.autosaver = Autosaver(engine, path, self, interval=interval)

    def close_engine(self) -> None:
        """Close the engine, if any, and return its memory to the system now."""
        if self.autosaver is not None:
            self.autosaver.stop()
            self.autosaver = None
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
            del engine
            gc.collect()  # views and records may still point at it: free the native memory now

    def require_engine(self) -> EngineLike:
        """The loaded engine; raises RuntimeError when there is none."""
        if self.engine is None:
            raise RuntimeError(
                "no engine loaded: run %kvcache load in a notebook, or set "
                "nbkv.sessions.STORE.engine = nbkv.Engine()"
            )
        return self.engine


#: The kernel's store, shared by the magics, the widgets and ``nbkv.session()``.
STORE = SessionStore()


def session(name: str | None = None) -> Session:
    """The in-kernel session called ``name`` (the default session if None)."""
    return STORE.get(name)


def current_engine() -> EngineLike | None:
    """The engine loaded by ``%kvcache load``, or None."""
    return STORE.engine
