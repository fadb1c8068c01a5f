"""Slot occupancy: a card per slot (session, messages, tokens, LRU, pending), a parked shelf."""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from traitlets import Int

from nbkv.ui import static
from nbkv.ui.widgets.feed import Feed, FeedView, LiveState


class SlotCards(FeedView, W.VBox):
    """A card per slot, redrawn from the engine's slot snapshot as events arrive.

    Each card says what the slot's latest request did, in the words of
    :mod:`nbkv.ui.vocabulary`; its memory class and LRU rank explain themselves in tooltips.
    """

    label = "slot cards"
    busy = Int(0, help="Slots serving a request at the last redraw")
    used = Int(0, help="KV positions in use over all slots at the last redraw")
    parked = Int(0, help="Conversations parked (RAM and disk) at the last redraw")

    def __init__(self, engine: Any, feed: Feed | None = None, **kw: Any) -> None:
        self.engine = engine
        self.cards = [W.HTML(layout=W.Layout(margin="0 6px 6px 0"))
                      for _ in range(engine.n_slots)]
        for c in self.cards:
            c.add_class("nbkv-slot-card")
        self.note = W.HTML()
        self.hider = W.HTML()
        self.shelf = W.HTML()  # conversations parked in RAM or on disk
        self.row = W.Box(self.cards, layout=W.Layout(flex_flow="row wrap"))
        super().__init__([self.hider, self.row, self.shelf, self.note], **kw)
        self.add_class("nbkv-slot-cards")
        self.follow(engine, feed)

    def render(self, state: LiveState) -> None:
        """Redraw every card (a card whose HTML did not change sends nothing)."""
        slots = self.engine.slots()
        rank, n = static.lru_ranks(slots)
        with self.hold_sync():
            for s, card in zip(slots, self.cards):
                card.value = static.card(s, rank.get(s.index), n, state.running_on(s.index),
                                         state.last_by_slot.get(s.index))
            parked = static.parked_of(self.engine)
            self.shelf.value = static.shelf_html(parked)
            self.parked = len(parked)
            self.busy = sum(1 for s in slots if s.pending)
            self.used = sum(s.n_tokens for s in slots)
            self.note.value = "engine closed" if state.closed else (
                "" if self.cards else "slots are managed by the server: nbkv sees its "
                                      "sessions and what each request reused")

    def static_html(self) -> str:
        """The cards as plain HTML (the saved notebook's fallback)."""
        state = self.feed.snapshot()  # the render thread may be drawing meanwhile
        if state.closed:
            return static.frame("engine closed", "nbkv-slot-cards-static")
        running = {run.record.slot: run for run in state.running.values()}
        return static.frame(static.cards_html(self.engine.slots(), state.last_by_slot, running,
                                              static.parked_of(self.engine)),
                            "nbkv-slot-cards-static")
