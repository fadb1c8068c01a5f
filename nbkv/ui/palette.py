"""Every colour nbkv draws with: the tables, the KV strip, the widgets and the static pages.

No other module spells a colour (``tests/test_vocabulary.py`` checks it); what each colour
*means* is stated once, in :mod:`nbkv.ui.vocabulary`.
"""

from __future__ import annotations

#: what happened to KV positions in a request. Told apart by lightness as well as hue, so
#: that they read for red-green colour blindness too (``tests/test_chartfig.py`` simulates
#: it): reused mid green, read new light orange, generated dark violet, trimmed dark red
COLORS = {"reused": "#2e9e5b", "prefilled": "#f08c2e", "generated": "#4b2c7a",
          "trimmed": "#7f0000"}
#: prompt positions of a request in flight that are still to be read
TODO_COLOR = "#f8d3ad"
#: the positions an image's embeddings occupy
MEDIA_COLOR = "#e377c2"
#: parking (conversations that lost their slot, kept in RAM or on disk): a parked entry on
#: the slot cards' shelf, and a request served by restoring one (its own kind of bar)
PARKED_COLOR = "#8c7a5b"
RESTORED_COLOR = "#c9a227"
#: a reply given again from the cache (a re-run cell with the same prompt and settings)
REPLAYED_COLOR = "#4a9fb5"
#: who wrote a message
ROLE_COLORS = {"system": "#5b6770", "user": "#3b7dd8", "assistant": "#17a2b8",
               "tool": "#a0522d", "other": "#999999"}
#: the conversation view: a stale turn (answered before an earlier turn was re-run) is drawn
#: greyed out; a branch point (a re-run turn, a fork) is marked in this colour
STALE_COLOR = "#9aa0a6"
BRANCH_COLOR = "#444c56"

#: highlights of ``%kvcache explain``: what the slot held after the divergence (trimmed) and
#: what the new prompt read instead. Far apart in hue and lightness, and the trimmed one is
#: also hatched and struck through, so the two never look alike
TRIMMED_TINT = "#f4b4b2"
PREFILLED_TINT = "#ffe680"
#: ... and a replayed request's cached side: its reply given again, the later turns kept
REUSED_TINT = "#bfe3cf"

#: neutral ink: text, marks, grids and backgrounds
INK = "#222222"  # marks (checkpoints, divergence), strong text
TEXT = "#444444"  # body text of legends and cards
MUTED = "#666666"  # notes, captions
FAINT = "#888888"  # the shared part of two renderings
NEUTRAL = "#555555"  # first-token line, figures text
ESTIMATE = "#aaaaaa"  # the no-cache estimate (dashed)
FREE = "#999999"  # a free slot's label
RULE = "#e0e0e0"  # table rules, cell borders
CARD_BORDER = "#d0d7de"
TRACK = "#eeeeee"  # empty part of a bar
STRIP_BACKGROUND = "#f0f0f0"
CAPACITY = "#f3f3f3"  # a slot's unused positions on the KV map
PAPER = "#ffffff"
ERROR = "#cc0000"
STRIPE = "rgba(255,255,255,.5)"  # the stripes over generated positions
