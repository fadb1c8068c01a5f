"""The charts as PNG pictures, drawn with Pillow from the same chart models as the figures.

The static half of a chart's MIME bundle (:func:`nbkv.ui.chartfig.bundle`): what an untrusted
notebook, GitHub and nbconvert show (they drop a figure's JSON, and an untrusted notebook
strips inline SVG). Drawn without a browser from :class:`nbkv.ui.charts.MapModel`,
:class:`nbkv.ui.charts.Point` and :class:`nbkv.ui.plots.Plot`, in the palette's colours and
the vocabulary's hatches, with a legend. Pillow is imported when a picture is drawn.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nbkv.ui import vocabulary as vocab
from nbkv.ui.charts import BARS, MapModel, Point, axis, bar_term, row_ys
from nbkv.ui.palette import CAPACITY, COLORS, ESTIMATE, INK, MUTED, NEUTRAL, PAPER, RULE, TEXT

if TYPE_CHECKING:
    from nbkv.ui.plots import Plot

WIDTH = 720
#: characters Pillow's built-in font lacks, in the letters it has
_PLAIN = str.maketrans({"–": "-", "✗": "x", "…": "...", "⟦": "[", "⟧": "]"})


def _rgb(color: str) -> tuple[int, int, int]:
    c = color.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


def _blend(color: str, alpha: float) -> tuple[int, int, int]:
    """``color`` at ``alpha`` over the paper (a lighter shade)."""
    r, g, b = _rgb(color)
    return tuple(round(255 - (255 - v) * alpha) for v in (r, g, b))  # type: ignore[return-value]


class Canvas:
    """A white picture with text, boxes, hatches and lines; :meth:`png` encodes it."""

    def __init__(self, width: int, height: int) -> None:
        from PIL import Image, ImageDraw, ImageFont

        self.image = Image.new("RGB", (width, height), PAPER)
        self.draw = ImageDraw.Draw(self.image)
        self.fonts = {size: ImageFont.load_default(size=size) for size in (10, 11, 13)}

    def text(self, x: float, y: float, s: str, size: int = 11, color: str = TEXT,
             anchor: str = "ls") -> None:
        """Text with its baseline at ``y``; ``anchor`` as Pillow's (``rs``: right, ``ms``)."""
        self.draw.text((x, y), s.translate(_PLAIN), fill=color, font=self.fonts[size],
                       anchor=anchor)

    def box(self, x0: float, y0: float, x1: float, y1: float, color: Any,
            pattern: str = "", outline: str | None = None) -> None:
        """A filled box (at least a pixel wide), hatched with a bar ``pattern``."""
        x1 = max(x1, x0 + 1)
        self.draw.rectangle((x0, y0, x1, y1), fill=color, outline=outline)
        if pattern:
            hatch(self.draw, (x0, y0, x1, y1), pattern)

    def line(self, pts: Sequence[tuple[float, float]], color: str, width: int = 1,
             dash: bool = False) -> None:
        """A polyline (dashed: every other piece of each segment left out)."""
        if len(pts) < 2:
            return
        if not dash:
            self.draw.line(list(pts), fill=color, width=width)
            return
        for (xa, ya), (xb, yb) in zip(pts, pts[1:], strict=False):
            n = max(int(((xb - xa) ** 2 + (yb - ya) ** 2) ** 0.5 / 5), 1)
            for k in range(0, n, 2):
                t0, t1 = k / n, min((k + 1) / n, 1.0)
                self.draw.line([(xa + (xb - xa) * t0, ya + (yb - ya) * t0),
                                (xa + (xb - xa) * t1, ya + (yb - ya) * t1)],
                               fill=color, width=width)

    def png(self) -> bytes:
        """The picture as PNG bytes (a small palette: charts have few colours)."""
        out = io.BytesIO()
        self.image.quantize(64).save(out, "PNG", optimize=True)
        return out.getvalue()


def hatch(draw: Any, rect: tuple[float, float, float, float], pattern: str,
          step: int = 6) -> None:
    """White hatching inside ``rect``: plotly's bar pattern shapes (``/``, ``x``, ``+``, ...)."""
    x0, y0, x1, y1 = rect
    w, h = x1 - x0, y1 - y0
    lines: list[tuple[float, float, float, float]] = []
    if pattern in ("/", "x"):
        lines += [(x0 + d, y1, x0 + d + h, y0) for d in range(-int(h), int(w) + 1, step)]
    if pattern in ("\\", "x"):
        lines += [(x0 + d, y0, x0 + d + h, y1) for d in range(-int(h), int(w) + 1, step)]
    if pattern in ("-", "+"):
        lines += [(x0, y0 + d, x1, y0 + d) for d in range(step // 2, int(h), step)]
    if pattern in ("|", "+"):
        lines += [(x0 + d, y0, x0 + d, y1) for d in range(step // 2, int(w), step)]
    for xa, ya, xb, yb in lines:
        clipped = _clip(xa, ya, xb, yb, rect)
        if clipped is not None:
            draw.line(clipped, fill=PAPER, width=1)
    if pattern == ".":
        for x in range(int(x0) + step // 2, int(x1), step):
            for y in range(int(y0) + step // 2, int(y1), step):
                draw.ellipse((x - 1, y - 1, x + 1, y + 1), fill=PAPER)


def _clip(xa: float, ya: float, xb: float, yb: float,
          rect: tuple[float, float, float, float]) -> list[tuple[float, float]] | None:
    """The segment inside ``rect`` (Liang-Barsky), or None."""
    x0, y0, x1, y1 = rect
    dx, dy, t0, t1 = xb - xa, yb - ya, 0.0, 1.0
    for p, q in ((-dx, xa - x0), (dx, x1 - xa), (-dy, ya - y0), (dy, y1 - ya)):
        if p == 0:
            if q < 0:
                return None
            continue
        t = q / p
        if p < 0:
            t0 = max(t0, t)
        else:
            t1 = min(t1, t)
        if t0 > t1:
            return None
    return [(xa + dx * t0, ya + dy * t0), (xa + dx * t1, ya + dy * t1)]


def legend(c: Canvas, x: float, y: float, items: Sequence[tuple[str, str, str]]) -> float:
    """Swatches with their words (``(words, colour, pattern)``), wrapping; the y below."""
    x_start = x
    for words, color, pattern in items:
        w = 18 + c.draw.textlength(words, font=c.fonts[10]) + 12
        if x + w > c.image.width - 8:
            x, y = x_start, y + 16
        c.box(x, y - 9, x + 12, y + 1, color, pattern, NEUTRAL if color == PAPER else None)
        c.text(x + 16, y, words, 10)
        x += w
    return y + 16


# ------------------------------------------------------------------ KV map


def kvmap_png(m: MapModel, width: int = WIDTH) -> bytes:
    """:class:`MapModel` as a PNG: the rows, their spans, marks, axis and legend."""
    left, pad, top, row, gap = 110, 12, 30, 20, 4
    ys, y = row_ys(m.rows, float(top), row, gap)
    shown = [name for name, bars in m.bars.items() if bars]
    c = Canvas(width, int(y + 40 + 16 * (1 + len(shown) // 5)))
    pw = width - left - pad
    x = lambda pos: left + pw * min(pos, m.right) / max(m.right, 1)  # noqa: E731
    c.text(left, 18, m.title, 13, INK)
    for t in axis(m.right)[1]:
        c.line([(x(t), top), (x(t), y)], RULE)
        c.text(x(t), y + 12, f"{int(t)}", 10, MUTED, "ms")
    for label in m.rows:
        c.text(left - 6, ys[label] + row / 2 + 4, label, 11, TEXT, "rs")
        c.box(left, ys[label], left + pw, ys[label] + row, CAPACITY)
    for name, bars in m.bars.items():
        color = BARS[name][1]
        for b in bars:
            y0 = ys[b.row]
            if name == "trimmed":
                c.box(x(b.start), y0 + row * 0.6, x(b.end), y0 + row * 0.85, color)
            elif name == "held":
                c.box(x(b.start), y0, x(b.end), y0 + row * 0.2, color)
            else:
                c.box(x(b.start), y0, x(b.end), y0 + row, _blend(color, b.shade), "",
                      PAPER if x(b.end) - x(b.start) > 3 else None)
    for label, pos in m.checkpoints:
        if pos <= m.right:
            c.line([(x(pos), ys[label] - 2), (x(pos), ys[label] + row + 2)], INK, 2)
    for label, pos, _ in m.divergences:
        if pos <= m.right:
            c.draw.polygon([(x(pos) - 5, ys[label] - 3), (x(pos) + 5, ys[label] - 3),
                            (x(pos), ys[label] + 5)], fill=INK)
    for label, _ in m.unverified:
        c.text(left + 2, ys[label] + 15, "✗ not verified", 11, COLORS["trimmed"])
    legend(c, left, y + 32, [(BARS[n][0], BARS[n][1], "") for n in shown])
    return c.png()


# ------------------------------------------------------------------ timeline


def timeline_png(pts: Sequence[Point], width: int = WIDTH) -> bytes:
    """:func:`nbkv.ui.charts.timeline_points` as a PNG: three panels and a legend."""
    left, pad = 60, 12
    pw = width - left - pad
    panels = (("served from cache (%)", 90), ("first token (ms)", 100), ("prompt tokens", 80))
    c = Canvas(width, 380 + 16 * (1 + len({p.bar for p in pts}) // 4))
    if not pts:
        c.text(left, 20, "no request yet: the timeline starts with the first one", 11, MUTED)
        return c.png()
    n = len(pts)
    slot = pw / n
    cx = lambda i: left + slot * (i + 0.5)  # noqa: E731
    bw = max(slot * 0.7, 1)
    y0 = 8.0
    for k, (title, h) in enumerate(panels):
        top = y0 + 16
        c.text(left, y0 + 11, title, 11, INK)
        values = ([100.0] if k == 0 else [p.ttft_ms for p in pts] + [
            p.estimate_ms or 0.0 for p in pts] if k == 1 else [float(p.prompt) for p in pts])
        ymax, ticks = axis(max(values + [1.0]), 3)
        yv = lambda v, top=top, h=h, ymax=ymax: top + h - h * v / ymax  # noqa: E731
        for t in ticks:
            c.line([(left, yv(t)), (left + pw, yv(t))], RULE)
            c.text(left - 4, yv(t) + 3, f"{t:g}", 10, MUTED, "rs")
        for i, p in enumerate(pts):
            xa, xb = cx(i) - bw / 2, cx(i) + bw / 2
            if k == 0 and p.bar == "nothing-reused":
                c.draw.ellipse((cx(i) - 4, yv(0) - 9, cx(i) + 4, yv(0) - 1), outline=NEUTRAL)
            elif k == 0:
                term = bar_term(p.bar)
                c.box(xa, yv(p.salvage_pct), xb, yv(0), term.color, term.pattern)
            elif k == 2:
                c.box(xa, yv(p.reused), xb, yv(0), COLORS["reused"])
                if p.prompt > p.reused:
                    c.box(xa, yv(p.prompt), xb, yv(p.reused), COLORS["prefilled"])
        if k == 1:
            est = [(cx(i), yv(p.estimate_ms)) for i, p in enumerate(pts)
                   if p.estimate_ms is not None]
            c.line(est, ESTIMATE, 2, dash=True)
            c.line([(cx(i), yv(p.ttft_ms)) for i, p in enumerate(pts)], NEUTRAL, 2)
            for i, p in enumerate(pts):
                c.draw.ellipse((cx(i) - 3, yv(p.ttft_ms) - 3, cx(i) + 3, yv(p.ttft_ms) + 3),
                               fill=NEUTRAL)
        y0 = top + h + 8
    every = max(1, n // 12)
    for i, p in enumerate(pts):
        if i % every == 0:
            c.text(cx(i), y0 + 6, f"#{p.id}" + (f" {p.cell}" if p.cell else ""), 10, MUTED,
                   "ms")
    c.text(left + pw / 2, y0 + 20, "request # [cell]", 11, TEXT, "ms")
    seen = list(dict.fromkeys(p.bar for p in pts))
    items = [(bar_term(b).words, bar_term(b).color if b != "nothing-reused" else PAPER,
              bar_term(b).pattern) for b in seen]
    items += [("first token", NEUTRAL, ""), ("no-cache estimate", ESTIMATE, ""),
              (vocab.STATES["reused"].words, COLORS["reused"], ""),
              (vocab.STATES["prefilled"].words, COLORS["prefilled"], "")]
    legend(c, left, y0 + 38, items)
    return c.png()


# ------------------------------------------------------------------ lessons' plots


def plot_png(p: Plot) -> bytes:
    """A lesson's comparison (:class:`nbkv.ui.plots.Plot`) as a PNG with its legend."""
    left, right, top, bottom = 54, 12, 30, 56
    c = Canvas(p.width, p.height + 16)
    pw, ph = p.width - left - right, p.height - top - bottom
    n = max((len(v) for v in p.series.values()), default=0) or 1
    ymax, ticks = axis(p.y_max or max([y for v in p.series.values() for y in v] + [1.0]), 4)
    yv = lambda v: top + ph - ph * min(v, ymax) / ymax  # noqa: E731
    cx = lambda i: left + pw * (i + 0.5) / n  # noqa: E731
    c.text(left, 18, p.title, 13, INK)
    for t in ticks:
        c.line([(left, yv(t)), (left + pw, yv(t))], RULE)
        c.text(left - 4, yv(t) + 3, f"{t:g}", 10, MUTED, "rs")
    for i in range(n):
        c.text(cx(i), top + ph + 14, str(i + 1), 10, MUTED, "ms")
    c.text(left + pw / 2, top + ph + 30, p.x_title, 11, TEXT, "ms")
    slot = pw / n
    bw = slot * 0.8 / max(len(p.series), 1)
    for j, (name, values) in enumerate(p.series.items()):
        color = p.color(j, name)
        if p.kind == "lines":
            pts = [(cx(i), yv(y)) for i, y in enumerate(values)]
            c.line(pts, color, 2)
            for x, y in pts:
                c.draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=color)
        else:
            for i, y in enumerate(values):
                x0 = left + slot * i + slot * 0.1 + bw * j
                c.box(x0, yv(y), x0 + bw, yv(0), color)
    legend(c, left, top + ph + 50, [(name, p.color(j, name), "")
                                    for j, name in enumerate(p.series)])
    return c.png()
