"""One conversation's bookkeeping, as every holder of its KV carries it.

A slot's snapshot, a saved slot, a parked conversation and its light view all describe
the same thing: whose conversation it is, the units its KV holds, where each message ends
and its cumulative hash, the KV map's segments, the LRU clocks, and how much of the KV is
canonical. :class:`Conversation` is that record, once, with its own checks; the holders
(:class:`~nbkv.store.parked.ParkedEntry`, :class:`~nbkv.store.parked.ParkedInfo`,
:class:`~nbkv.kv.slot_table.SlotState`) add only what is theirs (KV buffers, a tier, a slot
index), and one codec writes it (:func:`nbkv.store.parked.entry_json`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nbkv.core.events import Segment


@dataclass(frozen=True)
class Conversation:
    """A conversation held in KV: its units, message boundaries and hashes, clocks.

    ``tokens`` has one unit per KV position (token ids and image units); ``hashes[k]`` is
    the cumulative hash of the first ``k + 1`` messages, which end at ``msg_ends[k]`` (no
    hashes at all where nbkv knows only the boundaries: a row of an OpenAI-compatible
    server's cache);
    ``settled`` leading positions hold KV equal to a batched prefill of the tokens (-1:
    all of them); ``checkpoints`` are the positions of its checkpoints (hybrid and recurrent
    memory). Raises ``ValueError`` when the parts disagree: a boundary or a checkpoint
    outside the tokens, hashes without boundaries, a settled prefix longer than the tokens.
    """

    session: str | None
    tokens: Sequence[Any] = ()
    hashes: Sequence[str] = ()
    msg_ends: Sequence[int] = ()
    segments: Sequence[Segment] = ()
    last_used: int = 0  # logical LRU clock of the engine that held it
    last_request: int | None = None
    used_at: float = 0.0  # wall clock (time.time()) of its last use: LRU order across processes
    settled: int = -1
    checkpoints: Sequence[int] = field(default=())

    def __post_init__(self) -> None:
        tokens = tuple(self.tokens)
        ends = tuple(int(e) for e in self.msg_ends)
        cps = tuple(int(p) for p in self.checkpoints)
        n = len(tokens)
        settled = n if self.settled == -1 else int(self.settled)
        for name, value in (("tokens", tokens), ("hashes", tuple(self.hashes)),
                            ("msg_ends", ends), ("segments", tuple(self.segments)),
                            ("checkpoints", cps), ("settled", settled)):
            object.__setattr__(self, name, value)
        if len(self.hashes) not in (0, len(ends)) or any(not 0 < e <= n for e in ends):
            raise ValueError("message hashes and boundaries disagree")
        if any(not 0 < p <= n for p in cps):
            raise ValueError("a checkpoint lies outside its tokens")
        if not 0 <= settled <= n:
            raise ValueError(f"settled {settled} outside its {n} tokens")

    @property
    def n_tokens(self) -> int:
        """KV positions the conversation holds."""
        return len(self.tokens)

    @classmethod
    def held(cls, session: str | None, tokens: Sequence[Any], hashes: Sequence[str],
             msg_ends: Sequence[int], segments: Sequence[Segment] = (), last_used: int = 0,
             last_request: int | None = None, used_at: float = 0.0, settled: int = -1,
             checkpoints: Sequence[int] = ()) -> Conversation:
        """The record of a KV that holds ``tokens`` now: boundaries past its end left out.

        A live slot's bookkeeping can run ahead of its KV for a moment (a request cut it back
        to a checkpoint and reads the rest again): the messages that end past the tokens, and
        checkpoints past them, are not kept. Its map (``segments``) stays as the slot shows it.
        """
        tokens = tuple(tokens)
        n = len(tokens)
        k = sum(1 for e in msg_ends if e <= n)
        return cls(session, tokens, tuple(hashes)[:k], tuple(msg_ends)[:k], segments,
                   last_used, last_request, used_at, min(settled, n),
                   tuple(p for p in checkpoints if p <= n))

    def cut(self, n: int) -> Conversation:
        """Its first ``n`` positions: the messages that end there, segments clipped to them."""
        return self.held(self.session, tuple(self.tokens)[:n], self.hashes, self.msg_ends,
                         tuple(replace(g, end=min(g.end, n)) for g in self.segments
                               if g.start < n),
                         self.last_used, self.last_request, self.used_at, self.settled,
                         self.checkpoints)


class HoldsConversation:
    """The record's fields, read through ``self.conversation`` (a mixin of its holders).

    Slot snapshots, saved slots and parked entries carry one :class:`Conversation` and add
    what is theirs; callers keep reading ``info.tokens``, ``entry.session``, ... as before.
    """

    conversation: Conversation

    @property
    def session(self) -> str | None:
        """Whose conversation it is."""
        return self.conversation.session

    @property
    def tokens(self) -> tuple[Any, ...]:
        """One unit per KV position: token ids and image units."""
        return tuple(self.conversation.tokens)

    @property
    def hashes(self) -> tuple[str, ...]:
        """Cumulative hashes of its messages."""
        return tuple(self.conversation.hashes)

    @property
    def msg_ends(self) -> tuple[int, ...]:
        """Where each message ends."""
        return tuple(self.conversation.msg_ends)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The KV map's segments."""
        return tuple(self.conversation.segments)

    @property
    def last_used(self) -> int:
        """The LRU clock of its last use in a slot."""
        return self.conversation.last_used

    @property
    def last_request(self) -> int | None:
        """The request that last used it."""
        return self.conversation.last_request

    @property
    def used_at(self) -> float:
        """Wall clock (``time.time()``) of its last use in a slot."""
        return self.conversation.used_at

    @property
    def recency(self) -> tuple[float, int]:
        """Its place in LRU order (smaller: used longer ago): wall clock, then LRU clock.

        The wall clock orders conversations across processes and restarts; the engine's
        clock breaks ties within one.
        """
        c = self.conversation
        return (c.used_at, c.last_used)

    @property
    def settled(self) -> int:
        """Leading positions whose KV equals a batched prefill of the tokens."""
        return self.conversation.settled

    @property
    def n_tokens(self) -> int:
        """KV positions it holds."""
        return self.conversation.n_tokens
