"""Draft tokens for speculative decoding by prompt lookup (n-gram matching).

With ``Engine(speculative=True)`` a generating sequence decodes a second position beside
its next token: a guess of the token after it, the one that followed the latest earlier
occurrence of the sequence's last ``n`` tokens (longest ``n`` first). When the sampled
token equals the guess, the guess's KV and logits are already computed and the request
advances two tokens in one decode; when it does not, the guess is removed from the KV. Chat
replies often quote the conversation (names, code, the question itself), which is what makes
such cheap guesses pay off.
"""

from __future__ import annotations

from collections.abc import Iterable

_NOT_TEXT = -1  # stands for an image position: matched like any token, never proposed


class NgramDrafter:
    """Proposes the next token from the history seen so far (prompt, then generated tokens).

    >>> d = NgramDrafter([1, 2, 3, 9, 1, 2])
    >>> d.draft()
    3
    >>> d.append(4); d.draft() is None
    True
    """

    def __init__(self, tokens: Iterable[object] = (), max_n: int = 3) -> None:
        self.max_n = max_n
        self._tail: list[int] = []  # the last max_n tokens
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> token after its latest use
        self.extend(tokens)

    def append(self, token: object) -> None:
        """Add the next token of the history (ints are tokens; anything else is an image)."""
        t = token if isinstance(token, int) else _NOT_TEXT
        tail = self._tail
        for n in range(1, len(tail) + 1):
            self._next[tuple(tail[-n:])] = t
        tail.append(t)
        if len(tail) > self.max_n:
            del tail[0]

    def extend(self, tokens: Iterable[object]) -> None:
        """Add several tokens, in order."""
        for t in tokens:
            self.append(t)

    def draft(self) -> int | None:
        """The guess for the token after the history, or None without an earlier match."""
        tail = self._tail
        for n in range(len(tail), 0, -1):
            t = self._next.get(tuple(tail[-n:]))
            if t is not None:
                return None if t == _NOT_TEXT else t
        return None
