"""KV position map: what each slot's positions hold, and what the latest request did to them.

Per slot, two rows over positions ``0..capacity``: the messages (coloured by role,
alternating shade per message, media spans marked) and the slot's latest request (reused,
prefilled, generated, with the trimmed span as a thin red band); checkpoints (hybrid and
recurrent models) are ticks on the messages row. Hover shows the message
index, role, token range and a preview. A request in flight is drawn as it progresses.
"""

from __future__ import annotations

import html
from dataclasses import replace
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from traitlets import Bool, Int

from ..events import GENERATED, PREFILLED, REUSED, RequestRecord, Segment
from ..palette import COLORS, MEDIA_COLOR, ROLE_COLORS
from .feed import Feed, FeedView, LiveState, Running

ROLE_COLORS = {**ROLE_COLORS, "other": "#999999"}
TODO = "to prefill"
STATE_COLORS = {REUSED: COLORS["reused"], PREFILLED: COLORS["prefilled"],
                TODO: "#f8d3ad", GENERATED: COLORS["generated"], "trimmed": COLORS["trimmed"]}
HOVER = ("message %{customdata[0]} · %{customdata[1]}<br>tokens %{customdata[2]}–"
         "%{customdata[3]}<br>%{customdata[4]}<extra>%{fullData.name}</extra>")


def _label(slot: int, row: str) -> str:
    return f"slot {slot}" if row == "messages" else f"slot {slot} · request"


class KVMap(FeedView, W.VBox):
    """A plotly map of every slot's KV positions, redrawn as events arrive.

    With ``fit`` (default) the x axis spans the positions in use (at least an eighth of the
    capacity) rather than the whole capacity, so short conversations stay legible.
    """

    segments = Int(0, help="Bars drawn at the last redraw")
    fit = Bool(True, help="Fit the x axis to the positions in use")

    def __init__(self, engine: Any, feed: Feed | None = None, **kw: Any) -> None:
        self.engine = engine
        n, cap = engine.n_slots, engine.n_ctx
        self.labels = [_label(i, row) for i in range(n) for row in ("messages", "request")]
        self.figure = go.FigureWidget(layout=dict(
            height=90 + 52 * n, margin=dict(l=110, r=10, t=30, b=30), barmode="overlay",
            title=dict(text="KV positions per slot", font=dict(size=13)),
            xaxis=dict(range=[0, cap], title=None, showgrid=True),
            yaxis=dict(categoryorder="array", categoryarray=self.labels, autorange="reversed"),
            legend=dict(orientation="h", y=-0.12, font=dict(size=11)),
            plot_bgcolor="white", hoverlabel=dict(align="left"),
        ))
        self.figure.add_bar(name="capacity", orientation="h", y=self.labels,
                            x=[cap] * len(self.labels), base=[0] * len(self.labels),
                            marker_color="#f3f3f3", hoverinfo="skip", showlegend=False)
        for role, color in ROLE_COLORS.items():
            self._add(role, color, width=0.8)
        self._add("media", MEDIA_COLOR, width=0.8)
        for state in (REUSED, PREFILLED, TODO, GENERATED):
            self._add(state, STATE_COLORS[state], width=0.8)
        self._add("trimmed", STATE_COLORS["trimmed"], width=0.25, offset=0.15)
        # hybrid and recurrent models: where a slot can go back to (nbkv.slot_kv)
        self.figure.add_scatter(
            name="checkpoint", mode="markers", x=[], y=[],
            marker=dict(symbol="line-ns-open", size=16, color="#222",
                        line=dict(width=2, color="#222")),
            hovertemplate="checkpoint at position %{x}<extra></extra>")
        # where the latest request's prompt left the cached conversation (nbkv.reasons)
        self.figure.add_scatter(
            name="divergence", mode="markers", x=[], y=[], customdata=[],
            marker=dict(symbol="triangle-down", size=11, color="#222"),
            hovertemplate="%{customdata}<extra>divergence</extra>")
        # remote engines: a slot whose server content differs from nbkv's table
        self.figure.add_scatter(
            name="not verified", mode="markers", x=[], y=[], customdata=[],
            marker=dict(symbol="x", size=12, color=COLORS["trimmed"]),
            hovertemplate="%{customdata}<extra>not verified</extra>")
        self.traces = {t.name: t for t in self.figure.data}
        self.note = W.HTML()
        super().__init__([self.figure, self.note], **kw)
        self.add_class("nbkv-kvmap")
        self._own_feed = feed is None
        self.feed = feed or Feed(engine)
        self.feed.attach(self)

    def _add(self, name: str, color: str, width: float, offset: float | None = None) -> None:
        self.figure.add_bar(
            name=name, orientation="h", y=[], x=[], base=[], customdata=[],
            marker=dict(color=color, line=dict(color="white", width=1)), width=width,
            offset=offset, hovertemplate=HOVER, showlegend=name != "other",
        )

    def render(self, state: LiveState) -> None:
        """Redraw from the slot snapshots and the requests in flight."""
        bars: dict[str, list[tuple[str, int, int, list[Any], float]]] = {
            name: [] for name in self.traces
            if name not in ("capacity", "checkpoint", "divergence", "not verified")}
        diverged: list[tuple[int, str, str]] = []
        marks: list[tuple[int, str]] = []
        unverified: list[tuple[str, str]] = []
        for s in self.engine.slots():
            if not s.verified:
                unverified.append((_label(s.index, "messages"), html.escape(s.note)))
            marks.extend((pos, _label(s.index, "messages")) for pos in s.checkpoints)
            run = state.running_on(s.index)
            segs = run.record.segments if run is not None else s.segments
            top, bottom = _label(s.index, "messages"), _label(s.index, "request")
            for seg in _messages(segs):
                name = "media" if seg.is_media else (
                    seg.role if seg.role in ROLE_COLORS else "other")
                shade = 1.0 if seg.message % 2 == 0 else 0.7
                bars[name].append((top, seg.start, seg.end, _hover(seg), shade))
            rec = run.record if run is not None else state.last_by_slot.get(s.index)
            for state_name, seg in _states(segs, run):
                bars[state_name].append((bottom, seg.start, seg.end, _hover(seg), 1.0))
            if rec is not None and rec.slot == s.index and rec.divergence is not None:
                d = rec.divergence
                diverged.append((d.position, bottom, html.escape(
                    f"request {rec.id}: {rec.reason_text or rec.reason}")))
            if rec is not None and rec.trimmed_tokens and rec.slot == s.index:
                a, b = rec.reused_tokens, rec.reused_tokens + rec.trimmed_tokens
                bars["trimmed"].append((bottom, a, b, ["-", "trimmed", a, b,
                                                       f"{rec.trimmed_tokens} tokens cut"], 1.0))
        cap = self.engine.n_ctx
        used = max((r[2] for rows in bars.values() for r in rows), default=0)
        right = min(cap, max(int(used * 1.15) + 1, cap // 8)) if self.fit else cap
        with self.figure.batch_update():
            self.figure.layout.xaxis.range = [0, right]
            self.figure.layout.title.text = (
                f"KV positions per slot (capacity {cap}"
                + (f", showing 0–{right})" if right < cap else ")"))
            for name, rows in bars.items():
                t = self.traces[name]
                t.y = [r[0] for r in rows]
                t.base = [r[1] for r in rows]
                t.x = [r[2] - r[1] for r in rows]
                t.customdata = [r[3] for r in rows]
                t.marker.opacity = [r[4] for r in rows] if rows else None
            cp = self.traces["checkpoint"]
            cp.x = [m[0] for m in marks]
            cp.y = [m[1] for m in marks]
            dv = self.traces["divergence"]
            dv.x = [m[0] for m in diverged]
            dv.y = [m[1] for m in diverged]
            dv.customdata = [m[2] for m in diverged]
            nv = self.traces["not verified"]
            nv.x = [0] * len(unverified)
            nv.y = [m[0] for m in unverified]
            nv.customdata = [m[1] for m in unverified]
        self.segments = sum(len(rows) for rows in bars.values())
        self.note.value = "engine closed" if state.closed else "".join(
            f'<div class="nbkv-unverified" style="color:{COLORS["trimmed"]};font-size:12px">'
            f"✗ {label}: not verified: {note}</div>" for label, note in unverified)




def _hover(seg: Segment) -> list[Any]:
    text = seg.preview or ""
    if seg.is_media:
        text = f"image {seg.image_name or (seg.image_hash or '')[:12]}"
        if seg.embeddings and seg.embeddings != seg.length:  # M-RoPE: fewer positions
            text += f": {seg.embeddings} image tokens on {seg.length} positions"
    return [seg.message, seg.role, seg.start, seg.end, html.escape(text)]


def _messages(segs: tuple[Segment, ...]) -> list[Segment]:
    """Merge the state pieces of each message (and of each image) into one span."""
    out: list[Segment] = []
    for seg in segs:
        prev = out[-1] if out else None
        if (prev is not None and prev.message == seg.message and prev.end == seg.start
                and prev.is_media == seg.is_media
                and getattr(prev, "image_hash", None) == getattr(seg, "image_hash", None)):
            out[-1] = replace(prev, end=seg.end, preview=prev.preview or seg.preview)
        else:
            out.append(seg)
    return out


def _states(segs: tuple[Segment, ...], run: Running | None) -> list[tuple[str, Segment]]:
    """The latest request's pieces; for one in flight, split what is prefilled so far."""
    if run is None:
        return [(seg.state, seg) for seg in segs]
    rec: RequestRecord = run.record
    cut = rec.reused_tokens + run.prefilled
    out: list[tuple[str, Segment]] = []
    for seg in segs:
        if seg.state != PREFILLED:
            out.append((seg.state, seg))
            continue
        for lo, hi, name in ((seg.start, min(seg.end, cut), PREFILLED),
                             (max(seg.start, cut), seg.end, TODO)):
            if hi > lo:
                out.append((name, replace(seg, start=lo, end=hi, state=name)))
    if run.generated:
        a = rec.prompt_tokens
        out.append((GENERATED, Segment(a, a + run.generated, len(segs), "assistant", GENERATED,
                                       "(generating)")))
    return out
