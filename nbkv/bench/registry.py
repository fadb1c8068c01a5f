"""The scenarios by name: each scenario module registers its functions with ``@scenario``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: A scenario: (model path, quick) -> its figures, with the ratios under ``"ratios"``.
Scenario = Callable[[str, bool], dict[str, Any]]

#: name (``--scenario NAME``) -> function, in the order a full run plays them (the order the
#: package imports the scenario modules in)
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    """Register the decorated function as scenario ``name``."""

    def register(fn: Scenario) -> Scenario:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is registered twice")
        SCENARIOS[name] = fn
        return fn

    return register
