"""Slot occupancy: one card per slot (session, messages, tokens / capacity, LRU, pending)."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as W
from traitlets import Int

from ..display import size_text
from ..palette import COLORS
from .feed import Feed, FeedView, LiveState

CARD = ("border:1px solid #d0d7de;border-radius:6px;padding:6px 10px;width:210px;"
        "font:12px sans-serif;line-height:1.5")


class SlotCards(FeedView, W.VBox):
    """A card per slot, redrawn from the engine's slot snapshot as events arrive."""

    busy = Int(0, help="Slots serving a request at the last redraw")
    used = Int(0, help="KV positions in use over all slots at the last redraw")

    def __init__(self, engine: Any, feed: Feed | None = None, **kw: Any) -> None:
        self.engine = engine
        self.cards = [W.HTML(layout=W.Layout(margin="0 6px 6px 0"))
                      for _ in range(engine.n_slots)]
        for c in self.cards:
            c.add_class("nbkv-slot-card")
        self.note = W.HTML()
        super().__init__([W.Box(self.cards, layout=W.Layout(flex_flow="row wrap")), self.note],
                         **kw)
        self.add_class("nbkv-slot-cards")
        self._own_feed = feed is None
        self.feed = feed or Feed(engine)
        self.feed.attach(self)

    def render(self, state: LiveState) -> None:
        """Redraw every card."""
        slots = self.engine.slots()
        order = sorted((s for s in slots if not s.empty), key=lambda s: -s.last_used)
        rank = {s.index: i + 1 for i, s in enumerate(order)}
        with self.hold_sync():
            for s, card in zip(slots, self.cards):
                card.value = _card(s, rank.get(s.index), len(order), state.running_on(s.index))
            self.busy = sum(1 for s in slots if s.pending)
            self.used = sum(s.n_tokens for s in slots)
            self.note.value = "engine closed" if state.closed else (
                "" if self.cards else "slots are managed by the server: nbkv sees its "
                                      "sessions and what each request reused")




def _card(s: Any, rank: int | None, n_used: int, run: Any) -> str:
    pct = 100 * s.n_tokens / s.capacity if s.capacity else 0
    if run is not None:
        r = run.record
        if run.phase == "generate":
            busy = f"generating: {run.generated} tokens"
        else:
            busy = f"prefilling {run.prefilled}/{r.prefilled_tokens} ({r.strategy})"
        badge = (f'<span style="background:{COLORS["prefilled"]};color:white;'
                 f'border-radius:3px;padding:0 4px">busy</span> {html.escape(busy)}')
    elif s.pending:
        badge = (f'<span style="background:{COLORS["prefilled"]};color:white;'
                 'border-radius:3px;padding:0 4px">pending</span>')
    else:
        badge = ""
    lru = f"LRU {rank} of {n_used}" if rank else "empty"
    session = html.escape(s.session) if s.session else '<span style="color:#999">free</span>'
    return (
        f'<div class="nbkv-card" data-slot="{s.index}" style="{CARD}">'
        f"<b>slot {s.index}</b> · {session}<br>"
        f"{s.n_messages} messages · {s.n_tokens}/{s.capacity} tokens<br>"
        f'<div style="background:#eee;height:6px;border-radius:3px">'
        f'<div style="background:#3b7dd8;height:6px;border-radius:3px;width:{pct:.1f}%">'
        f"</div></div>"
        f"{lru} · media chunks: {s.n_media}<br>"
        f'<span class="nbkv-memory">{_memory(s)}</span><br>{badge}{_unverified(s)}</div>'
    )


def _unverified(s: Any) -> str:
    """A remote slot whose server content differs from what nbkv expects."""
    if s.verified:
        return ""
    return (f'<div class="nbkv-unverified" title="{html.escape(s.note, quote=True)}" '
            f'style="color:{COLORS["trimmed"]}">✗ not verified</div>')


def _memory(s: Any) -> str:
    """The slot's memory class, and its checkpoints on hybrid and recurrent models."""
    if s.memory not in ("hybrid", "recurrent") and not s.checkpoints:
        return s.memory
    n = len(s.checkpoints)
    return (f"{s.memory} · {n} checkpoint{'s' if n != 1 else ''} "
            f"({size_text(s.checkpoint_bytes)})")
