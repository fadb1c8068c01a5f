"""The conversation view on the dashboard: each session's turns in cell order, live or stale."""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from traitlets import Int

from nbkv.store.session_state import kernel_sessions
from nbkv.ui.conversation_view import conversation_html
from nbkv.ui.widgets.feed import Feed, FeedView, LiveState
from nbkv.ui.widgets.snapshot import register


def _nothing() -> None:
    pass


class Conversations(FeedView, W.VBox):
    """Every session's turns, redrawn when a turn commits (session events) or a request ends.

    A re-run ``%%chat`` cell cannot change the outputs of the cells after it; this view shows
    which of their turns are now stale, and where the conversations branch.
    """

    label = "conversations"
    turns = Int(0, help="Turns over all sessions at the last redraw")
    stale = Int(0, help="Stale turns over all sessions at the last redraw")

    def __init__(self, engine: Any, feed: Feed | None = None,
                 sessions: Any = None, **kw: Any) -> None:
        self.engine = engine
        # default: the kernel's session store when nbkv's sessions are in use (it registers
        # itself: nbkv.store.session_state.use_default_sessions), else none
        self.sessions = kernel_sessions(sessions)
        self.view = W.HTML()
        self.view.add_class("nbkv-conversations-view")
        self.note = W.HTML()
        self.hider = W.HTML()
        super().__init__([self.hider, self.view, self.note], **kw)
        self.add_class("nbkv-conversation-view")
        self._own_feed = feed is None
        self.feed = feed or Feed(engine)
        # a store follows its sessions' turns (before the first draw: no turn falls between);
        # with none in use there is nothing to follow
        subscribe = getattr(self.sessions, "subscribe", None)
        self._unsubscribe = subscribe(self.feed.push) if subscribe is not None else _nothing
        self.feed.attach(self)
        register(self)

    def static_html(self) -> str:
        """The conversations as static HTML, as they are now (the saved notebook's view)."""
        closed = self.feed.snapshot().closed
        return conversation_html(list(self.sessions), *self._where(closed))

    def _where(self, closed: bool) -> tuple[Any, Any]:
        """The engine's slots and parked conversations (nothing once it is closed)."""
        if closed:
            return (), ()
        return self.engine.slots(), getattr(self.engine, "parked", tuple)()

    def render(self, state: LiveState) -> None:
        """Redraw every session's conversation."""
        sessions = list(self.sessions)
        with self.hold_sync():
            self.view.value = conversation_html(sessions, *self._where(state.closed))
            self.turns = sum(len(s.turns) for s in sessions)
            self.stale = sum(1 for s in sessions for t in s.turns if not t.live)

    def close(self) -> None:
        """Stop following the sessions, then close."""
        self._unsubscribe()
        super().close()
