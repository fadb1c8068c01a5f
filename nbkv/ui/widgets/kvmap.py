"""KV position map: what each slot's positions hold, and what the latest request did to them.

Per slot, two rows over positions ``0..capacity``: the messages (coloured by role, solid,
parted by a white edge, image spans marked) and the slot's latest request (reused, read
new, generated, with the trimmed span as a thin dark-red band); checkpoints (hybrid and
recurrent models) are ticks on the messages row. Hover a span for its message index, role,
token range and a preview. A request in flight is drawn as it progresses.

Displayed in a notebook, the map is a plotly figure of its own (:meth:`KVMap.chart`: hover,
zoom; its PNG for untrusted notebooks, GitHub and nbconvert), refreshed between requests; a
map placed inside another layout draws inline SVG (:mod:`nbkv.ui.charts`) in the widget.
Both from one :class:`nbkv.ui.charts.MapModel`.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from traitlets import Bool, Int, observe

from nbkv.core.events import counted
from nbkv.ui import chartfig, charts, raster, static
from nbkv.ui.charts import BARS, MapModel  # noqa: F401 - the map's bars, for callers
from nbkv.ui.display import esc, legend_html
from nbkv.ui.palette import COLORS
from nbkv.ui.widgets.feed import Feed, FeedView, LiveState


class KVMap(FeedView, W.VBox):
    """A map of every slot's KV positions, redrawn as events arrive.

    With ``fit`` (default) the x axis spans the positions in use (at least an eighth of the
    capacity) rather than the whole capacity, so short conversations stay legible.
    :attr:`model` is what it shows (:class:`nbkv.ui.charts.MapModel`). Alone (its own feed),
    the map carries the legend; in a dashboard the dashboard does. For a server that keeps
    its own cache (OpenAI-compatible: vLLM) the rows are sessions, their latest request cut
    at the server's block size, with a band over what the server holds now (its KV cache
    events).
    """

    label = "KV map"
    segments = Int(0, help="Bars drawn at the last redraw")
    fit = Bool(True, help="Fit the x axis to the positions in use")
    svg = Bool(True, help="Draw the map in the widget as inline SVG (off when displayed: "
                          "its plotly chart is an output of its own)")

    def __init__(self, engine: Any, feed: Feed | None = None, **kw: Any) -> None:
        self.engine = engine
        self.model = MapModel([], engine.n_ctx, engine.n_ctx)
        self.hider = W.HTML()
        self.view = W.HTML()
        self.view.add_class("nbkv-kvmap-view")
        self.note = W.HTML()
        parts = [self.hider, *([W.HTML(legend_html())] if feed is None else []), self.view,
                 self.note]
        super().__init__(parts, **kw)
        self.add_class("nbkv-kvmap")
        self.follow(engine, feed)

    def render(self, state: LiveState) -> None:
        """Redraw from the slot snapshots and the requests in flight (sent if it changed)."""
        m = self.model = self.map_model(state)
        with self.hold_sync():
            # an unchanged value sends nothing
            self.view.value = charts.draw_kvmap(m) if self.svg else ""
            self.segments = m.segments
            self.note.value = "engine closed" if state.closed else "".join(
                f'<div class="nbkv-unverified" style="color:{COLORS["trimmed"]};'
                f'font-size:12px">✗ {esc(row)}: not verified: {esc(note)}</div>'
                for row, note in m.unverified)

    @observe("svg")
    def _svg_changed(self, change: Any) -> None:
        if not change["new"]:  # its chart is an output of its own now: not drawn here
            self.view.value = ""

    def map_model(self, state: LiveState) -> MapModel:
        """What the map shows in ``state``: every slot's rows (requests in flight drawn)."""
        running = {run.record.slot: run for run in state.running.values()}
        return charts.engine_map(self.engine, state.last_by_slot, running, self.fit)

    def chart_views(self) -> list[Any]:
        """Displayed, the map is a chart output of its own."""
        return [self]

    def chart(self) -> tuple[dict[str, Any], Any, str]:
        """The map as it is now: its plotly figure, a function drawing its PNG, its text."""
        state = self.feed.snapshot()  # the render thread may be drawing meanwhile
        m = self.model if state.closed else self.map_model(state)  # closed: as last drawn
        return (chartfig.kvmap_figure(m), lambda: raster.kvmap_png(m),
                f"nbkv KV map: {m.title}, {counted(m.segments, 'span')}")

    def static_html(self) -> str:
        """The map as inline SVG, with its legend (the saved notebook's fallback).

        Once its chart is an output of its own (``svg`` off), only the legend and notes.
        """
        state = self.feed.snapshot()  # the render thread may be drawing meanwhile
        if state.closed:
            return static.frame("engine closed", "nbkv-kvmap-static")
        if not self.svg:
            return static.frame(legend_html(), "nbkv-kvmap-static")
        return static.frame(legend_html() + charts.draw_kvmap(self.map_model(state)),
                            "nbkv-kvmap-static")
