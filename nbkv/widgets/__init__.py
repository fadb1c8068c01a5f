"""Live views of an engine's KV cache (ipywidgets 8 and plotly), fed by its events.

``CacheDashboard(engine)`` shows everything; the pieces work alone too: ``SlotCards``,
``KVMap`` and ``Timeline`` each take an engine (and optionally a shared :class:`Feed`).
"""

from __future__ import annotations

from .dashboard import CacheDashboard
from .feed import Feed, LiveState
from .kvmap import KVMap
from .slots import SlotCards
from .timeline import Timeline

__all__ = ["CacheDashboard", "Feed", "KVMap", "LiveState", "SlotCards", "Timeline"]
