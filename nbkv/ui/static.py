"""The dashboard as static HTML with inline SVG: what a saved notebook shows with no kernel.

Every nbkv widget puts one of these beside its live view in the same display data
(``_repr_mimebundle_``), so GitHub, nbviewer, an nbconvert export and Binder before the
kernel starts show the slot cards, the KV map and the timeline as they were when the cell
ended; :mod:`nbkv.report` puts them on one self-contained page. No JavaScript, no fonts or
scripts from elsewhere; colours from :mod:`nbkv.ui.palette`, words from :mod:`nbkv.ui.vocabulary`.
Nothing here imports Jupyter.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from nbkv.core.events import GENERATED, PREFILLED, REUSED, RequestRecord, Segment
from nbkv.core.protocol import Parks
from nbkv.ui import vocabulary as vocab
from nbkv.ui.display import engine_label, legend_html, size_text, slots_label
from nbkv.ui.figures import ttft_text
from nbkv.ui.palette import (
    CAPACITY,
    CARD_BORDER,
    COLORS,
    ESTIMATE,
    FREE,
    INK,
    MEDIA_COLOR,
    MUTED,
    NEUTRAL,
    PAPER,
    PARKED_COLOR,
    ROLE_COLORS,
    RULE,
    TEXT,
    TODO_COLOR,
    TRACK,
)

TODO = "todo"  # prompt positions of a request in flight not read yet
STATE_COLORS = {REUSED: COLORS["reused"], PREFILLED: COLORS["prefilled"], TODO: TODO_COLOR,
                GENERATED: COLORS["generated"], "trimmed": COLORS["trimmed"]}
_FONT = "font-family:sans-serif"
CARD = (f"border:1px solid {CARD_BORDER};border-radius:6px;padding:6px 10px;width:210px;"
        "font:12px sans-serif;line-height:1.5")


def esc(text: Any) -> str:
    """HTML-escaped text, quotes included (safe in attributes)."""
    return html.escape(str(text), quote=True)


def tip(text: str, body: str, cls: str = "") -> str:
    """``body`` with ``text`` as its tooltip."""
    c = f' class="{cls}"' if cls else ""
    return f'<span{c} title="{esc(text)}" style="cursor:help">{body}</span>'


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


def role_color(key: str) -> str:
    """The colour of a message row's span."""
    return MEDIA_COLOR if key == "image" else ROLE_COLORS.get(key, ROLE_COLORS["other"])


def state_words(state: str) -> str:
    """A KV state's words (``read new`` for prefilled)."""
    return vocab.STATES[state].words if state in vocab.STATES else state


def trimmed_text(rec: RequestRecord) -> str:
    """The hover of a request's trimmed band: whose slot it took, or what was cut."""
    return vocab.took(rec) or f"{rec.trimmed_tokens} tokens {vocab.STATES['trimmed'].words}"


def latest(slot: Any, running: Any, last: RequestRecord | None) -> RequestRecord | None:
    """The record of the slot's request in flight, else of its latest one."""
    rec = running.record if running is not None else last
    return rec if rec is not None and rec.slot == slot.index else None


# ------------------------------------------------------------------ slot cards


def card(s: Any, rank: int | None, n_used: int, run: Any = None,
         last: RequestRecord | None = None) -> str:
    """One slot as a card: session, messages, tokens / capacity, LRU, images, memory, status."""
    pct = 100 * s.n_tokens / s.capacity if s.capacity else 0
    badge = ""
    if run is not None:
        r = run.record
        if run.phase == "generate":
            busy = f"generating: {run.generated} tokens"
        else:
            busy = f"read {run.prefilled}/{r.prefilled_tokens} new ({vocab.event(r).words})"
        badge = (f'<span style="background:{COLORS["prefilled"]};color:{PAPER};'
                 f'border-radius:3px;padding:0 4px">busy</span> {esc(busy)}')
    elif s.pending:
        badge = (f'<span style="background:{COLORS["prefilled"]};color:{PAPER};'
                 'border-radius:3px;padding:0 4px">pending</span>')
    lru = (tip(vocab.lru_tip(rank, n_used), f"LRU {rank} of {n_used}", "nbkv-lru") if rank
           else "empty")
    session = esc(s.session) if s.session else f'<span style="color:{FREE}">free</span>'
    event = ""
    if run is None and last is not None and last.slot == s.index:
        event = "<br>" + tip(vocab.reason_line(last), f"latest: {esc(vocab.event(last).words)}",
                             "nbkv-event")
        if vocab.took(last):
            event += "<br>" + tip(vocab.MARKS["took-slot"].tip, esc(vocab.took(last)),
                                  "nbkv-took")
    return (
        f'<div class="nbkv-card" data-slot="{s.index}" style="{CARD}">'
        f"<b>slot {s.index}</b> · {session}<br>"
        f"{s.n_messages} messages · {s.n_tokens}/{s.capacity} tokens<br>"
        f'<div style="background:{TRACK};height:6px;border-radius:3px">'
        f'<div style="background:{ROLE_COLORS["user"]};height:6px;border-radius:3px;'
        f'width:{pct:.1f}%"></div></div>'
        f"{lru} · images: {s.n_media}<br>"
        f'{memory_html(s)}{event}<br>{badge}{unverified_html(s)}</div>'
    )


def unverified_html(s: Any) -> str:
    """A remote slot whose server content differs from what nbkv expects."""
    if s.verified:
        return ""
    return (f'<div class="nbkv-unverified" title="{esc(s.note)}" '
            f'style="color:{COLORS["trimmed"]}">✗ not verified</div>')


def memory_text(s: Any) -> str:
    """The slot's memory class, and its checkpoints on hybrid and recurrent models."""
    if s.memory not in ("hybrid", "recurrent") and not s.checkpoints:
        return s.memory
    n = len(s.checkpoints)
    return (f"{s.memory} · {n} checkpoint{'s' if n != 1 else ''} "
            f"({size_text(s.checkpoint_bytes)})")


def memory_html(s: Any) -> str:
    """:func:`memory_text` with the memory class explained in a tooltip."""
    term = vocab.MEMORY.get(s.memory)
    text = f"{s.memory} memory: {term.tip}" if term else s.memory
    return (f'<span class="nbkv-memory" title="{esc(text)}" style="cursor:help">'
            f"{esc(memory_text(s))}</span>")


def lru_ranks(slots: Sequence[Any]) -> tuple[dict[int, int], int]:
    """Each used slot's LRU rank (1 = most recently used) and the number of used slots."""
    order = sorted((s for s in slots if not s.empty), key=lambda s: -s.last_used)
    return {s.index: i + 1 for i, s in enumerate(order)}, len(order)


def cards_html(slots: Sequence[Any], last_by_slot: Mapping[int, RequestRecord],
               running: Mapping[int, Any] | None = None, parked: Sequence[Any] = ()) -> str:
    """Every slot's card, in a wrapping row, then the shelf of ``parked`` conversations."""
    rank, n = lru_ranks(slots)
    running = running or {}
    cards = "".join(
        f'<div class="nbkv-slot-card" style="margin:0 6px 6px 0">'
        f"{card(s, rank.get(s.index), n, running.get(s.index), last_by_slot.get(s.index))}"
        f"</div>" for s in slots)
    return (f'<div class="nbkv-slot-cards" style="display:flex;flex-flow:row wrap">{cards}'
            f"</div>{shelf_html(parked)}")


def parked_of(engine: Any) -> tuple[Any, ...]:
    """The engine's parked conversations (``engine.parked()``); none if it parks nothing."""
    return tuple(engine.parked()) if isinstance(engine, Parks) else ()


def shelf_html(parked: Sequence[Any]) -> str:
    """The "parked" shelf under the slot cards: session, tokens, bytes, RAM or disk each.

    ``parked``: :class:`nbkv.store.parked.ParkedInfo` items, most recently used first. Empty: no
    shelf.
    """
    if not parked:
        return ""
    term = vocab.PARKING["parked"]
    rows = "".join(
        f'<div class="nbkv-parked" data-session="{esc(p.session or "")}">'
        f"{esc(p.session or '-')} · {len(p.tokens):,} tokens · {size_text(p.nbytes)} · "
        f"{tip(vocab.PARKING[p.tier].tip, esc(vocab.tier_words(p.tier)), 'nbkv-tier')}</div>"
        for p in parked)
    total = size_text(sum(p.nbytes for p in parked))
    head = tip(term.tip, f'<b style="color:{PARKED_COLOR}">{esc(term.words)}</b>')
    return (f'<div class="nbkv-shelf" style="{CARD};width:auto;max-width:440px;'
            f'border-left:4px solid {PARKED_COLOR};margin:0 6px 6px 0">'
            f"{head} · {len(parked)} conversation{'s' if len(parked) != 1 else ''} · {total}"
            f"{rows}</div>")


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


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "",
          extra: str = "") -> str:
    t = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.6):.1f}" height="{h:.1f}" '
            f'fill="{fill}"{extra}>{t}</rect>')


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 11,
          color: str = TEXT) -> str:
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


def _svg(width: int, height: int, body: str, cls: str, label: str) -> str:
    return (f'<svg class="{cls}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{esc(label)}" style="{_FONT};background:{PAPER};max-width:100%">'
            f"{body}</svg>")


# ------------------------------------------------------------------ KV map


def kvmap_svg(slots: Sequence[Any], n_ctx: int, last_by_slot: Mapping[int, RequestRecord],
              running: Mapping[int, Any] | None = None, fit: bool = True,
              width: int = 720) -> str:
    """Every slot's KV positions: who wrote each span, and what the latest request did."""
    running = running or {}
    left, right_pad, top, row, gap = 110, 12, 30, 20, 4
    rows: list[str] = []
    used = 0
    for s in slots:
        segs = running[s.index].record.segments if s.index in running else s.segments
        used = max(used, s.n_tokens, *(seg.end for seg in segs))
        rec = latest(s, running.get(s.index), last_by_slot.get(s.index))
        if rec is not None and rec.trimmed_tokens:
            used = max(used, rec.reused_tokens + rec.trimmed_tokens)
    right = min(n_ctx, max(int(used * 1.15) + 1, n_ctx // 8)) if fit else n_ctx
    right = max(right, 1)
    pw = width - left - right_pad
    x = lambda pos: left + pw * min(pos, right) / right  # noqa: E731
    y = top
    for s in slots:
        run = running.get(s.index)
        segs = run.record.segments if run is not None else s.segments
        rec = latest(s, run, last_by_slot.get(s.index))
        for label, is_request in ((f"slot {s.index}", False), (f"slot {s.index} · request", True)):
            rows.append(_text(left - 6, y + row / 2 + 4, label, "end"))
            rows.append(_rect(left, y, pw, row, CAPACITY))
            if not is_request:
                for seg in messages(segs):
                    key = role_key(seg)
                    shade = "" if seg.message % 2 == 0 else ' fill-opacity="0.7"'
                    rows.append(_rect(x(seg.start), y, x(seg.end) - x(seg.start), row,
                                      role_color(key), _hover(seg, vocab.ROLES.get(key)), shade))
                for pos in s.checkpoints:
                    if pos <= right:
                        rows.append(f'<line x1="{x(pos):.1f}" x2="{x(pos):.1f}" y1="{y - 2}" '
                                    f'y2="{y + row + 2}" stroke="{INK}" stroke-width="2">'
                                    f"<title>{vocab.MARKS['checkpoint-mark'].words} at "
                                    f"{pos}</title></line>")
            else:
                for name, seg in states(segs, run):
                    rows.append(_rect(x(seg.start), y, x(seg.end) - x(seg.start), row,
                                      STATE_COLORS.get(name, NEUTRAL),
                                      _hover(seg, vocab.STATES.get(name))))
                if rec is not None and rec.trimmed_tokens:
                    a, b = rec.reused_tokens, rec.reused_tokens + rec.trimmed_tokens
                    rows.append(_rect(x(a), y + row * 0.6, x(b) - x(a), row * 0.25,
                                      COLORS["trimmed"], trimmed_text(rec),
                                      ' class="nbkv-trimmed"'))
                if rec is not None and rec.divergence is not None:
                    d = rec.divergence.position
                    if d <= right:
                        rows.append(
                            f'<path d="M{x(d) - 5:.1f},{y - 3} h10 l-5,8 z" fill="{INK}">'
                            f"<title>{esc(vocab.MARKS['divergence'].words)}: request "
                            f"{rec.id}: {esc(vocab.reason_line(rec))}</title></path>")
            y += row + gap
        y += gap * 2
    step = nice_step(right)
    ticks = "".join(
        f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{y}" stroke="{RULE}"/>'
        + _text(x(t), y + 12, f"{int(t)}", "middle", 10, MUTED)
        for t in _range(0, right, step))
    title = (f"KV positions per slot (capacity {n_ctx}"
             + (f", showing 0–{right})" if right < n_ctx else ")"))
    body = (_text(left, 18, title, size=13, color=INK) + ticks + "".join(rows))
    return _svg(width, y + 20, body, "nbkv-kvmap-svg", title)


def _range(lo: float, hi: float, step: float) -> list[float]:
    out, t = [], lo
    while t <= hi + 1e-9:
        out.append(t)
        t += step
    return out


def _hover(seg: Segment, term: vocab.Term | None) -> str:
    what = term.words if term is not None else seg.state
    return (f"{what} · message {seg.message} · {seg.role} · tokens {seg.start}–{seg.end}: "
            f"{segment_text(seg)}")


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


def timeline_svg(history: Sequence[RequestRecord], max_requests: int = 50,
                 width: int = 720) -> str:
    """Per request: share served from cache (by event), first-token time, prompt tokens."""
    recs = list(history)[-max_requests:]
    if not recs:
        return (f'<div class="nbkv-timeline-svg" style="color:{MUTED};margin:6px 0">no '
                "request yet: the timeline starts with the first one</div>")
    left, right_pad = 60, 12
    pw = width - left - right_pad
    panels = (("prompt served from cache (%)", 90), ("time to first token (ms)", 110),
              ("prompt tokens", 80))
    n = max(len(recs), 1)
    slot_w = pw / n
    bx = lambda i: left + slot_w * i  # noqa: E731
    cx = lambda i: left + slot_w * (i + 0.5)  # noqa: E731
    bw = slot_w * 0.7
    uid = f"{len(recs)}{recs[-1].id if recs else 0}"
    body: list[str] = []
    y0 = 10
    rate = prefill_rate(history)
    events_seen: dict[str, vocab.Term] = {}
    for k, (title, h) in enumerate(panels):
        top = y0 + 18
        body.append(_text(left + pw / 2, y0 + 12, title, "middle", 12, INK))
        if k == 0:
            ymax = 100.0
        elif k == 1:
            est = [no_cache_ttft(r, rate) or 0.0 for r in recs]
            ymax = max([r.ttft_s * 1000 for r in recs] + [e * 1000 for e in est] + [1.0])
        else:
            ymax = max([r.prompt_tokens for r in recs] + [1])
        step = nice_step(ymax, 3)
        ymax = max(ymax, step)
        yv = lambda v, top=top, h=h, ymax=ymax: top + h - h * v / ymax  # noqa: E731
        for t in _range(0, ymax, step):
            body.append(f'<line x1="{left}" x2="{left + pw}" y1="{yv(t):.1f}" '
                        f'y2="{yv(t):.1f}" stroke="{RULE}"/>')
            body.append(_text(left - 4, yv(t) + 3, f"{t:g}", "end", 10, MUTED))
        for i, r in enumerate(recs):
            tip_text = request_text(r)
            if k == 0:
                term = vocab.bar(r)  # a restore is its own kind of bar
                if r.reused_tokens:
                    events_seen[term.code] = term
                    fill = (f"url(#{_pattern_id(term.pattern)}-{uid})" if term.pattern
                            else "")
                    body.append(_rect(bx(i) + (slot_w - bw) / 2, yv(r.salvage_pct), bw,
                                      top + h - yv(r.salvage_pct), term.color, tip_text))
                    if fill:
                        body.append(_rect(bx(i) + (slot_w - bw) / 2, yv(r.salvage_pct), bw,
                                          top + h - yv(r.salvage_pct), fill))
                else:
                    events_seen["nothing-reused"] = vocab.MARKS["nothing-reused"]
                    body.append(f'<circle cx="{cx(i):.1f}" cy="{yv(0) - 5:.1f}" r="4" '
                                f'fill="none" stroke="{NEUTRAL}" stroke-width="1.5">'
                                f"<title>{esc(tip_text)}</title></circle>")
            elif k == 2:
                a = r.reused_tokens
                body.append(_rect(bx(i) + (slot_w - bw) / 2, yv(a), bw, top + h - yv(a),
                                  COLORS["reused"], f"request {r.id}: {a} tokens reused"))
                body.append(_rect(bx(i) + (slot_w - bw) / 2, yv(r.prompt_tokens), bw,
                                  yv(a) - yv(r.prompt_tokens), COLORS["prefilled"],
                                  f"request {r.id}: {r.prefilled_tokens} tokens read"))
        if k == 1 and recs:
            pts = " ".join(f"{cx(i):.1f},{yv(r.ttft_s * 1000):.1f}" for i, r in enumerate(recs))
            est_pts = " ".join(f"{cx(i):.1f},{yv(e * 1000):.1f}" for i, e in enumerate(est)
                               if rate > 0)
            if est_pts:
                body.append(f'<polyline points="{est_pts}" fill="none" stroke="{ESTIMATE}" '
                            'stroke-dasharray="5,3" stroke-width="1.5"/>')
            body.append(f'<polyline points="{pts}" fill="none" stroke="{NEUTRAL}" '
                        'stroke-width="1.5"/>')
            for i, r in enumerate(recs):
                body.append(f'<circle cx="{cx(i):.1f}" cy="{yv(r.ttft_s * 1000):.1f}" r="3" '
                            f'fill="{NEUTRAL}"><title>{esc(request_text(r))}\n'
                            f"{esc(ttft_text(r))}</title></circle>")
        y0 = top + h + 8
    every = max(1, n // 20)
    for i, r in enumerate(recs):
        if i % every == 0:
            body.append(_text(cx(i), y0 + 4, str(r.id), "middle", 10, MUTED))
    body.append(_text(left + pw / 2, y0 + 18, "request #", "middle", 11, TEXT))
    defs = pattern_defs((t.pattern for t in events_seen.values()), uid)
    svg = _svg(width, int(y0 + 26), defs + "".join(body), "nbkv-timeline-svg",
               "salvage and first-token time per request")
    return svg + timeline_legend(events_seen.values(), uid, bool(recs) and rate > 0)


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


# ------------------------------------------------------------------ the whole dashboard


def header_html(engine: Any, running: int = 0, closed: bool = False) -> str:
    """The dashboard's first line: model, slots, cache mode, requests, share from cache."""
    if closed:
        return ('<div class="nbkv-header-line" style="font:13px sans-serif"><b>nbkv</b> · engine '
                "closed (load a new one and run %kvcache widget again)</div>")
    s = engine.stats()
    return (f'<div class="nbkv-header-line" style="font:13px sans-serif"><b>nbkv</b> · '
            f"{esc(engine_label(engine))} · {slots_label(engine)} · "
            f"cache {engine.cache} · {s['requests']} requests, {s['salvage_pct']:.0f}% of prompt "
            f"tokens from cache · {running} running</div>")


def last_by_slot(engine: Any) -> dict[int, RequestRecord]:
    """Each slot's latest request record, from the engine's history."""
    ids = {s.index: s.last_request for s in engine.slots()}
    return {r.slot: r for r in engine.history if ids.get(r.slot) == r.id}


def frame(body: str, cls: str, caption: bool = True) -> str:
    """A static rendering's box, marked so that tests and readers can find it.

    ``caption``: say that it is a snapshot (a running notebook shows the live view instead).
    """
    note = (f'<div style="color:{MUTED};font-size:11px;font-style:italic">static snapshot: '
            "the cache when this cell ended (run the notebook for the live view)</div>"
            if caption else "")
    return (f'<div class="nbkv-static {cls}" style="font:12px sans-serif;color:{TEXT};'
            f'margin:4px 0">{note}{body}</div>')


def dashboard_html(engine: Any, state: Any = None, caption: bool = True, extra: str = ""
                   ) -> str:
    """The whole dashboard: header, legend, slot cards, KV map, timeline (then ``extra``)."""
    closed = bool(getattr(state, "closed", False))
    running = {run.record.slot: run for run in getattr(state, "running", {}).values()}
    if closed:
        return frame(header_html(engine, closed=True), "nbkv-dashboard-static", caption)
    last = dict(getattr(state, "last_by_slot", None) or last_by_slot(engine))
    slots = engine.slots()
    parts = [header_html(engine, len(running)), legend_html(),
             cards_html(slots, last, running, parked_of(engine))]
    if engine.n_slots:
        parts.append(kvmap_svg(slots, engine.n_ctx, last, running))
    parts.append(timeline_svg(engine.history))
    return frame("".join(parts) + extra, "nbkv-dashboard-static", caption)
