"""Live views of an engine's KV cache (ipywidgets 8 and plotly), fed by its events.

``CacheDashboard(engine)`` shows everything; the pieces work alone too: ``SlotCards``,
``KVMap``, ``Timeline`` and ``Conversations`` each take an engine (and optionally a shared
:class:`Feed`).
"""

from __future__ import annotations

from .conversations import Conversations
from .dashboard import CacheDashboard
from .feed import Feed, LiveState
from .kvmap import KVMap
from .slots import SlotCards
from .timeline import Timeline

__all__ = ["CacheDashboard", "Conversations", "Feed", "KVMap", "LiveState", "SlotCards",
           "Timeline"]
