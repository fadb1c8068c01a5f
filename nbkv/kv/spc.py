"""The System Prompt Cache's store: saved sequence states keyed by the system prompt's hash."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SavedPrompt:
    """A whole sequence state holding exactly ``tokens``."""

    state: Any
    tokens: tuple[Any, ...]


class SystemPromptStore:
    """Saved system-prompt states, least recently used evicted beyond ``max_entries``."""

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, SavedPrompt] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, prompt: Sequence[Any]) -> SavedPrompt | None:
        """The entry for ``key`` if its tokens start ``prompt`` (marked used), else None."""
        entry = self._entries.get(key)
        if entry is None or tuple(prompt[: len(entry.tokens)]) != entry.tokens:
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: str, state: Any, tokens: Sequence[Any]) -> None:
        """Save (or replace) the state for ``key``."""
        self._entries[key] = SavedPrompt(state, tuple(tokens))
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def items(self) -> list[tuple[str, SavedPrompt]]:
        """Every ``(key, entry)``, least recently used first."""
        return list(self._entries.items())

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
