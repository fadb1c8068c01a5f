"""The cache dashboard: header, slot cards, KV map, timeline and conversations, on one feed."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
from traitlets import Float, observe, validate

from nbkv.core.protocol import ServerCacheRows
from nbkv.ui import static
from nbkv.ui.display import legend_html
from nbkv.ui.palette import ERROR
from nbkv.ui.widgets.conversations import Conversations
from nbkv.ui.widgets.feed import Feed, LiveState, with_static
from nbkv.ui.widgets.kvmap import KVMap
from nbkv.ui.widgets.slots import SlotCards
from nbkv.ui.widgets.snapshot import Displayed, close_parts, register
from nbkv.ui.widgets.timeline import Timeline


class CacheDashboard(Displayed, W.VBox):
    """Everything about an engine's KV cache, updated live from its events.

    Displayed, it is the live view plus a static snapshot beside it that follows the cache
    (what a saved notebook shows: :mod:`nbkv.ui.widgets.snapshot`).
    """

    label = "dashboard"
    interval = Float(0.25, help="Seconds between redraws (at most ~4/s by default)")

    def __init__(self, engine: Any, interval: float = 0.25, live: bool = True,
                 sessions: Any = None, **kw: Any) -> None:
        self.engine = engine
        self.feed = Feed(engine, interval, live=live)
        self.header = W.HTML()
        self.header.add_class("nbkv-header")
        self.feed.attach(self)
        self.slots = SlotCards(engine, self.feed)
        self.kvmap = KVMap(engine, self.feed)
        self.timeline = Timeline(engine, self.feed,
                                 cell_of=getattr(sessions, "cell_of", None))
        self.conversations = Conversations(engine, self.feed, sessions)  # default: the kernel's
        self.legend = W.HTML(legend_html())
        self.hider = W.HTML()
        parts = [self.hider, self.header, self.legend, self.slots, self.kvmap, self.timeline,
                 self.conversations]
        if not engine.n_slots and not isinstance(engine, ServerCacheRows):  # no KV map to draw
            parts.remove(self.kvmap)
        super().__init__(parts, **kw)
        self.interval = interval
        self.add_class("nbkv-dashboard")
        register(self)

    @validate("interval")
    def _sane_interval(self, proposal: Any) -> float:
        if proposal["value"] < 0.02:
            raise ValueError("interval must be >= 0.02 s")
        return proposal["value"]

    @observe("interval")
    def _interval_changed(self, change: Any) -> None:
        self.feed.interval = change["new"]

    def render(self, state: LiveState) -> None:
        """Redraw the header line."""
        self.header.value = static.header_html(self.engine, len(state.running), state.closed)

    def show_error(self, message: str) -> None:
        """Show a redraw failure in the header."""
        self.header.value = f'<span style="color:{ERROR}">{html.escape(message)}</span>'

    def chart_views(self) -> list[Any]:
        """Displayed, the KV map and the timeline are chart outputs of their own."""
        return [v for v in (self.kvmap, self.timeline) if v in self.children]

    def static_html(self) -> str:
        """The whole dashboard as static HTML and inline SVG, as it is now.

        Without the charts once they are outputs of their own.
        """
        state = self.feed.snapshot()
        return static.dashboard_html(self.engine, state, extra=(
            "" if state.closed else self.conversations.static_html()),
            charts=self.timeline.svg)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return with_static(super()._repr_mimebundle_(**kwargs), self.static_html)

    def close(self) -> None:
        """Stop the updates and close every piece."""
        self.feed.close()
        for w in (self.slots, self.kvmap, self.timeline, self.conversations, self.header,
                  self.legend, self.hider):
            w.close()
        super().close()
        close_parts(self)
