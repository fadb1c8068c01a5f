"""KV position map: what each slot's positions hold, and what the latest request did to them.

Per slot, two rows over positions ``0..capacity``: the messages (coloured by role,
alternating shade per message, image spans marked) and the slot's latest request (reused,
read new, generated, with the trimmed span as a thin red band); checkpoints (hybrid and
recurrent models) are ticks on the messages row. Hover shows the message index, role, token
range and a preview. A request in flight is drawn as it progresses. Trace names are the
words of :mod:`nbkv.ui.vocabulary`.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from traitlets import Bool, Int

from nbkv.core.events import GENERATED, PREFILLED, REUSED, Segment
from nbkv.ui import static
from nbkv.ui import vocabulary as vocab
from nbkv.ui.display import legend_html
from nbkv.ui.map_rows import held_caption, held_text, map_rows, map_title, row_labels
from nbkv.ui.palette import CAPACITY, COLORS, INK, MEDIA_COLOR, PAPER, ROLE_COLORS
from nbkv.ui.widgets.feed import Feed, FeedView, LiveState

TODO = static.TODO
STATE_COLORS = static.STATE_COLORS
HOVER = ("message %{customdata[0]} · %{customdata[1]}<br>tokens %{customdata[2]}–"
         "%{customdata[3]}<br>%{customdata[4]}<extra>%{fullData.name}</extra>")
#: the bar traces: code -> (words shown in the legend and hovers, colour)
BARS = {**{role: (vocab.ROLES[role].words if role in vocab.ROLES else role, color)
           for role, color in ROLE_COLORS.items()},
        "image": (vocab.ROLES["image"].words, MEDIA_COLOR),
        **{state: (vocab.STATES[state].words, STATE_COLORS[state])
           for state in (REUSED, PREFILLED, TODO, GENERATED)},
        "trimmed": (vocab.STATES["trimmed"].words, STATE_COLORS["trimmed"]),
        "held": (vocab.MARKS["server-held"].words, vocab.MARKS["server-held"].color)}
#: thin bands over a row: (width, offset) in row units
BANDS = {"trimmed": (0.25, 0.15), "held": (0.2, -0.4)}


class KVMap(FeedView, W.VBox):
    """A plotly map of every slot's KV positions, redrawn as events arrive.

    With ``fit`` (default) the x axis spans the positions in use (at least an eighth of the
    capacity) rather than the whole capacity, so short conversations stay legible. A redraw
    sends only the traces that changed. For a server that keeps its own cache
    (OpenAI-compatible: vLLM) the rows are sessions, their latest request cut at the server's
    block size, with a band over what the server holds now (its KV cache events).
    """

    segments = Int(0, help="Bars drawn at the last redraw")
    fit = Bool(True, help="Fit the x axis to the positions in use")

    def __init__(self, engine: Any, feed: Feed | None = None, **kw: Any) -> None:
        self.engine = engine
        rows, server = map_rows(engine)
        cap = max(engine.n_ctx, 1)
        self.labels = [label for s in rows for label in row_labels(s, server)]
        n = len(rows)
        # the legend sits above the plot, so the x axis's numbers are never under it
        self.figure = go.FigureWidget(layout=dict(
            height=120 + 52 * n, margin=dict(l=110, r=10, t=64, b=30), barmode="overlay",
            title=dict(text="KV positions per slot", font=dict(size=13), y=0.98,
                       yanchor="top"),
            xaxis=dict(range=[0, cap], title=None, showgrid=True),
            yaxis=dict(categoryorder="array", categoryarray=self.labels, autorange="reversed"),
            legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=11)),
            plot_bgcolor=PAPER, hoverlabel=dict(align="left"),
        ))
        self.figure.add_bar(name="capacity", orientation="h", y=self.labels,
                            x=[cap] * len(self.labels), base=[0] * len(self.labels),
                            marker_color=CAPACITY, hoverinfo="skip", showlegend=False)
        self.traces: dict[str, Any] = {}
        for code, (words, color) in BARS.items():
            width, offset = BANDS.get(code, (0.8, None))
            self.traces[code] = self.figure.add_bar(
                name=words, orientation="h", y=[], x=[], base=[], customdata=[],
                marker=dict(color=color, line=dict(color=PAPER, width=1)),
                width=width, offset=offset, hovertemplate=HOVER,
                showlegend=code not in ("other", "held")).data[-1]
        # hybrid and recurrent models: where a slot can go back to (nbkv.kv.slot_kv)
        self.traces["checkpoint"] = self.figure.add_scatter(
            name=vocab.MARKS["checkpoint-mark"].words, mode="markers", x=[], y=[],
            marker=dict(symbol="line-ns-open", size=16, color=INK, line=dict(width=2, color=INK)),
            hovertemplate="checkpoint at position %{x}<extra></extra>").data[-1]
        # where the latest request's prompt left the cached conversation (nbkv.kv.reasons)
        self.traces["divergence"] = self.figure.add_scatter(
            name=vocab.MARKS["divergence"].words, mode="markers", x=[], y=[], customdata=[],
            marker=dict(symbol="triangle-down", size=11, color=INK),
            hovertemplate="%{customdata}<extra></extra>").data[-1]
        # remote engines: a slot whose server content differs from nbkv's table
        self.traces["not verified"] = self.figure.add_scatter(
            name="not verified", mode="markers", x=[], y=[], customdata=[],
            marker=dict(symbol="x", size=12, color=COLORS["trimmed"]),
            hovertemplate="%{customdata}<extra>not verified</extra>").data[-1]
        # what each trace shows now (the rows drawn at creation included)
        n_labels = len(self.labels)
        self._sent: dict[tuple[str, str], Any] = {
            ("yaxis", "categoryarray"): self.labels, ("layout", "height"): 120 + 26 * n_labels,
            ("capacity", "y"): self.labels, ("capacity", "x"): [cap] * n_labels,
            ("capacity", "base"): [0] * n_labels}
        self.note = W.HTML()
        super().__init__([self.figure, self.note], **kw)
        self.add_class("nbkv-kvmap")
        self._own_feed = feed is None
        self.feed = feed or Feed(engine)
        self.feed.attach(self)

    def render(self, state: LiveState) -> None:
        """Redraw from the slot snapshots and the requests in flight (changed traces only)."""
        bars: dict[str, list[tuple[str, int, int, list[Any], float]]] = {k: [] for k in BARS}
        diverged: list[tuple[int, str, str]] = []
        marks: list[tuple[int, str]] = []
        unverified: list[tuple[str, str]] = []
        rows, server = map_rows(self.engine)
        labels = [label for s in rows for label in row_labels(s, server)]
        block = getattr(self.engine, "block_size", None)
        for s in rows:
            top, bottom = row_labels(s, server)
            if not s.verified:
                unverified.append((top, html.escape(s.note)))
            marks.extend((pos, top) for pos in s.checkpoints)
            # a server's session row shows its latest finished request (no slot to follow)
            run = None if server else state.running_on(s.index)
            segs = run.record.segments if run is not None else s.segments
            for seg in static.messages(segs):
                shade = 1.0 if seg.message % 2 == 0 else 0.7
                bars[static.role_key(seg)].append((top, seg.start, seg.end, _hover(seg), shade))
            if s.server_cached:
                bars["held"].append((top, 0, s.server_cached, [
                    "-", vocab.MARKS["server-held"].words, 0, s.server_cached,
                    html.escape(held_text(s, block))], 1.0))
            rec = None if server else static.latest(s, run, state.last_by_slot.get(s.index))
            for state_name, seg in static.states(segs, run):
                bars[state_name].append((bottom, seg.start, seg.end, _hover(seg), 1.0))
            if rec is not None and rec.divergence is not None:
                d = rec.divergence
                diverged.append((d.position, bottom, html.escape(
                    f"request {rec.id}: {vocab.reason_line(rec)}")))
            if rec is not None and rec.trimmed_tokens:
                a, b = rec.reused_tokens, rec.reused_tokens + rec.trimmed_tokens
                bars["trimmed"].append((bottom, a, b, ["-", vocab.STATES["trimmed"].words, a, b,
                                                       html.escape(static.trimmed_text(rec))],
                                        1.0))
        used = max((r[2] for spans in bars.values() for r in spans), default=0)
        cap = max(self.engine.n_ctx, used, 1)  # a server that did not say its length
        right = min(cap, max(int(used * 1.15) + 1, cap // 8)) if self.fit else cap
        layout = self.figure.layout
        capacity = self.figure.data[0]
        updates: list[tuple[str, Any, str, Any]] = [
            ("xaxis", layout.xaxis, "range", [0, right]),
            ("title", layout.title, "text", map_title(cap, right, server, block)),
            ("yaxis", layout.yaxis, "categoryarray", labels),
            ("layout", layout, "height", 120 + 26 * len(labels)),
            ("capacity", capacity, "y", labels),
            ("capacity", capacity, "x", [cap] * len(labels)),
            ("capacity", capacity, "base", [0] * len(labels))]
        for name, spans in bars.items():
            t = self.traces[name]
            updates += [(name, t, "y", [r[0] for r in spans]),
                        (name, t, "base", [r[1] for r in spans]),
                        (name, t, "x", [r[2] - r[1] for r in spans]),
                        (name, t, "customdata", [r[3] for r in spans]),
                        (name, t.marker, "opacity", [r[4] for r in spans] if spans else None)]
        for name, points in (("checkpoint", [(x, y, None) for x, y in marks]),
                             ("divergence", diverged),
                             ("not verified", [(0, y, note) for y, note in unverified])):
            t = self.traces[name]
            updates += [(name, t, "x", [p[0] for p in points]),
                        (name, t, "y", [p[1] for p in points])]
            if name != "checkpoint":
                updates.append((name, t, "customdata", [p[2] for p in points]))
        # only what changed goes to the front end (a redraw there costs the shared cores)
        changed = [u for u in updates if self._sent.get((u[0], u[2])) != u[3]]
        if changed:
            with self.figure.batch_update():
                for key, obj, prop, value in changed:
                    setattr(obj, prop, value)
                    self._sent[(key, prop)] = value
        self.segments = sum(len(spans) for spans in bars.values())
        self.note.value = "engine closed" if state.closed else "".join(
            f'<div class="nbkv-unverified" style="color:{COLORS["trimmed"]};font-size:12px">'
            f"✗ {label}: not verified: {note}</div>" for label, note in unverified) + (
            f'<div style="font-size:11px">{html.escape(held_caption())}</div>'
            if server and any(s.server_cached is not None for s in rows) else "")

    def static_html(self) -> str:
        """The map as inline SVG, with its legend (the saved notebook's fallback)."""
        state = self.feed.snapshot()  # the render thread may be drawing meanwhile
        if state.closed:
            return static.frame("engine closed", "nbkv-kvmap-static")
        running = {run.record.slot: run for run in state.running.values()}
        rows, server = map_rows(self.engine)
        return static.frame(legend_html() + static.kvmap_svg(
            rows, self.engine.n_ctx, state.last_by_slot, running, self.fit, server=server,
            block_size=getattr(self.engine, "block_size", None)), "nbkv-kvmap-static")


def _hover(seg: Segment) -> list[Any]:
    return [seg.message, seg.role, seg.start, seg.end, html.escape(static.segment_text(seg))]
