"""Live views of an engine's KV cache (ipywidgets 8, inline SVG), fed by its events.

``CacheDashboard(engine)`` shows everything; the pieces work alone too: ``SlotCards``,
``KVMap``, ``Timeline`` and ``Conversations`` each take an engine (and optionally a shared
:class:`Feed`).
"""

from __future__ import annotations

from nbkv.ui.widgets.conversations import Conversations
from nbkv.ui.widgets.dashboard import CacheDashboard
from nbkv.ui.widgets.feed import Feed, LiveState
from nbkv.ui.widgets.kvmap import KVMap
from nbkv.ui.widgets.slots import SlotCards
from nbkv.ui.widgets.snapshot import refresh_all
from nbkv.ui.widgets.timeline import Timeline

__all__ = ["CacheDashboard", "Conversations", "Feed", "KVMap", "LiveState", "SlotCards",
           "Timeline", "refresh_all"]
