"""The dashboard as static HTML with inline SVG: what a saved notebook shows with no kernel.

A displayed nbkv widget puts one of these beside its live view, refreshed after requests
(:mod:`nbkv.ui.widgets.snapshot`), so GitHub, nbviewer, an nbconvert export and Binder before
the kernel starts show the slot cards, the KV map and the timeline after the last request;
:mod:`nbkv.ui.page` puts them on one self-contained page. The charts themselves are drawn by
:mod:`nbkv.ui.charts`. No JavaScript, no fonts or scripts from elsewhere; colours from
:mod:`nbkv.ui.palette`, words from :mod:`nbkv.ui.vocabulary`. Nothing here imports Jupyter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nbkv.core.events import RequestRecord
from nbkv.core.protocol import Parks
from nbkv.ui import vocabulary as vocab
from nbkv.ui.charts import (  # noqa: F401 - request_text, trimmed_text: re-exported
    draw_kvmap,
    engine_map,
    request_text,
    timeline_svg,
    trimmed_text,
)
from nbkv.ui.display import (
    engine_label,
    esc,
    legend_html,
    lru_ranks,
    size_text,
    slots_label,
    tip,
)
from nbkv.ui.palette import (
    CARD_BORDER,
    COLORS,
    FREE,
    MUTED,
    PAPER,
    PARKED_COLOR,
    ROLE_COLORS,
    TEXT,
    TRACK,
)

CARD = (f"border:1px solid {CARD_BORDER};border-radius:6px;padding:6px 10px;width:210px;"
        "font:12px sans-serif;line-height:1.5")


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
    """The slot's memory class, and its checkpoints (sliding-window, hybrid, recurrent)."""
    if s.memory not in ("sliding-window", "hybrid", "recurrent") and not s.checkpoints:
        return s.memory
    n = len(s.checkpoints)
    return (f"{s.memory} · {n} checkpoint{'s' if n != 1 else ''} "
            f"({size_text(s.checkpoint_bytes)})")


def memory_html(s: Any) -> str:
    """:func:`memory_text` with the memory class explained in a tooltip."""
    term = vocab.MEMORY.get(s.memory)
    text = f"{s.memory} memory: {term.tip}" if term else s.memory
    return tip(text, esc(memory_text(s)), "nbkv-memory")


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
        f"{esc(vocab.parked_name(p))} · {len(p.tokens):,} tokens · {size_text(p.nbytes)} · "
        f"{tip(vocab.PARKING[p.tier].tip, esc(vocab.tier_words(p.tier)), 'nbkv-tier')}</div>"
        for p in parked)
    total = size_text(sum(p.nbytes for p in parked))
    head = tip(term.tip, f'<b style="color:{PARKED_COLOR}">{esc(term.words)}</b>')
    return (f'<div class="nbkv-shelf" style="{CARD};width:auto;max-width:440px;'
            f'border-left:4px solid {PARKED_COLOR};margin:0 6px 6px 0">'
            f"{head} · {len(parked)} conversation{'s' if len(parked) != 1 else ''} · {total}"
            f"{rows}</div>")


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
            "the cache as last shown (run the notebook for the live view)</div>"
            if caption else "")
    return (f'<div class="nbkv-static {cls}" style="font:12px sans-serif;color:{TEXT};'
            f'margin:4px 0">{note}{body}</div>')


def dashboard_html(engine: Any, state: Any = None, caption: bool = True, extra: str = "",
                   charts: bool = True) -> str:
    """The whole dashboard: header, legend, slot cards, KV map, timeline (then ``extra``).

    ``charts=False``: without the KV map and the timeline (outputs of their own).
    """
    closed = bool(getattr(state, "closed", False))
    running = {run.record.slot: run for run in getattr(state, "running", {}).values()}
    if closed:
        return frame(header_html(engine, closed=True), "nbkv-dashboard-static", caption)
    last = dict(getattr(state, "last_by_slot", None) or last_by_slot(engine))
    slots = engine.slots()
    parts = [header_html(engine, len(running)), legend_html(),
             cards_html(slots, last, running, parked_of(engine))]
    if charts:
        m = engine_map(engine, last, running)
        parts += [draw_kvmap(m)] if m.rows or engine.n_slots else []
        parts.append(timeline_svg(engine.history))
    return frame("".join(parts) + extra, "nbkv-dashboard-static", caption)
