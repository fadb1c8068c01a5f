"""nbkv: a persistent multi-slot llama.cpp engine whose KV cache is fast and visible."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["Engine", "ChatResult", "ChatStream", "SlotInfo", "__version__"]

if TYPE_CHECKING:
    from .engine import ChatResult, ChatStream, Engine, SlotInfo


def __getattr__(name: str):
    # the engine pulls in llama_cpp; import it only when asked for
    if name in ("Engine", "ChatResult", "ChatStream", "SlotInfo"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'nbkv' has no attribute {name!r}")
