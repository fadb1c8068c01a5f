"""Small comparison charts for the lessons: ``plot(title, series)``.

A notebook that compares figures (first-token time with and without the cache, salvage per
turn under three templates) shows them with :func:`plot`: grouped bars or lines, a legend,
a hover per point. Displayed, a chart is one MIME bundle: a plotly figure
(:mod:`nbkv.ui.chartfig`, drawn by the browser's jupyterlab-plotly) and the same chart as a
PNG (:mod:`nbkv.ui.raster`), which an untrusted notebook, GitHub and nbconvert show. The
inline SVG (:meth:`Plot.svg`) is for the report page. Colours from :mod:`nbkv.ui.palette`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbkv.ui.charts import axis, svg_rect, svg_root, svg_text
from nbkv.ui.display import esc
from nbkv.ui.palette import COLORS, INK, MUTED, NEUTRAL, PAPER, ROLE_COLORS, RULE, TEXT

#: the colours series get when none is given, in order
CYCLE = (ROLE_COLORS["user"], COLORS["prefilled"], COLORS["reused"], COLORS["generated"],
         COLORS["trimmed"], NEUTRAL)


@dataclass(frozen=True)
class Plot:
    """A chart of named series over 1, 2, 3, ...: grouped ``bars`` or ``lines``."""

    title: str
    series: Mapping[str, Sequence[float]]
    kind: str = "bars"
    x_title: str = ""
    y_title: str = ""
    colors: Mapping[str, str] = field(default_factory=dict)
    y_max: float | None = None
    width: int = 620
    height: int = 240

    def color(self, i: int, name: str) -> str:
        """The colour of series ``name`` (the ``i``-th)."""
        return self.colors.get(name) or CYCLE[i % len(CYCLE)]

    def svg(self) -> str:
        """The chart as an ``<svg>`` element, its legend beneath."""
        left, right, top, bottom = 54, 12, 30, 40
        pw, ph = self.width - left - right, self.height - top - bottom
        n = max((len(v) for v in self.series.values()), default=0) or 1
        ymax, ticks = axis(self.y_max or max([y for v in self.series.values() for y in v]
                                             + [1.0]), 4)
        yv = lambda v: top + ph - ph * min(v, ymax) / ymax  # noqa: E731
        cx = lambda i: left + pw * (i + 0.5) / n  # noqa: E731
        body = [svg_text(left, 18, self.title, size=13, color=INK)]
        for t in ticks:
            body.append(f'<line x1="{left}" x2="{left + pw}" y1="{yv(t):.1f}" y2="{yv(t):.1f}" '
                        f'stroke="{RULE}"/>' + svg_text(left - 4, yv(t) + 3, f"{t:g}", "end", 10,
                                                      MUTED))
        for i in range(n):
            body.append(svg_text(cx(i), top + ph + 14, str(i + 1), "middle", 10, MUTED))
        body.append(svg_text(left + pw / 2, top + ph + 30, self.x_title, "middle", 11, TEXT))
        body.append(f'<text x="12" y="{top + ph / 2:.1f}" font-size="11" fill="{TEXT}" '
                    f'transform="rotate(-90 12 {top + ph / 2:.1f})" text-anchor="middle">'
                    f"{esc(self.y_title)}</text>")
        slot = pw / n
        bw = slot * 0.8 / max(len(self.series), 1)
        for j, (name, values) in enumerate(self.series.items()):
            color = self.color(j, name)
            if self.kind == "lines":
                pts = " ".join(f"{cx(i):.1f},{yv(y):.1f}" for i, y in enumerate(values))
                body.append(f'<polyline points="{pts}" fill="none" stroke="{color}" '
                            'stroke-width="2"/>')
            for i, y in enumerate(values):
                tip = f"{name}, {self.x_title or 'x'} {i + 1}: {y:.4g} {self.y_title}".strip()
                if self.kind == "lines":
                    body.append(f'<circle cx="{cx(i):.1f}" cy="{yv(y):.1f}" r="3.5" '
                                f'fill="{color}"><title>{esc(tip)}</title></circle>')
                else:
                    x0 = left + slot * i + slot * 0.1 + bw * j
                    body.append(svg_rect(x0, yv(y), bw, top + ph - yv(y), color, tip))
        legend = "".join(
            f'<span style="margin-right:12px"><span style="display:inline-block;width:10px;'
            f'height:10px;background:{self.color(j, name)};margin-right:4px"></span>'
            f"{esc(name)}</span>" for j, name in enumerate(self.series))
        return (svg_root(self.width, self.height, "".join(body), "nbkv-plot", self.title)
                + f'<div class="nbkv-plot-legend" style="font:11px sans-serif;color:{TEXT};'
                  f'margin:2px 0 0 {left}px">{legend}</div>')

    def figure(self) -> dict[str, Any]:
        """The chart as a plotly figure (JSON: grouped bars or lines, a hover per point)."""
        xs = list(range(1, max((len(v) for v in self.series.values()), default=0) + 1))
        data = []
        for j, (name, values) in enumerate(self.series.items()):
            color = self.color(j, name)
            hover = (f"{name}, {self.x_title or 'x'} %{{x}}: %{{y:.4g}} {self.y_title}"
                     .strip() + "<extra></extra>")
            if self.kind == "lines":
                data.append({"type": "scatter", "mode": "lines+markers", "name": name,
                             "x": xs[:len(values)], "y": list(values),
                             "line": {"color": color, "width": 2}, "hovertemplate": hover})
            else:
                data.append({"type": "bar", "name": name, "x": xs[:len(values)],
                             "y": list(values), "marker": {"color": color},
                             "hovertemplate": hover})
        layout = {"title": {"text": self.title, "font": {"size": 13, "color": INK}},
                  "width": self.width, "height": self.height + 40, "barmode": "group",
                  "margin": {"l": 54, "r": 12, "t": 34, "b": 40},
                  "paper_bgcolor": PAPER, "plot_bgcolor": PAPER,
                  "font": {"family": "sans-serif", "size": 11, "color": TEXT},
                  "legend": {"orientation": "h", "y": -0.25},
                  "xaxis": {"title": {"text": self.x_title}, "tickmode": "linear", "dtick": 1},
                  "yaxis": {"title": {"text": self.y_title}, "gridcolor": RULE,
                            "rangemode": "tozero",
                            **({"range": [0, self.y_max]} if self.y_max else {})}}
        return {"data": data, "layout": layout}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        from nbkv.ui.chartfig import bundle
        from nbkv.ui.raster import plot_png

        return bundle(self.figure(), plot_png(self), repr(self))

    def __repr__(self) -> str:
        rows = "; ".join(f"{name}: {', '.join(f'{y:.4g}' for y in v)}"
                         for name, v in self.series.items())
        return f"{self.title} ({rows})"


def plot(title: str, series: Mapping[str, Sequence[float]], *, kind: str = "bars",
         x_title: str = "", y_title: str = "", colors: Mapping[str, str] | None = None,
         y_max: float | None = None) -> Plot:
    """A chart of ``series`` (name -> values at x = 1, 2, 3...), shown as inline SVG."""
    if kind not in ("bars", "lines"):
        raise ValueError(f"kind must be 'bars' or 'lines', not {kind!r}")
    return Plot(title, dict(series), kind, x_title, y_title, dict(colors or {}), y_max)
