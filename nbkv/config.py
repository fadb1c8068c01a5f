"""The engine's settings that the magics, the traits and :class:`~nbkv.engine.Engine` share.

One place for each choice and its default, so ``%kvcache load``, ``%config Nbkv`` and
``Engine(...)`` cannot disagree. Pure data: importing it loads no model code.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequestError

CACHE_MODES = ("imc", "spc", "off")  # whole conversations, system prompt only, nothing
OVERFLOW_POLICIES = ("error", "slide")  # raise, or drop the oldest turns


@dataclass(frozen=True)
class EngineConfig:
    """Cache settings of an engine (see :class:`~nbkv.engine.Engine` for each one)."""

    n_slots: int = 4
    n_ctx: int = 4096
    cache: str = "imc"
    cache_min_tokens: int = 100
    overflow: str = "error"

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:
            raise InvalidRequestError(f"cache must be one of {CACHE_MODES}, not {self.cache!r}")
        check_overflow(self.overflow)
        if self.n_slots < 1:
            raise InvalidRequestError("n_slots must be >= 1")
        if self.n_ctx < 1:
            raise InvalidRequestError("n_ctx must be >= 1")


def check_overflow(overflow: str) -> str:
    """``overflow`` if it is a known policy, else :class:`InvalidRequestError`."""
    if overflow not in OVERFLOW_POLICIES:
        raise InvalidRequestError(
            f"overflow must be one of {OVERFLOW_POLICIES}, not {overflow!r}")
    return overflow


DEFAULTS = EngineConfig()
