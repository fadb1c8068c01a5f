"""Salvage and latency timeline: per request, salvage %, TTFT and tokens prefilled.

TTFT is drawn next to a no-cache estimate: the measured TTFT plus the time the reused tokens
would have taken to prefill at the prefill speed observed so far.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from traitlets import Int, validate

from ..events import RequestRecord
from ..palette import COLORS
from .feed import Feed, FeedView, LiveState

STRATEGY_COLORS = {"hash-hit": "#1b7e3c", "hash-extend": "#2e9e5b", "prefix-salvage": "#8cc63f",
                   "spc": "#3b7dd8", "miss": "#d9534f", "off": "#999999"}


def prefill_rate(records: list[RequestRecord]) -> float:
    """Observed prefill speed (tokens/s) over requests that prefilled enough to measure."""
    done = [r for r in records if r.prefilled_tokens >= 16 and r.prefill_s > 0]
    secs = sum(r.prefill_s for r in done)
    return sum(r.prefilled_tokens for r in done) / secs if secs > 0 else 0.0


def no_cache_ttft(record: RequestRecord, rate: float) -> float | None:
    """Estimated TTFT (s) had nothing been cached; None without a measured rate."""
    return record.ttft_s + record.reused_tokens / rate if rate > 0 else None


class Timeline(FeedView, W.VBox):
    """Per-request salvage %, TTFT (with the no-cache estimate) and prefilled tokens."""

    max_requests = Int(50, help="Most recent requests shown")
    shown = Int(0, help="Requests drawn at the last redraw")

    def __init__(self, engine: Any, feed: Feed | None = None, max_requests: int = 50,
                 **kw: Any) -> None:
        self.engine = engine
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.09,
                            row_heights=[0.32, 0.4, 0.28],
                            subplot_titles=("salvage %", "time to first token (ms)",
                                            "prompt tokens"))
        self.figure = go.FigureWidget(fig)
        self.figure.update_layout(
            height=460, margin=dict(l=60, r=10, t=30, b=40), barmode="stack",
            legend=dict(orientation="h", y=-0.1, font=dict(size=11)), plot_bgcolor="white",
        )
        self.figure.update_xaxes(title_text="request", row=3, col=1)
        self.figure.update_yaxes(range=[0, 105], row=1, col=1)
        for name, color in STRATEGY_COLORS.items():
            self.figure.add_bar(name=name, x=[], y=[], marker_color=color, legendgroup=name,
                                hovertemplate="request %{x}<br>salvage %{y:.0f}%<br>"
                                              "%{customdata}<extra>" + name + "</extra>",
                                row=1, col=1)
        self.figure.add_scatter(name="TTFT", x=[], y=[], mode="lines", line=dict(color="#555"),
                                row=2, col=1, hoverinfo="skip")
        # markers per strategy (one trace each: per-point colours do not survive batched
        # restyles in the front end)
        for name, color in STRATEGY_COLORS.items():
            self.figure.add_scatter(name="TTFT " + name, x=[], y=[], mode="markers",
                                    marker=dict(color=color, size=9), legendgroup=name,
                                    showlegend=False, row=2, col=1,
                                    hovertemplate="request %{x}: %{y:.0f} ms<extra>TTFT "
                                                  + name + "</extra>")
        self.figure.add_scatter(name="no-cache estimate", x=[], y=[], mode="lines+markers",
                                line=dict(color="#d9534f", dash="dash"), row=2, col=1,
                                hovertemplate="request %{x}: ~%{y:.0f} ms<extra>"
                                              "no-cache estimate</extra>")
        self.figure.add_bar(name="reused", x=[], y=[], marker_color=COLORS["reused"],
                            row=3, col=1, showlegend=False)
        self.figure.add_bar(name="prefilled", x=[], y=[], marker_color=COLORS["prefilled"],
                            row=3, col=1, showlegend=False)
        self.traces = {t.name: t for t in self.figure.data}
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
        """Redraw from the engine's request history."""
        history = self.engine.history
        recs = history[-self.max_requests:]
        rate = prefill_rate(history)
        with self.figure.batch_update():
            for name in STRATEGY_COLORS:
                mine = [r for r in recs if r.strategy == name]
                t = self.traces[name]
                t.x = [r.id for r in mine]
                t.y = [r.salvage_pct for r in mine]
                t.customdata = [f"{r.session or '-'} · slot {r.slot} · reused "
                                f"{r.reused_tokens}/{r.prompt_tokens}" for r in mine]
            ids = [r.id for r in recs]
            self.traces["TTFT"].x = ids
            self.traces["TTFT"].y = [r.ttft_s * 1000 for r in recs]
            for name in STRATEGY_COLORS:
                mine = [r for r in recs if r.strategy == name]
                self.traces["TTFT " + name].x = [r.id for r in mine]
                self.traces["TTFT " + name].y = [r.ttft_s * 1000 for r in mine]
            est = [no_cache_ttft(r, rate) for r in recs]
            self.traces["no-cache estimate"].x = [i for i, e in zip(ids, est) if e is not None]
            self.traces["no-cache estimate"].y = [e * 1000 for e in est if e is not None]
            self.traces["reused"].x = ids
            self.traces["reused"].y = [r.reused_tokens for r in recs]
            self.traces["prefilled"].x = ids
            self.traces["prefilled"].y = [r.prefilled_tokens for r in recs]
        self.shown = len(recs)
        self.note.value = "engine closed" if state.closed else ""


