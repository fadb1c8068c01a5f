"""The dashboard's colours: one palette for the tables, the KV strip and the widgets."""

from __future__ import annotations

#: what happened to KV positions in a request
COLORS = {"reused": "#2e9e5b", "prefilled": "#f08c2e", "generated": "#8e5cc7",
          "trimmed": "#d9534f"}
#: the positions an image's embeddings occupy
MEDIA_COLOR = "#e377c2"
#: who wrote a message
ROLE_COLORS = {"system": "#5b6770", "user": "#3b7dd8", "assistant": "#17a2b8",
               "tool": "#a0522d"}
#: the conversation view: a stale turn (answered before an earlier turn was re-run) is drawn
#: greyed out; a branch point (a re-run turn, a fork) is marked in this colour
STALE_COLOR = "#9aa0a6"
BRANCH_COLOR = "#444c56"
