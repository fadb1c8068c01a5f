"""Salvage and latency timeline: per request, salvage %, first-token time and tokens read.

The first-token time is drawn next to a no-cache estimate: the measured time plus the time
the reused tokens would have taken to read at the prefill speed observed so far. Every
salvage bar is "reused" green; the request's event (:mod:`nbkv.ui.vocabulary`) is its pattern.
Displayed in a notebook, it is a plotly figure of its own (:meth:`Timeline.chart`, with
its PNG), refreshed between requests; placed inside another layout it draws inline SVG
(:mod:`nbkv.ui.charts`). Both from the same :class:`nbkv.ui.charts.Point` list.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from traitlets import Bool, Int, observe, validate

from nbkv.core.events import counted
from nbkv.ui import chartfig, charts, raster, static
from nbkv.ui.charts import Point
from nbkv.ui.widgets.feed import Feed, FeedView, LiveState

prefill_rate = charts.prefill_rate
no_cache_ttft = charts.no_cache_ttft


class Timeline(FeedView, W.VBox):
    """Per-request salvage %, first-token time (with the no-cache estimate), tokens read.

    Redrawn only when the history changed (a request finished), not during one.
    :attr:`points` is what it shows (:class:`nbkv.ui.charts.Point` per request).
    """

    label = "timeline"
    max_requests = Int(50, help="Most recent requests shown")
    shown = Int(0, help="Requests drawn at the last redraw")
    svg = Bool(True, help="Draw the timeline in the widget as inline SVG (off when "
                          "displayed: its plotly chart is an output of its own)")

    def __init__(self, engine: Any, feed: Feed | None = None, max_requests: int = 50,
                 cell_of: Any = None, **kw: Any) -> None:
        self.engine = engine
        #: the notebook cell that sent a request (``record -> CellRef | None``), when known
        self.cell_of = cell_of
        self.points: list[Point] = []
        self._drawn: tuple[Any, ...] = ()
        self.hider = W.HTML()
        self.view = W.HTML()
        self.view.add_class("nbkv-timeline-view")
        self.note = W.HTML()
        super().__init__([self.hider, self.view, self.note], **kw)
        self.max_requests = max_requests
        self.add_class("nbkv-timeline")
        self.follow(engine, feed)

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
        self.points = charts.timeline_points(history, self.max_requests, self.cell_of)
        with self.hold_sync():
            self.view.value = charts.draw_timeline(self.points) if self.svg else ""
            self.shown = len(self.points)
            self.note.value = "engine closed" if state.closed else ""

    @observe("svg")
    def _svg_changed(self, change: Any) -> None:
        self._drawn = ()  # drawn again (or not) at the next redraw
        if not change["new"]:  # its chart is an output of its own now: not drawn here
            self.view.value = ""

    def chart_views(self) -> list[Any]:
        """Displayed, the timeline is a chart output of its own."""
        return [self]

    def chart(self) -> tuple[dict[str, Any], Any, str]:
        """The timeline now: its plotly figure, a function drawing its PNG, its text."""
        pts = charts.timeline_points(self.engine.history, self.max_requests, self.cell_of)
        return (chartfig.timeline_figure(pts), lambda: raster.timeline_png(pts),
                f"nbkv timeline: {counted(len(pts), 'request')}")

    def static_html(self) -> str:
        """The three panels as inline SVG (the saved notebook's fallback).

        Nothing once the chart is an output of its own.
        """
        if not self.svg:
            return ""
        return static.frame(static.timeline_svg(self.engine.history, self.max_requests),
                            "nbkv-timeline-static")
