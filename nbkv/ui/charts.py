"""The charts' models, the KV map and the timeline, and their drawing as inline SVG.

Each chart is first computed as data (:class:`MapModel`, :class:`Point`) that the tests
read; that one model feeds every drawing: the plotly figure a notebook shows
(:mod:`nbkv.ui.chartfig`, hover and zoom), its PNG (:mod:`nbkv.ui.raster`), and the inline
SVG drawn here, for the report page (:mod:`nbkv.ui.page`), the static pages
(:mod:`nbkv.ui.static`) and a view placed inside another layout. Hover a bar for its
message, role, token range and text. Colours from :mod:`nbkv.ui.palette`, words from
:mod:`nbkv.ui.vocabulary`; nothing here imports Jupyter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nbkv.core.events import GENERATED, KEPT, PREFILLED, REUSED, RequestRecord, Segment
from nbkv.ui import vocabulary as vocab
from nbkv.ui.display import esc, tip
from nbkv.ui.figures import ttft_text
from nbkv.ui.map_rows import held_caption, held_text, map_rows, map_title, row_labels
from nbkv.ui.palette import (
    CAPACITY,
    COLORS,
    ESTIMATE,
    INK,
    MEDIA_COLOR,
    MUTED,
    NEUTRAL,
    PAPER,
    ROLE_COLORS,
    RULE,
    TEXT,
    TODO_COLOR,
)

TODO = "todo"  # prompt positions of a request in flight not read yet
STATE_COLORS = {REUSED: COLORS["reused"], PREFILLED: COLORS["prefilled"], TODO: TODO_COLOR,
                GENERATED: COLORS["generated"], "trimmed": COLORS["trimmed"]}
_FONT = "font-family:sans-serif"


# ------------------------------------------------------------------ what each piece shows


def messages(segs: Sequence[Segment]) -> list[Segment]:
    """Merge the state pieces of each message (and of each image) into one span."""
    out: list[Segment] = []
    for seg in segs:
        prev = out[-1] if out else None
        if (prev is not None and prev.message == seg.message and prev.end == seg.start
                and prev.is_media == seg.is_media and prev.image_hash == seg.image_hash):
            out[-1] = replace(prev, end=seg.end, preview=prev.preview or seg.preview)
        else:
            out.append(seg)
    return out


def states(segs: Sequence[Segment], run: Any) -> list[tuple[str, Segment]]:
    """The latest request's pieces; for one in flight (``run``), split what is read so far."""
    segs = [seg for seg in segs if seg.state != KEPT]  # later turns: not this request's
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


def segment_text(seg: Segment) -> str:
    """What a span holds, for its hover: the message's start, or the image."""
    text = seg.preview or ""
    if seg.is_media:
        text = f"image {seg.image_name or (seg.image_hash or '')[:12]}"
        if seg.embeddings and seg.embeddings != seg.length:  # M-RoPE: fewer positions
            text += f": {seg.embeddings} image tokens on {seg.length} positions"
    return text


def role_key(seg: Segment) -> str:
    """The message row's colour key: the role, ``image``, or ``other``."""
    if seg.is_media:
        return "image"
    return seg.role if seg.role in ROLE_COLORS else "other"


def trimmed_text(rec: RequestRecord) -> str:
    """The hover of a request's trimmed band: whose slot it took, or what was cut."""
    return vocab.took(rec) or f"{rec.trimmed_tokens} tokens {vocab.STATES['trimmed'].words}"


def latest(slot: Any, running: Any, last: RequestRecord | None) -> RequestRecord | None:
    """The record of the slot's request in flight, else of its latest one."""
    rec = running.record if running is not None else last
    return rec if rec is not None and rec.slot == slot.index else None


# ------------------------------------------------------------------ SVG helpers

_PATTERN_PATHS = {
    "/": "M-1,1 l2,-2 M0,6 l6,-6 M5,7 l2,-2",
    "\\": "M-1,5 l2,2 M0,0 l6,6 M5,-1 l2,2",
    "x": "M0,0 l6,6 M0,6 l6,-6",
    "-": "M0,3 h6",
    "|": "M3,0 v6",
    "+": "M0,3 h6 M3,0 v6",
}


def _pattern_id(shape: str) -> str:
    return "nbkv-p" + str(sorted(_PATTERN_PATHS).index(shape) if shape in _PATTERN_PATHS
                          else 9)


def pattern_defs(shapes: Iterable[str], uid: str) -> str:
    """SVG ``<pattern>`` definitions for plotly's bar pattern shapes (white over the fill)."""
    out = []
    for shape in sorted(set(shapes) - {""}):
        pid = f"{_pattern_id(shape)}-{uid}"
        if shape == ".":
            body = f'<circle cx="3" cy="3" r="1.2" fill="{PAPER}"/>'
        else:
            body = (f'<path d="{_PATTERN_PATHS.get(shape, "")}" stroke="{PAPER}" '
                    'stroke-width="1.2"/>')
        out.append(f'<pattern id="{pid}" width="6" height="6" patternUnits="userSpaceOnUse">'
                   f"{body}</pattern>")
    return f"<defs>{''.join(out)}</defs>" if out else ""


def svg_rect(x: float, y: float, w: float, h: float, fill: str, title: str = "",
             extra: str = "") -> str:
    """An SVG rectangle (at least 0.6 wide), with ``title`` as its tooltip."""
    t = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.6):.1f}" height="{h:.1f}" '
            f'fill="{fill}"{extra}>{t}</rect>')


def svg_text(x: float, y: float, s: str, anchor: str = "start", size: int = 11,
             color: str = TEXT) -> str:
    """SVG text at ``(x, y)``."""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
            f'fill="{color}">{esc(s)}</text>')


def nice_step(span: float, ticks: int = 5) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about ``ticks`` ticks."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1.0
    for m in (1, 2, 5, 10):
        if m * power >= raw:
            return m * power
    return 10 * power


def axis(top: float, ticks: int = 5) -> tuple[float, list[float]]:
    """An axis from 0: its end (at least one step) and its round ticks (:func:`nice_step`)."""
    step = nice_step(top, ticks)
    top = max(top, step)
    return top, steps(0, top, step)


def row_ys(rows: Sequence[str], top: float, row: int, gap: int) -> tuple[dict[str, float], float]:
    """The KV map's rows from ``top`` down, a wider gap after each slot's pair: (ys, the end)."""
    ys: dict[str, float] = {}
    y = top
    for i, label in enumerate(rows):
        ys[label] = y
        y += row + gap + (gap * 2 if i % 2 else 0)
    return ys, y


def svg_root(width: int, height: int, body: str, cls: str, label: str) -> str:
    """An ``<svg>`` element of ``width`` x ``height`` around ``body``."""
    return (f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{esc(label)}" style="{_FONT};background:{PAPER};max-width:100%">'
            f"{body}</svg>")


# ------------------------------------------------------------------ KV map

#: the map's bars: code -> (words shown in hovers and legends, colour); message rows by role
#: (and image), request rows by what the latest request did
BARS = {**{role: (vocab.ROLES[role].words if role in vocab.ROLES else role, color)
           for role, color in ROLE_COLORS.items()},
        "image": (vocab.ROLES["image"].words, MEDIA_COLOR),
        **{state: (vocab.STATES[state].words, STATE_COLORS[state])
           for state in (REUSED, PREFILLED, TODO, GENERATED)},
        "trimmed": (vocab.STATES["trimmed"].words, STATE_COLORS["trimmed"]),
        "held": (vocab.MARKS["server-held"].words, vocab.MARKS["server-held"].color)}


@dataclass(frozen=True)
class Bar:
    """One span of the map: its row, positions ``[start, end)`` and what it holds."""

    row: str  # "slot 0" (its messages) or "slot 0 · request" (what the latest request did)
    start: int
    end: int
    message: int | str  # the message index ("-" for a trimmed band)
    role: str
    text: str  # the message's start, the image, or what was trimmed
    shade: float = 1.0  # drawn lighter (a request row's span read new: pale on every surface)


@dataclass
class MapModel:
    """The KV map as data: every slot's bars, checkpoints, divergence marks, unverified slots."""

    rows: list[str]
    n_ctx: int
    right: int  # the last position shown (the map fits the positions in use)
    bars: dict[str, list[Bar]] = field(default_factory=lambda: {k: [] for k in BARS})
    checkpoints: list[tuple[str, int]] = field(default_factory=list)
    #: (row, position, what the request did): where its prompt left the cached conversation
    divergences: list[tuple[str, int, str]] = field(default_factory=list)
    unverified: list[tuple[str, str]] = field(default_factory=list)  # remote slots: (row, why)
    #: rows are a server's sessions (vLLM keeps its own cache), in blocks of ``block_size``
    server: bool = False
    block_size: int | None = None

    @property
    def title(self) -> str:
        """The map's title: per slot, or per session in the server's blocks."""
        return map_title(self.n_ctx, self.right, self.server, self.block_size)

    @property
    def segments(self) -> int:
        """Bars drawn."""
        return sum(len(b) for b in self.bars.values())


def _bar(row: str, seg: Segment, shade: float = 1.0) -> Bar:
    return Bar(row, seg.start, seg.end, seg.message, seg.role, segment_text(seg), shade)


def kvmap_model(slots: Sequence[Any], n_ctx: int, last_by_slot: Mapping[int, RequestRecord],
                running: Mapping[int, Any] | None = None, fit: bool = True,
                server: bool = False, block_size: int | None = None) -> MapModel:
    """What the map shows: per slot, its messages and what its latest request did to them.

    ``running`` maps a slot to the request in flight there (drawn as it progresses). With
    ``fit`` the map spans the positions in use (at least an eighth of the capacity).
    ``server``: the rows are sessions on a server that keeps its own cache
    (:func:`nbkv.ui.map_rows.map_rows`): their latest request, cut at the server's
    ``block_size``, and a thin band over what the server holds of each now.
    """
    running = {} if server else (running or {})
    m = MapModel([], n_ctx, n_ctx, server=server, block_size=block_size)
    used = 0
    for s in slots:
        top, bottom = row_labels(s, server)
        m.rows += [top, bottom]
        if not getattr(s, "verified", True):
            m.unverified.append((top, getattr(s, "note", "")))
        m.checkpoints += [(top, pos) for pos in s.checkpoints]
        run = running.get(s.index)
        segs = run.record.segments if run is not None else s.segments
        for seg in messages(segs):
            # solid: pale means "read new" on every surface; a white edge parts neighbours
            m.bars[role_key(seg)].append(_bar(top, seg))
        for name, seg in states(segs, run):
            m.bars[name].append(_bar(bottom, seg))
        if getattr(s, "server_cached", None):
            m.bars["held"].append(Bar(top, 0, s.server_cached, "-",
                                      vocab.MARKS["server-held"].words,
                                      held_text(s, block_size)))
        rec = None if server else latest(s, run, last_by_slot.get(s.index))
        if rec is not None and rec.divergence is not None:
            m.divergences.append((bottom, rec.divergence.position,
                                  f"request {rec.id}: {vocab.reason_line(rec)}"))
        if rec is not None and rec.trimmed_tokens:
            a, b = rec.reused_tokens, rec.reused_tokens + rec.trimmed_tokens
            m.bars["trimmed"].append(Bar(bottom, a, b, "-", vocab.STATES["trimmed"].words,
                                         trimmed_text(rec)))
        used = max(used, s.n_tokens)
    used = max([used] + [b.end for rows in m.bars.values() for b in rows])
    m.n_ctx = n_ctx = max(n_ctx, used)  # a server that did not say its length
    m.right = max(min(n_ctx, max(int(used * 1.15) + 1, n_ctx // 8)) if fit else n_ctx, 1)
    return m


def engine_map(engine: Any, last_by_slot: Mapping[int, RequestRecord],
               running: Mapping[int, Any] | None = None, fit: bool = True) -> MapModel:
    """:func:`kvmap_model` of an engine: its slots, or a server's sessions (:func:`map_rows`)."""
    rows, server = map_rows(engine)
    return kvmap_model(rows, engine.n_ctx, last_by_slot, running, fit, server,
                       getattr(engine, "block_size", None))


def draw_kvmap(m: MapModel, width: int = 720) -> str:
    """:class:`MapModel` as inline SVG (hover a span for its message and text)."""
    left, right_pad, top, row, gap = 110, 12, 30, 20, 4
    right = m.right
    pw = width - left - right_pad
    x = lambda pos: left + pw * min(pos, right) / right  # noqa: E731
    ys, y = row_ys(m.rows, top, row, gap)
    out: list[str] = []
    for label in m.rows:
        out.append(svg_text(left - 6, ys[label] + row / 2 + 4, label, "end"))
        out.append(svg_rect(left, ys[label], pw, row, CAPACITY))
    for name, bars in m.bars.items():
        words, color = BARS[name]
        for b in bars:
            if name == "trimmed":  # a thin band under the request row
                out.append(svg_rect(x(b.start), ys[b.row] + row * 0.6, x(b.end) - x(b.start),
                                 row * 0.25, color, b.text, ' class="nbkv-trimmed"'))
                continue
            if name == "held":  # a thin band over a server session's row
                out.append(svg_rect(x(b.start), ys[b.row], x(b.end) - x(b.start), row * 0.2,
                                    color, b.text, ' class="nbkv-server-held"'))
                continue
            shade = f' fill-opacity="{b.shade}"' if b.shade != 1.0 else ""
            title = (f"{words} · message {b.message} · {b.role} · tokens {b.start}–{b.end}: "
                     f"{b.text}")
            out.append(svg_rect(x(b.start), ys[b.row], x(b.end) - x(b.start), row, color, title,
                             shade + f' stroke="{PAPER}" data-bar="{esc(name)}"'))
    for label, pos in m.checkpoints:
        if pos <= right:
            out.append(f'<line x1="{x(pos):.1f}" x2="{x(pos):.1f}" y1="{ys[label] - 2}" '
                       f'y2="{ys[label] + row + 2}" stroke="{INK}" stroke-width="2">'
                       f"<title>{vocab.MARKS['checkpoint-mark'].words} at {pos}</title></line>")
    for label, pos, what in m.divergences:
        if pos <= right:
            out.append(f'<path class="nbkv-diverged" d="M{x(pos) - 5:.1f},{ys[label] - 3} h10 '
                       f'l-5,8 z" fill="{INK}"><title>{esc(vocab.MARKS["divergence"].words)}: '
                       f"{esc(what)}</title></path>")
    for label, note in m.unverified:
        out.append(f'<text class="nbkv-unverified-mark" x="{left + 2}" y="{ys[label] + 15}" '
                   f'font-size="14" fill="{COLORS["trimmed"]}">✗<title>not verified: '
                   f"{esc(note)}</title></text>")
    ticks = "".join(
        f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{y}" stroke="{RULE}"/>'
        + svg_text(x(t), y + 12, f"{int(t)}", "middle", 10, MUTED) for t in axis(right)[1])
    title = m.title
    body = svg_text(left, 18, title, size=13, color=INK) + ticks + "".join(out)
    if m.bars["held"]:
        y += 16
        body += svg_text(left, y + 12, held_caption(), size=10, color=MUTED)
    return svg_root(width, int(y + 20), body, "nbkv-kvmap-svg", title)


def steps(lo: float, hi: float, step: float) -> list[float]:
    """The ticks ``lo, lo + step, ...`` up to ``hi``."""
    out, t = [], lo
    while t <= hi + 1e-9:
        out.append(t)
        t += step
    return out


# ------------------------------------------------------------------ timeline


def prefill_rate(records: Sequence[RequestRecord]) -> float:
    """Observed prefill speed (tokens/s) over requests that prefilled enough to measure."""
    done = [r for r in records if r.prefilled_tokens >= 16 and r.prefill_s > 0]
    secs = sum(r.prefill_s for r in done)
    return sum(r.prefilled_tokens for r in done) / secs if secs > 0 else 0.0


def no_cache_ttft(record: RequestRecord, rate: float) -> float | None:
    """Estimated first-token time (s) had nothing been cached; None without a measured rate."""
    return record.ttft_s + record.reused_tokens / rate if rate > 0 else None


def request_text(r: RequestRecord) -> str:
    """A request in plain words: who, the event and why, what it reused, its first token."""
    lines = [f"request {r.id} · {r.session or 'no session'}", vocab.reason_line(r)]
    if vocab.took(r):
        lines.append(vocab.took(r))
    if vocab.restored(r):
        lines.append(vocab.restored(r))
    lines += [f"reused {r.reused_tokens} of {r.prompt_tokens} tokens, read "
              f"{r.prefilled_tokens} new", f"first token after {r.ttft_s * 1000:.0f} ms"]
    return "\n".join(lines)


@dataclass(frozen=True)
class Point:
    """One request on the timeline: its salvage bar, first-token time and prompt tokens."""

    id: int
    bar: str  # its salvage bar's event code (vocabulary.bar); "nothing-reused" if it reused none
    salvage_pct: float
    ttft_ms: float
    estimate_ms: float | None  # had nothing been cached (None: no prefill speed measured yet)
    reused: int
    read: int
    prompt: int
    text: str  # the request in words (its hover)
    ttft_text: str  # its first-token time in parts
    cell: str = ""  # the notebook cell that sent it (``[3]``), when known


def timeline_points(history: Sequence[RequestRecord], max_requests: int = 50,
                    cell_of: Callable[[RequestRecord], Any] | None = None) -> list[Point]:
    """The latest ``max_requests`` requests as the timeline draws them.

    ``cell_of(record)``: the notebook cell that sent it (a ``label`` such as ``[3]``, or
    None), so that request numbers and cell numbers name each other.
    """
    rate = prefill_rate(history)
    out = []
    for r in list(history)[-max_requests:]:
        est = no_cache_ttft(r, rate)
        ref = cell_of(r) if cell_of is not None else None
        cell = str(getattr(ref, "label", "")) if ref is not None else ""
        text = request_text(r)
        if cell:
            head, _, rest = text.partition("\n")
            text = f"{head} · cell {cell}\n{rest}"
        out.append(Point(r.id, vocab.bar(r).code if r.reused_tokens else "nothing-reused",
                         r.salvage_pct, r.ttft_s * 1000, None if est is None else est * 1000,
                         r.reused_tokens, r.prefilled_tokens, r.prompt_tokens,
                         text, ttft_text(r), cell))
    return out


def bar_term(code: str) -> vocab.Term:
    """The words, colour and pattern of a timeline bar (an event, or a mark)."""
    return vocab.MARKS[code] if code in vocab.MARKS else vocab.EVENTS[code]


def timeline_svg(history: Sequence[RequestRecord], max_requests: int = 50,
                 width: int = 720) -> str:
    """Per request: share served from cache (by event), first-token time, prompt tokens."""
    return draw_timeline(timeline_points(history, max_requests), width)


def draw_timeline(pts: Sequence[Point], width: int = 720) -> str:
    """:func:`timeline_points` as inline SVG, with its legend."""
    if not pts:
        return (f'<div class="nbkv-timeline-svg" style="color:{MUTED};margin:6px 0">no '
                "request yet: the timeline starts with the first one</div>")
    pw = width - 60 - 12  # the axis labels' margin on the left, 12 px on the right
    n = len(pts)
    cols = _Columns(60, pw, pw / n, pw / n * 0.7, f"{n}{pts[-1].id}")
    body: list[str] = []
    ttft = max([p.ttft_ms for p in pts] + [p.estimate_ms or 0.0 for p in pts] + [1.0])
    base, yv = _panel(body, cols, 10, "prompt served from cache (%)", 90, 100.0)
    events_seen = _salvage_bars(body, pts, cols, base, yv)
    base, yv = _panel(body, cols, base + 8, "time to first token (ms)", 110, ttft)
    _ttft_lines(body, pts, cols, yv)
    base, yv = _panel(body, cols, base + 8, "prompt tokens", 80, max([p.prompt for p in pts] + [1]))
    _prompt_bars(body, pts, cols, base, yv)
    y0 = base + 8
    every = max(1, n // 20)
    for i, p in enumerate(pts):
        if i % every == 0:
            body.append(svg_text(cols.cx(i), y0 + 4, str(p.id), "middle", 10, MUTED))
    body.append(svg_text(cols.left + pw / 2, y0 + 18, "request #", "middle", 11, TEXT))
    defs = pattern_defs((t.pattern for t in events_seen.values()), cols.uid)
    estimate = any(p.estimate_ms is not None for p in pts)
    return svg_root(width, int(y0 + 26), defs + "".join(body), "nbkv-timeline-svg",
                    "salvage and first-token time per request") + timeline_legend(
        events_seen.values(), cols.uid, estimate)


@dataclass(frozen=True)
class _Columns:
    """The timeline's horizontal layout: one column per request."""

    left: int  # where the plot starts (the axis labels are to its left)
    pw: float  # the plot's width
    slot_w: float  # one request's column
    bw: float  # a bar's width
    uid: str  # makes pattern ids unique to this chart

    def bar_x(self, i: int) -> float:
        """The left edge of request ``i``'s bar."""
        return self.left + self.slot_w * i + (self.slot_w - self.bw) / 2

    def cx(self, i: int) -> float:
        """The middle of request ``i``'s column."""
        return self.left + self.slot_w * (i + 0.5)


def _panel(body: list[str], cols: _Columns, y0: float, title: str, h: int, ymax: float
           ) -> tuple[float, Callable[[float], float]]:
    """A panel's title and grid lines from ``y0`` down: (its bottom, value -> y)."""
    top = y0 + 18
    left, pw = cols.left, cols.pw
    body.append(svg_text(left + pw / 2, y0 + 12, title, "middle", 12, INK))
    ymax, ticks = axis(ymax, 3)

    def yv(v: float) -> float:
        return top + h - h * v / ymax

    for t in ticks:
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{yv(t):.1f}" '
                    f'y2="{yv(t):.1f}" stroke="{RULE}"/>')
        body.append(svg_text(left - 4, yv(t) + 3, f"{t:g}", "end", 10, MUTED))
    return top + h, yv


def _salvage_bars(body: list[str], pts: Sequence[Point], cols: _Columns, base: float,
                  yv: Callable[[float], float]) -> dict[str, vocab.Term]:
    """Each request's share served from cache, by its event (a ring: none): the events drawn."""
    events_seen: dict[str, vocab.Term] = {}
    for i, p in enumerate(pts):
        term = bar_term(p.bar)
        events_seen[term.code] = term
        if p.bar == "nothing-reused":
            body.append(f'<circle cx="{cols.cx(i):.1f}" cy="{yv(0) - 5:.1f}" r="4" fill="none" '
                        f'stroke="{NEUTRAL}" stroke-width="1.5" data-bar="nothing-reused">'
                        f"<title>{esc(p.text)}</title></circle>")
            continue
        y = yv(p.salvage_pct)
        body.append(svg_rect(cols.bar_x(i), y, cols.bw, base - y, term.color, p.text,
                             f' data-bar="{esc(p.bar)}"'))
        if term.pattern:
            fill = f"url(#{_pattern_id(term.pattern)}-{cols.uid})"
            body.append(svg_rect(cols.bar_x(i), y, cols.bw, base - y, fill))
    return events_seen


def _ttft_lines(body: list[str], pts: Sequence[Point], cols: _Columns,
                yv: Callable[[float], float]) -> None:
    """The first-token times as a line with points, and the no-cache estimate dashed."""
    cx = cols.cx
    pts_line = " ".join(f"{cx(i):.1f},{yv(p.ttft_ms):.1f}" for i, p in enumerate(pts))
    est_pts = " ".join(f"{cx(i):.1f},{yv(p.estimate_ms):.1f}" for i, p in enumerate(pts)
                       if p.estimate_ms is not None)
    if est_pts:
        body.append(f'<polyline points="{est_pts}" fill="none" stroke="{ESTIMATE}" '
                    'stroke-dasharray="5,3" stroke-width="1.5"/>')
    body.append(f'<polyline points="{pts_line}" fill="none" stroke="{NEUTRAL}" '
                'stroke-width="1.5"/>')
    for i, p in enumerate(pts):
        body.append(f'<circle cx="{cx(i):.1f}" cy="{yv(p.ttft_ms):.1f}" r="3" '
                    f'fill="{NEUTRAL}"><title>{esc(p.text)}\n{esc(p.ttft_text)}'
                    "</title></circle>")


def _prompt_bars(body: list[str], pts: Sequence[Point], cols: _Columns, base: float,
                 yv: Callable[[float], float]) -> None:
    """Each prompt's tokens: reused below, read on top."""
    for i, p in enumerate(pts):
        body.append(svg_rect(cols.bar_x(i), yv(p.reused), cols.bw, base - yv(p.reused),
                             COLORS["reused"], f"request {p.id}: {p.reused} tokens reused"))
        body.append(svg_rect(cols.bar_x(i), yv(p.prompt), cols.bw, yv(p.reused) - yv(p.prompt),
                             COLORS["prefilled"], f"request {p.id}: {p.read} tokens read"))


def timeline_legend(terms: Iterable[vocab.Term], uid: str, estimate: bool) -> str:
    """The events drawn (each bar's pattern), the first-token line and its estimate."""
    items = []
    for t in terms:
        if t.code == "nothing-reused":
            icon = (f'<svg width="12" height="12"><circle cx="6" cy="6" r="4" fill="none" '
                    f'stroke="{NEUTRAL}" stroke-width="1.5"/></svg>')
        else:
            pat = pattern_defs([t.pattern], uid + t.code)
            fill = (f'<rect width="12" height="12" fill="url(#{_pattern_id(t.pattern)}-'
                    f'{uid}{t.code})"/>' if t.pattern else "")
            icon = (f'<svg width="12" height="12">{pat}<rect width="12" height="12" '
                    f'fill="{t.color}"/>{fill}</svg>')
        items.append(tip(t.tip, f"{icon} {esc(t.words)}"))
    items.append(f'<span><svg width="18" height="8"><line x1="0" x2="18" y1="4" y2="4" '
                 f'stroke="{NEUTRAL}" stroke-width="2"/></svg> first token</span>')
    if estimate:
        items.append(f'<span><svg width="18" height="8"><line x1="0" x2="18" y1="4" y2="4" '
                     f'stroke="{ESTIMATE}" stroke-width="2" stroke-dasharray="4,2"/></svg> '
                     "no-cache estimate</span>")
    return (f'<div class="nbkv-timeline-legend" style="font:11px sans-serif;color:{TEXT};'
            f'display:flex;flex-wrap:wrap;gap:4px 12px;margin:2px 0 0 60px">'
            + "".join(items) + "</div>")


