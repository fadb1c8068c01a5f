"""Where each message's rendering ends, found from one rendering of all of them.

:meth:`nbkv.prompt.templates.ChatTemplate.boundaries` defines message ``k``'s end as how much
of the full rendering the rendering of ``messages[:k + 1]`` shares with it: one rendering per
message, each as long as the conversation. Here the messages are rendered once, read through
:class:`Watched`, which notes where the output stands when the template first reads anything
that tells ``messages[:k + 1]`` apart from all the messages (message ``k + 1``, the list's
length, its end). Up to there, by determinism, the shorter rendering is the same text: that is
each message's end. The caller checks a few of them against real renderings of prefixes, and
uses the slow definition where any differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nbkv.core.codes import common_prefix


class Watched(Sequence[Any]):
    """The messages, reporting each read that tells a prefix of them apart from them all.

    ``note(j)``: only a list longer than ``j`` answers this read as the whole list does (for
    the length, or the end: ``j = len(messages) - 1``). Not a ``list``: code that reads a list
    without asking it (``json.dumps``) fails on it rather than read unnoticed, and the caller
    then renders the plain list instead.
    """

    def __init__(self, items: Sequence[Any], note: Callable[[int], None]) -> None:
        self._items = list(items)
        self._note = note
        self._all = len(self._items) - 1

    def __len__(self) -> int:
        self._note(self._all)
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        self._note(min(i, self._all) if isinstance(i, int) and i >= 0 else self._all)
        return self._items[i]

    def __iter__(self) -> Iterator[Any]:
        for i, m in enumerate(self._items):
            self._note(i)
            yield m
        self._note(self._all)

    def __reversed__(self) -> Iterator[Any]:
        self._note(self._all)
        return reversed(self._items)

    def __contains__(self, x: Any) -> bool:
        self._note(self._all)
        return x in self._items

    def __eq__(self, other: Any) -> bool:
        self._note(self._all)
        return self._items == (other._items if isinstance(other, Watched) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._note(self._all)
        return repr(self._items)

    __str__ = __repr__


class Ends:
    """The note-taker for :class:`Watched`: the output's length when each prefix first differs.

    ``pos`` is kept by whoever reads the rendering, as it reads.
    """

    def __init__(self, n: int) -> None:
        self.pos = 0
        self.at: list[int] = []  # at[k]: where messages[:k + 1] first reads differently
        self.n = n

    def note(self, j: int) -> None:
        """Reads that only ``messages[:j + 1]`` or longer answer alike happened here."""
        while len(self.at) < min(j, self.n):
            self.at.append(self.pos)

    def ends(self, whole: str, full: str) -> list[int]:
        """Each message's end in ``full``, from ``whole`` (all messages, no generation prompt)."""
        shared = common_prefix(whole, full)
        at = self.at + [len(whole)] * (self.n - len(self.at))
        return [min(x, shared) for x in at]


def samples(n: int) -> list[int]:
    """The messages whose ends are checked by real renderings: first, last, and between."""
    return sorted({0, 1, n // 4, n // 2, 3 * n // 4, n - 2, n - 1} & set(range(n)))
