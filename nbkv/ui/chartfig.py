"""The charts as plotly figures: JSON for ``application/vnd.plotly.v1+json``, and their bundles.

Every chart is first computed as data (:class:`nbkv.ui.charts.MapModel`, :class:`Point`,
:class:`nbkv.ui.plots.Plot`); this module turns that data into a plotly figure (a plain
dict in plotly's JSON schema: nothing here imports plotly, the browser's jupyterlab-plotly
extension draws it, with hover and zoom), and :mod:`nbkv.ui.raster` draws the same data as
a PNG. :func:`bundle` puts both in one MIME bundle: JupyterLab, Notebook 7 and VS Code show
the figure; an untrusted notebook, GitHub and nbconvert show the picture.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from nbkv.core.events import counted
from nbkv.ui import vocabulary as vocab
from nbkv.ui.charts import BARS, MapModel, Point, bar_term
from nbkv.ui.palette import (
    CAPACITY,
    COLORS,
    ESTIMATE,
    INK,
    MUTED,
    NEUTRAL,
    PAPER,
    RULE,
    TEXT,
)

PLOTLY_MIME = "application/vnd.plotly.v1+json"
#: the longest message text a hover carries (the figure stays small)
HOVER_CHARS = 80
#: a span's hover: its kind's words, then message, role, token range and text (customdata)
_HOVER_BAR = ("{words} · message %{{customdata[0]}} · %{{customdata[1]}}<br>"
              "tokens %{{customdata[2]}}–%{{customdata[3]}}<br>%{{customdata[4]}}<extra></extra>")


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= HOVER_CHARS else text[:HOVER_CHARS - 1] + "…"


def _layout(title: str, height: int, **extra: Any) -> dict[str, Any]:
    return {"title": {"text": title, "font": {"size": 13, "color": INK}, "x": 0.01},
            "height": height, "margin": {"l": 110, "r": 12, "t": 34, "b": 36},
            "paper_bgcolor": PAPER, "plot_bgcolor": PAPER,
            "font": {"family": "sans-serif", "size": 11, "color": TEXT},
            "legend": {"orientation": "h", "y": -0.12, "font": {"size": 10}},
            "hoverlabel": {"align": "left"}, **extra}


# ------------------------------------------------------------------ KV map


def _map_bars(m: MapModel) -> list[dict[str, Any]]:
    """One horizontal bar trace per kind of span (its legend entry), hover per span."""
    traces: list[dict[str, Any]] = []
    for name, bars in m.bars.items():
        if not bars:
            continue
        words, color = BARS[name]
        thin = {"trimmed": (0.25, 0.1), "held": (0.2, -0.45)}.get(name)
        # a request row's span: its message's text is on the message row above it (an
        # image's positions, and a trimmed band, say what they are)
        texts = [_short(b.text) if not b.row.endswith(" · request") or name == "trimmed"
                 or b.text.startswith("image ") else "" for b in bars]
        trace: dict[str, Any] = {
            "type": "bar", "orientation": "h", "name": words, "legendgroup": name,
            "y": [b.row for b in bars], "x": [b.end - b.start for b in bars],
            "base": [b.start for b in bars],
            "marker": {"color": color, "line": {"color": PAPER, "width": 1}},
            "customdata": [[b.message, b.role, b.start, b.end, t]
                           for b, t in zip(bars, texts, strict=True)],
            "hovertemplate": _HOVER_BAR.format(words=words), "meta": {"nbkv": name},
        }
        if any(b.shade != 1.0 for b in bars):
            trace["marker"]["opacity"] = [b.shade for b in bars]
        if thin is not None:
            trace["width"], trace["offset"] = thin
            trace["hovertemplate"] = f"{words}: %{{customdata[4]}}<extra></extra>"
        traces.append(trace)
    return traces


def _map_marks(m: MapModel) -> list[dict[str, Any]]:
    """Checkpoints, divergences and unverified slots as markers, each with its hover."""
    out: list[dict[str, Any]] = []
    cps = [(row, pos) for row, pos in m.checkpoints if pos <= m.right]
    if cps:
        words = vocab.MARKS["checkpoint-mark"].words
        out.append({"type": "scatter", "mode": "markers", "name": words,
                    "x": [p for _, p in cps], "y": [r for r, _ in cps],
                    "marker": {"symbol": "line-ns", "size": 16, "color": INK,
                               "line": {"color": INK, "width": 2}},
                    "hovertemplate": f"{words} at %{{x}}<extra></extra>",
                    "meta": {"nbkv": "checkpoint"}})
    divs = [(row, pos, what) for row, pos, what in m.divergences if pos <= m.right]
    if divs:
        words = vocab.MARKS["divergence"].words
        out.append({"type": "scatter", "mode": "markers", "name": words,
                    "x": [p for _, p, _ in divs], "y": [r for r, _, _ in divs],
                    "text": [f"{words}: {w}" for _, _, w in divs],
                    "marker": {"symbol": "triangle-down", "size": 11, "color": INK},
                    "hovertemplate": "%{text}<extra></extra>", "meta": {"nbkv": "divergence"}})
    if m.unverified:
        out.append({"type": "scatter", "mode": "markers", "name": "not verified",
                    "x": [0] * len(m.unverified), "y": [r for r, _ in m.unverified],
                    "text": [f"not verified: {note}" for _, note in m.unverified],
                    "marker": {"symbol": "x", "size": 12, "color": COLORS["trimmed"]},
                    "hovertemplate": "%{text}<extra></extra>", "meta": {"nbkv": "unverified"}})
    return out


def kvmap_figure(m: MapModel) -> dict[str, Any]:
    """:class:`MapModel` as a plotly figure: slots as rows, a hover per span, zoomable."""
    capacity = {"type": "bar", "orientation": "h", "y": list(m.rows),
                "x": [m.n_ctx] * len(m.rows), "base": [0] * len(m.rows),
                "marker": {"color": CAPACITY}, "hoverinfo": "skip", "showlegend": False,
                "meta": {"nbkv": "capacity"}}
    height = 90 + 26 * max(len(m.rows), 1)
    layout = _layout(m.title, height, barmode="overlay", bargap=0.15, meta={"nbkv": "kvmap"})
    layout["xaxis"] = {"range": [0, m.right], "title": {"text": "KV position"},
                       "gridcolor": RULE, "zeroline": False}
    layout["yaxis"] = {"categoryorder": "array", "categoryarray": list(m.rows),
                       "autorange": "reversed", "fixedrange": True}
    return {"data": [capacity, *_map_bars(m), *_map_marks(m)], "layout": layout}


# ------------------------------------------------------------------ timeline


def point_label(p: Point) -> str:
    """A request on the timeline's x axis: its number, and its cell's when known."""
    return f"#{p.id}" + (f" {p.cell}" if p.cell else "")


def _salvage_traces(pts: Sequence[Point], xs: list[str]) -> list[dict[str, Any]]:
    """Panel 1: one bar trace per event (its pattern), a ring for a request reusing none."""
    out: list[dict[str, Any]] = []
    codes = list(dict.fromkeys(p.bar for p in pts))
    for code in codes:
        term = bar_term(code)
        sel = [(x, p) for x, p in zip(xs, pts, strict=True) if p.bar == code]
        if code == "nothing-reused":
            out.append({"type": "scatter", "mode": "markers", "name": term.words,
                        "x": [x for x, _ in sel], "y": [0] * len(sel),
                        "text": [p.text.replace("\n", "<br>") for _, p in sel],
                        "marker": {"symbol": "circle-open", "size": 9, "color": NEUTRAL},
                        "hovertemplate": "%{text}<extra></extra>", "meta": {"nbkv": code}})
            continue
        out.append({"type": "bar", "name": term.words, "x": [x for x, _ in sel],
                    "y": [p.salvage_pct for _, p in sel],
                    "text": [p.text.replace("\n", "<br>") for _, p in sel],
                    "textposition": "none", "hovertemplate": "%{text}<extra></extra>",
                    "marker": {"color": term.color, "line": {"color": PAPER, "width": 0.5},
                               "pattern": {"shape": term.pattern, "fgcolor": PAPER,
                                           "size": 6, "solidity": 0.35}},
                    "meta": {"nbkv": code}})
    return out


def _ttft_traces(pts: Sequence[Point], xs: list[str]) -> list[dict[str, Any]]:
    """Panel 2: the first-token time (hover: its parts), and the no-cache estimate."""
    out: list[dict[str, Any]] = [{
        "type": "scatter", "mode": "lines+markers", "name": "first token", "x": xs,
        "y": [p.ttft_ms for p in pts], "yaxis": "y2",
        "text": [f"request {p.id}<br>{p.ttft_text}" for p in pts],  # its words: panel 1
        "hovertemplate": "%{text}<extra></extra>", "line": {"color": NEUTRAL, "width": 1.5},
        "marker": {"size": 6, "color": NEUTRAL}, "meta": {"nbkv": "ttft"}}]
    est = [(x, p.estimate_ms) for x, p in zip(xs, pts, strict=True) if p.estimate_ms is not None]
    if est:
        out.append({"type": "scatter", "mode": "lines", "name": "no-cache estimate",
                    "x": [x for x, _ in est], "y": [v for _, v in est], "yaxis": "y2",
                    "line": {"color": ESTIMATE, "dash": "dash", "width": 1.5},
                    "hovertemplate": "no-cache estimate %{y:.0f} ms<extra></extra>",
                    "meta": {"nbkv": "estimate"}})
    return out


def _token_traces(pts: Sequence[Point], xs: list[str]) -> list[dict[str, Any]]:
    """Panel 3: prompt tokens, reused (stacked under) read new."""
    return [{"type": "bar", "name": vocab.STATES[state].words, "x": xs,
             "y": [getattr(p, attr) for p in pts], "yaxis": "y3",
             "marker": {"color": COLORS[state]}, "meta": {"nbkv": state},
             "hovertemplate": f"request %{{x}}: %{{y}} tokens {vocab.STATES[state].words}"
                              "<extra></extra>"}
            for state, attr in (("reused", "reused"), ("prefilled", "read"))]


def timeline_figure(pts: Sequence[Point]) -> dict[str, Any]:
    """:func:`nbkv.ui.charts.timeline_points` as a plotly figure: three panels, one x axis."""
    xs = [point_label(p) for p in pts]
    layout = _layout("per request: prompt served from cache, first token, prompt tokens", 430,
                     barmode="stack", bargap=0.3, meta={"nbkv": "timeline"})
    layout["margin"]["l"] = 60
    layout["legend"]["y"] = -0.16
    layout["xaxis"] = {"type": "category", "title": {"text": "request # [cell]"},
                       "categoryorder": "array", "categoryarray": xs}
    for key, title, domain in (("yaxis", "served from cache (%)", [0.70, 1.0]),
                               ("yaxis2", "first token (ms)", [0.36, 0.64]),
                               ("yaxis3", "prompt tokens", [0.0, 0.30])):
        layout[key] = {"title": {"text": title, "font": {"size": 10}}, "domain": domain,
                       "gridcolor": RULE, "rangemode": "tozero", "anchor": "x"}
    layout["yaxis"]["range"] = [0, 100]
    if not pts:
        layout["annotations"] = [{"text": "no request yet: the timeline starts with the first "
                                  "one", "showarrow": False, "x": 0.5, "y": 0.5,
                                  "xref": "paper", "yref": "paper",
                                  "font": {"color": MUTED}}]
    data = [*_salvage_traces(pts, xs), *_ttft_traces(pts, xs), *_token_traces(pts, xs)]
    return {"data": data, "layout": layout}


# ------------------------------------------------------------------ the bundle


class WithChart:
    """What a command shows, then its chart: two outputs, one MIME bundle each.

    ``%kvcache slots`` is its table and the KV map, ``%kvcache history`` its table and the
    timeline. A terminal (or ``str``) gets the table's text alone; the table's own fields
    (``rows``, ``_repr_html_``, ...) read through.
    """

    def __init__(self, shown: Any, figure: dict[str, Any], png: Any, text: str) -> None:
        self.shown, self.figure, self.png, self.text = shown, figure, png, text

    def __getattr__(self, name: str) -> Any:
        if name == "shown":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.shown, name)

    def bundle(self) -> dict[str, Any]:
        """The chart's bundle (its PNG drawn now)."""
        return bundle(self.figure, self.png(), self.text)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.shown)
        display(self.bundle(), raw=True)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self.shown))

    def __str__(self) -> str:
        return str(self.shown)


def slots_chart(shown: Any, engine: Any) -> WithChart:
    """``shown`` (the slots table), then the engine's KV map as a chart."""
    from nbkv.ui.charts import engine_map
    from nbkv.ui.raster import kvmap_png
    from nbkv.ui.static import last_by_slot

    m = engine_map(engine, last_by_slot(engine))
    return WithChart(shown, kvmap_figure(m), lambda: kvmap_png(m), f"KV map: {m.title}")


def history_chart(shown: Any, history: Sequence[Any], last: int,
                  cell_of: Any = None) -> WithChart:
    """``shown`` (the history table), then its last ``last`` requests as the timeline."""
    from nbkv.ui.charts import timeline_points
    from nbkv.ui.raster import timeline_png

    pts = timeline_points(history, max(last, 1), cell_of)
    return WithChart(shown, timeline_figure(pts), lambda: timeline_png(pts),
                     f"timeline: {counted(len(pts), 'request')}")


def bundle(figure: dict[str, Any], png: bytes, text: str) -> dict[str, Any]:
    """One chart's MIME bundle: the plotly figure, its PNG, and a line of plain text.

    No ``text/html``: a notebook that is not trusted strips its SVG (a wall of hover text),
    while ``image/png`` shows everywhere (untrusted, GitHub, nbconvert).
    """
    return {PLOTLY_MIME: figure, "image/png": base64.b64encode(png).decode("ascii"),
            "text/plain": text}


def bundle_size(b: dict[str, Any]) -> int:
    """Bytes a bundle sends (its JSON), for the size budget of an update."""
    import json

    return len(json.dumps(b, separators=(",", ":")).encode())
