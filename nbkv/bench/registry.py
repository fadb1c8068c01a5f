"""The scenarios by name: each scenario module registers its functions with ``@scenario``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

#: A scenario: (model path, quick) -> its figures, with the ratios under ``"ratios"``.
Scenario = Callable[[str, bool], dict[str, Any]]

#: name (``--scenario NAME``) -> function, in the order a full run plays them (the order the
#: package imports the scenario modules in)
SCENARIOS: dict[str, Scenario] = {}

_F = TypeVar("_F", bound=Callable[..., dict[str, Any]])


def scenario(name: str) -> Callable[[_F], _F]:
    """Register the decorated function as scenario ``name`` (its signature is kept)."""

    def register(fn: _F) -> _F:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is registered twice")
        SCENARIOS[name] = fn
        return fn

    return register
