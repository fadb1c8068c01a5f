"""nbkv: a persistent multi-slot llama.cpp engine whose KV cache is fast and visible.

In Jupyter or IPython, ``%load_ext nbkv`` adds the ``%kvcache`` and ``%%chat`` magics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Engine", "ChatResult", "ChatStream", "SlotInfo", "connect", "session", "current_engine",
    "report", "load_ipython_extension", "unload_ipython_extension", "__version__",
]

if TYPE_CHECKING:
    from nbkv.core.streams import ChatResult, ChatStream
    from nbkv.engine.facade import Engine
    from nbkv.kv.slot_table import SlotInfo
    from nbkv.notebook.sessions import current_engine, session
    from nbkv.remote.connect import connect


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbkv``: register the ``%kvcache`` and ``%%chat`` magics."""
    from nbkv.notebook.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbkv``: remove the magics and close the engine they loaded."""
    from nbkv.notebook.magics import unload

    unload(ipython)


def report(engine: Any = None, explain_last: int = 3) -> Any:
    """The cache of ``engine`` (default: the loaded one) on one self-contained page.

    ``nbkv.report().to_html("cache.html")``; in a notebook it shows inline.
    """
    from nbkv.ui.page import report as page

    if engine is None:
        from nbkv.notebook.sessions import STORE

        engine = STORE.require_engine()
    return page(engine, explain_last)


def __getattr__(name: str):
    # the engine pulls in llama_cpp; import it only when asked for
    if name in ("Engine", "ChatResult", "ChatStream", "SlotInfo"):
        from nbkv.engine import facade as engine

        return getattr(engine, name)
    if name == "connect":
        from nbkv.remote.connect import connect

        return connect
    if name in ("session", "current_engine"):
        from nbkv.notebook import sessions

        return getattr(sessions, name)
    raise AttributeError(f"module 'nbkv' has no attribute {name!r}")
