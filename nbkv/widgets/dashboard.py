"""The cache dashboard: header, slot cards, KV map, timeline and conversations, on one feed."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
from traitlets import Float, observe, validate

from ..display import engine_label, legend_html, slots_label
from .conversations import Conversations
from .feed import Feed, LiveState
from .kvmap import KVMap
from .slots import SlotCards
from .timeline import Timeline


class CacheDashboard(W.VBox):
    """Everything about an engine's KV cache, updated live from its events."""

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
        self.timeline = Timeline(engine, self.feed)
        self.conversations = Conversations(engine, self.feed, sessions)  # default: the kernel's
        self.legend = W.HTML(legend_html())
        parts = [self.header, self.legend, self.slots, self.kvmap, self.timeline,
                 self.conversations]
        if not engine.n_slots:  # a server that manages its own slots: no KV map to draw
            parts.remove(self.kvmap)
        super().__init__(parts, **kw)
        self.interval = interval
        self.add_class("nbkv-dashboard")

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
        e = self.engine
        if state.closed:
            self.header.value = "<b>nbkv</b> · engine closed (load a new one and run " \
                                "%kvcache widget again)"
            return
        s = e.stats()
        running = len(state.running)
        self.header.value = (
            f'<div style="font:13px sans-serif"><b>nbkv</b> · '
            f"{html.escape(engine_label(e))} · {slots_label(e)} · "
            f"cache {e.cache} · {s['requests']} requests, {s['salvage_pct']:.0f}% of prompt "
            f"tokens from cache · {running} running</div>"
        )

    def show_error(self, message: str) -> None:
        """Show a redraw failure in the header."""
        self.header.value = f'<span style="color:#c00">{html.escape(message)}</span>'

    def close(self) -> None:
        """Stop the updates and close every piece."""
        self.feed.close()
        for w in (self.slots, self.kvmap, self.timeline, self.conversations, self.header,
                  self.legend):
            w.close()
        super().close()
