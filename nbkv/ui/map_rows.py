"""The KV map's rows: slots, or the sessions on a server that keeps its own cache.

An in-kernel engine or llama-server has slots: a row pair per slot. An OpenAI-compatible
server (vLLM) keeps its own prefix cache, shared by every request: a row pair per session,
its latest request cut at the server's block size, and what the server holds of it now
(from its KV cache events). Shared by the live map and its static fallback.
"""

from __future__ import annotations

from typing import Any

from nbkv.core.protocol import ServerCacheRows
from nbkv.ui import vocabulary as vocab


def map_rows(engine: Any) -> tuple[tuple[Any, ...], bool]:
    """The KV map's rows, and whether they are a server's sessions rather than slots.

    The engine's slots; or, for a server that manages its own cache (OpenAI-compatible),
    one row per session (``cache_rows()``).
    """
    if engine.n_slots or not isinstance(engine, ServerCacheRows):
        return tuple(engine.slots()), False
    return tuple(engine.cache_rows()), True


def row_labels(s: Any, server: bool) -> tuple[str, str]:
    """A row pair's labels: ``slot 0`` / ``slot 0 · request``, or the session's name."""
    name = (s.session or "(no session)") if server else f"slot {s.index}"
    return name, f"{name} · request"


def held_text(s: Any, block_size: int | None) -> str:
    """The hover of a session row's band: what the server's cache holds of it now."""
    blocks = f" ({s.server_cached // block_size} blocks)" if block_size else ""
    return (f"{vocab.MARKS['server-held'].words}: its first {s.server_cached} tokens"
            f"{blocks}, of the {s.n_tokens} its latest request left (KV cache events since "
            f"nbkv connected)")


def map_title(n_ctx: int, right: int, server: bool, block_size: int | None) -> str:
    """The KV map's title: per slot, or per session in the server's blocks."""
    what = "KV positions per slot" if not server else (
        "the server's prefix cache per session" + (f", blocks of {block_size}"
                                                   if block_size else ""))
    return (f"{what} (capacity {n_ctx}" + (f", showing 0–{right})" if right < n_ctx else ")"))


def held_caption() -> str:
    """What the thin band over a session's row means."""
    return (f"thin band over a session: {vocab.MARKS['server-held'].words} (the blocks its "
            f"KV cache events say it stores and has not evicted since nbkv connected)")
