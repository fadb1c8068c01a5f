"""Salvage and latency timeline: per request, salvage %, first-token time and tokens read.

The first-token time is drawn next to a no-cache estimate: the measured time plus the time
the reused tokens would have taken to read at the prefill speed observed so far. Every
salvage bar is "reused" green; the request's event (:mod:`nbkv.ui.vocabulary`) is its pattern.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from traitlets import Int, validate

from nbkv.core.events import RequestRecord
from nbkv.ui import static
from nbkv.ui import vocabulary as vocab
from nbkv.ui.figures import ttft_text
from nbkv.ui.palette import COLORS, ESTIMATE, NEUTRAL, PAPER
from nbkv.ui.widgets.feed import Feed, FeedView, LiveState

prefill_rate = static.prefill_rate
no_cache_ttft = static.no_cache_ttft
NOTHING = vocab.MARKS["nothing-reused"].words


def hover_text(r: RequestRecord) -> str:
    """What a learner reads when pointing at a request: who, what happened, the figures."""
    return static.esc(static.request_text(r)).replace("\n", "<br>")


class Timeline(FeedView, W.VBox):
    """Per-request salvage %, first-token time (with the no-cache estimate), tokens read.

    Redrawn only when the history changed (a request finished), not during one.
    """

    max_requests = Int(50, help="Most recent requests shown")
    shown = Int(0, help="Requests drawn at the last redraw")

    def __init__(self, engine: Any, feed: Feed | None = None, max_requests: int = 50,
                 **kw: Any) -> None:
        self.engine = engine
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.11,
                            row_heights=[0.32, 0.4, 0.28],
                            subplot_titles=("prompt served from cache (%)",
                                            "time to first token (ms)", "prompt tokens"))
        self.figure = go.FigureWidget(fig)
        self.figure.update_layout(
            height=480, margin=dict(l=60, r=10, t=50, b=40), barmode="stack",
            legend=dict(orientation="h", y=-0.12, font=dict(size=11)), plot_bgcolor=PAPER,
            hoverlabel=dict(align="left"),
        )
        self.figure.update_xaxes(tickformat="d", dtick=1, tick0=1)  # whole request numbers
        self.figure.update_xaxes(title_text="request #", row=3, col=1)
        self.figure.update_yaxes(range=[-8, 105], title_text="%", row=1, col=1)
        self.figure.update_yaxes(title_text="ms", row=2, col=1)
        self.figure.update_yaxes(title_text="tokens", row=3, col=1)
        hover = "%{customdata}<extra></extra>"
        self.traces: dict[str, Any] = {}
        for code, term in vocab.EVENTS.items():
            self.figure.add_bar(name=term.words, x=[], y=[], hovertemplate=hover, row=1, col=1,
                                marker=dict(color=term.color,
                                            pattern=dict(shape=term.pattern, fgcolor=PAPER)))
            self.traces[code] = self.figure.data[-1]
        # a request that reused nothing still gets a mark: an open circle, not a line
        self.figure.add_scatter(name=NOTHING, x=[], y=[], mode="markers",
                                marker=dict(symbol="circle-open", size=9, color=NEUTRAL,
                                            line=dict(width=2, color=NEUTRAL)),
                                hovertemplate=hover, row=1, col=1)
        self.figure.add_scatter(name="first token", x=[], y=[], mode="lines+markers",
                                line=dict(color=NEUTRAL), marker=dict(color=NEUTRAL, size=7),
                                row=2, col=1, hovertemplate=hover)
        self.figure.add_scatter(name="no-cache estimate", x=[], y=[], mode="lines+markers",
                                line=dict(color=ESTIMATE, dash="dash"),
                                marker=dict(color=ESTIMATE, size=5), row=2, col=1,
                                hovertemplate="request %{x}: ~%{y:.0f} ms had nothing been "
                                              "cached<extra></extra>")
        reused, read = vocab.STATES["reused"].words, vocab.STATES["prefilled"].words
        self.figure.add_bar(name=reused, x=[], y=[], marker_color=COLORS["reused"],
                            row=3, col=1, showlegend=False,
                            hovertemplate=f"request %{{x}}: %{{y}} tokens {reused}"
                                          "<extra></extra>")
        self.figure.add_bar(name=read, x=[], y=[], marker_color=COLORS["prefilled"],
                            row=3, col=1, showlegend=False,
                            hovertemplate=f"request %{{x}}: %{{y}} tokens {read}"
                                          "<extra></extra>")
        for t in self.figure.data[len(vocab.EVENTS):]:
            self.traces[t.name] = t
        self._drawn: tuple[Any, ...] = ()
        self.note = W.HTML()
        super().__init__([self.figure, self.note], **kw)
        self.max_requests = max_requests
        self.add_class("nbkv-timeline")
        self._own_feed = feed is None
        self.feed = feed or Feed(engine)
        self.feed.attach(self)

    @validate("max_requests")
    def _at_least_one(self, proposal: Any) -> int:
        if proposal["value"] < 1:
            raise ValueError("max_requests must be >= 1")
        return proposal["value"]

    def render(self, state: LiveState) -> None:
        """Redraw from the engine's request history, if it changed since the last redraw."""
        history = self.engine.history
        key = (len(history), history[-1].id if history else None, self.max_requests,
               state.closed)
        if key == self._drawn:
            return
        self._drawn = key
        recs = history[-self.max_requests:]
        rate = prefill_rate(history)
        with self.figure.batch_update():
            for code, t in list(self.traces.items())[:len(vocab.EVENTS)]:
                mine = [r for r in recs if vocab.bar(r).code == code and r.reused_tokens]
                t.x = [r.id for r in mine]
                t.y = [r.salvage_pct for r in mine]
                t.customdata = [hover_text(r) for r in mine]
            none = [r for r in recs if not r.reused_tokens]
            self.traces[NOTHING].x = [r.id for r in none]
            self.traces[NOTHING].y = [0] * len(none)
            self.traces[NOTHING].customdata = [hover_text(r) for r in none]
            ids = [r.id for r in recs]
            first = self.traces["first token"]
            first.x = ids
            first.y = [r.ttft_s * 1000 for r in recs]
            first.customdata = [hover_text(r) + "<br>" + static.esc(ttft_text(r))
                                for r in recs]
            est = [no_cache_ttft(r, rate) for r in recs]
            self.traces["no-cache estimate"].x = [i for i, e in zip(ids, est) if e is not None]
            self.traces["no-cache estimate"].y = [e * 1000 for e in est if e is not None]
            self.traces[vocab.STATES["reused"].words].x = ids
            self.traces[vocab.STATES["reused"].words].y = [r.reused_tokens for r in recs]
            self.traces[vocab.STATES["prefilled"].words].x = ids
            self.traces[vocab.STATES["prefilled"].words].y = [r.prefilled_tokens for r in recs]
        self.shown = len(recs)
        self.note.value = "engine closed" if state.closed else ""

    def static_html(self) -> str:
        """The three panels as inline SVG (the saved notebook's fallback)."""
        return static.frame(static.timeline_svg(self.engine.history, self.max_requests),
                            "nbkv-timeline-static")
