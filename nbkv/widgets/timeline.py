"""Salvage and latency timeline: per request, salvage %, TTFT and tokens prefilled.

TTFT is drawn next to a no-cache estimate: the measured TTFT plus the time the reused tokens
would have taken to prefill at the prefill speed observed so far.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from traitlets import Int, validate

from ..events import RequestRecord
from ..palette import COLORS
from .feed import Feed, FeedView, LiveState

#: how each strategy is drawn in the salvage panel: reused is always green (the palette);
#: the strategy is the bar's pattern, named in plain words in the legend
STRATEGIES = {"hash-hit": ("same messages", ""),
              "hash-extend": ("conversation extended", ""),
              "prefix-salvage": ("token prefix salvaged", "/"),
              "spc": ("system prompt restored", "."), "miss": ("rebuilt", "x"),
              "off": ("cache off", "-")}
NEUTRAL = "#555555"


def prefill_rate(records: list[RequestRecord]) -> float:
    """Observed prefill speed (tokens/s) over requests that prefilled enough to measure."""
    done = [r for r in records if r.prefilled_tokens >= 16 and r.prefill_s > 0]
    secs = sum(r.prefill_s for r in done)
    return sum(r.prefilled_tokens for r in done) / secs if secs > 0 else 0.0


def no_cache_ttft(record: RequestRecord, rate: float) -> float | None:
    """Estimated TTFT (s) had nothing been cached; None without a measured rate."""
    return record.ttft_s + record.reused_tokens / rate if rate > 0 else None


def hover_text(r: RequestRecord) -> str:
    """What a learner reads when pointing at a request: who, what happened, the figures."""
    why = r.reason_text or r.strategy
    return (f"request {r.id} · {html.escape(r.session or 'no session')}<br>"
            f"{html.escape(why)}<br>reused {r.reused_tokens} of {r.prompt_tokens} tokens, "
            f"read {r.prefilled_tokens} new<br>first token after {r.ttft_s * 1000:.0f} ms")


class Timeline(FeedView, W.VBox):
    """Per-request salvage %, TTFT (with the no-cache estimate) and prefilled tokens."""

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
            legend=dict(orientation="h", y=-0.12, font=dict(size=11)), plot_bgcolor="white",
            hoverlabel=dict(align="left"),
        )
        self.figure.update_xaxes(tickformat="d", dtick=1, tick0=1)  # whole request numbers
        self.figure.update_xaxes(title_text="request #", row=3, col=1)
        self.figure.update_yaxes(range=[0, 105], title_text="%", row=1, col=1)
        self.figure.update_yaxes(title_text="ms", row=2, col=1)
        self.figure.update_yaxes(title_text="tokens", row=3, col=1)
        hover = "%{customdata}<extra></extra>"
        for label, pattern in STRATEGIES.values():
            self.figure.add_bar(name=label, x=[], y=[], hovertemplate=hover, row=1, col=1,
                                marker=dict(color=COLORS["reused"],
                                            pattern=dict(shape=pattern, fgcolor="white")))
        # a request that reused nothing still gets a mark at 0
        self.figure.add_scatter(name="nothing reused", x=[], y=[], mode="markers",
                                marker=dict(symbol="line-ew-open", size=14, color=NEUTRAL,
                                            line=dict(width=2, color=NEUTRAL)),
                                hovertemplate=hover, row=1, col=1)
        self.figure.add_scatter(name="TTFT", x=[], y=[], mode="lines+markers",
                                line=dict(color=NEUTRAL), marker=dict(color=NEUTRAL, size=7),
                                row=2, col=1, hovertemplate=hover, showlegend=False)
        self.figure.add_scatter(name="no-cache estimate", x=[], y=[], mode="lines+markers",
                                line=dict(color="#aaaaaa", dash="dash"),
                                marker=dict(color="#aaaaaa", size=5), row=2, col=1,
                                hovertemplate="request %{x}: ~%{y:.0f} ms had nothing been "
                                              "cached<extra></extra>")
        self.figure.add_bar(name="reused", x=[], y=[], marker_color=COLORS["reused"],
                            row=3, col=1, showlegend=False,
                            hovertemplate="request %{x}: %{y} tokens reused<extra></extra>")
        self.figure.add_bar(name="read new", x=[], y=[], marker_color=COLORS["prefilled"],
                            row=3, col=1, showlegend=False,
                            hovertemplate="request %{x}: %{y} tokens read<extra></extra>")
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
            for name in STRATEGIES:
                mine = [r for r in recs if r.strategy == name and r.reused_tokens]
                t = self.traces[STRATEGIES[name][0]]
                t.x = [r.id for r in mine]
                t.y = [r.salvage_pct for r in mine]
                t.customdata = [hover_text(r) for r in mine]
            none = [r for r in recs if not r.reused_tokens]
            self.traces["nothing reused"].x = [r.id for r in none]
            self.traces["nothing reused"].y = [0] * len(none)
            self.traces["nothing reused"].customdata = [hover_text(r) for r in none]
            ids = [r.id for r in recs]
            self.traces["TTFT"].x = ids
            self.traces["TTFT"].y = [r.ttft_s * 1000 for r in recs]
            self.traces["TTFT"].customdata = [hover_text(r) for r in recs]
            est = [no_cache_ttft(r, rate) for r in recs]
            self.traces["no-cache estimate"].x = [i for i, e in zip(ids, est) if e is not None]
            self.traces["no-cache estimate"].y = [e * 1000 for e in est if e is not None]
            self.traces["reused"].x = ids
            self.traces["reused"].y = [r.reused_tokens for r in recs]
            self.traces["read new"].x = ids
            self.traces["read new"].y = [r.prefilled_tokens for r in recs]
        self.shown = len(recs)
        self.note.value = "engine closed" if state.closed else ""


