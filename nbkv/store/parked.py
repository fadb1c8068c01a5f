"""A parked conversation: what a slot held when it was taken, and its save-format JSON.

When a request takes a slot from another conversation, the engine parks that conversation
(:class:`ParkedEntry`) instead of losing it: the whole sequence state, its checkpoints on
hybrid and recurrent memory, and the bookkeeping that lets the policy match a later prompt
against it. :class:`ParkedInfo` is the light view of one (no buffers) that the policy and
the views read. States are opaque buffers here (bytes, ctypes arrays): no model needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbkv.core.errors import RestoreError
from nbkv.core.events import Segment
from nbkv.store.blobstore import (
    Blobs,
    decode_units,
    encode_units,
    nbytes,
    segment_from_json,
    segment_json,
)

RAM, DISK = "ram", "disk"
TIERS = (RAM, DISK)


@dataclass(frozen=True)
class ParkedInfo:
    """One parked conversation as the policy and the views see it (no state buffers)."""

    key: str
    session: str | None
    tokens: tuple[Any, ...]  # one unit per KV position: token ids and image units
    hashes: tuple[str, ...]
    msg_ends: tuple[int, ...]
    last_used: int
    nbytes: int  # its state and checkpoints
    tier: str  # RAM or DISK
    settled: int = -1  # leading positions whose KV stays exact whatever follows (-1: all)
    checkpoints: tuple[int, ...] = ()  # positions of its checkpoints
    used_at: float = 0.0  # wall clock of its last use in a slot: LRU order across processes

    def __post_init__(self) -> None:
        if self.settled < 0:
            object.__setattr__(self, "settled", len(self.tokens))

    @property
    def n_tokens(self) -> int:
        """KV positions the entry holds."""
        return len(self.tokens)


@dataclass(eq=False)
class ParkedEntry:
    """Everything needed to put a conversation back into a slot exactly as it was parked.

    ``state`` is the sequence's whole state (``llama_state_seq_get_data``); ``checkpoints``
    are ``(pos, partial state)`` pairs, or a :class:`~nbkv.kv.slot_kv.CheckpointSet`.
    ``nbytes`` is computed from the buffers; ``key`` is given by the
    :class:`~nbkv.store.parking.ParkingLot` when the entry is parked; ``settled`` and ``exact_len``
    default to every token (only proven KV is parked).
    """

    session: str | None
    tokens: Sequence[Any]
    hashes: Sequence[str]
    msg_ends: Sequence[int]
    state: Any
    checkpoints: Any = ()
    segments: Sequence[Segment] = ()
    settled: int | None = None
    exact_len: int | None = None
    last_request: int | None = None
    last_used: int = 0
    key: str = ""
    used_at: float = 0.0  # wall clock (time.time()) of its last use in a slot
    nbytes: int = field(default=0, init=False)
    tier: str = field(default=RAM, init=False)  # where it was when taken back

    def __post_init__(self) -> None:
        cps = self.checkpoints
        if isinstance(getattr(cps, "items", None), list):  # a CheckpointSet
            cps = [(c.pos, c.data) for c in cps.items]
        self.checkpoints = tuple((int(pos), data) for pos, data in cps)
        self.tokens = tuple(self.tokens)
        self.hashes = tuple(self.hashes)
        self.msg_ends = tuple(int(e) for e in self.msg_ends)
        self.segments = tuple(self.segments)
        n = len(self.tokens)
        self.exact_len = n if self.exact_len is None else self.exact_len
        self.settled = self.exact_len if self.settled is None else self.settled
        if not 0 <= self.settled <= self.exact_len <= n:
            raise ValueError(f"parked entry: settled {self.settled} <= exact_len "
                             f"{self.exact_len} <= {n} tokens does not hold")
        if len(self.hashes) != len(self.msg_ends) or any(not 0 < e <= n for e in self.msg_ends):
            raise ValueError("parked entry: message hashes and boundaries disagree")
        if any(not 0 < pos <= n for pos, _ in self.checkpoints):
            raise ValueError("parked entry: a checkpoint lies outside its tokens")
        self.nbytes = nbytes(self.state) + sum(nbytes(d) for _, d in self.checkpoints)

    @classmethod
    def from_snapshot(cls, snap: Any, *, session: str | None, hashes: Sequence[str],
                      msg_ends: Sequence[int], segments: Sequence[Segment] = (),
                      last_request: int | None = None, last_used: int = 0,
                      used_at: float = 0.0) -> ParkedEntry:
        """An entry from a :class:`~nbkv.kv.slot_kv.KVSnapshot` and the slot's bookkeeping."""
        return cls(session, snap.tokens, hashes, msg_ends, snap.state, snap.checkpoints,
                   segments, snap.settled, snap.exact_len, last_request, last_used,
                   used_at=used_at)

    def info(self, tier: str) -> ParkedInfo:
        """The light view of this entry, in ``tier``."""
        return ParkedInfo(self.key, self.session, tuple(self.tokens), tuple(self.hashes),
                          tuple(self.msg_ends), self.last_used, self.nbytes, tier,
                          self.settled or 0, tuple(pos for pos, _ in self.checkpoints),
                          self.used_at)


# -- the save format -----------------------------------------------------------------------


def entry_json(e: ParkedEntry, blobs: Blobs) -> dict[str, Any]:
    """An entry as JSON, its state and checkpoints added to ``blobs`` (by content name).

    The one codec of a conversation's record: a save writes its slots with it too (a slot
    adds its ``index``), and :func:`entry_from_json` reads both back.
    """
    return {
        "key": e.key, "session": e.session, "tokens": encode_units(e.tokens),
        "n_tokens": len(e.tokens), "hashes": list(e.hashes), "msg_ends": list(e.msg_ends),
        "segments": [segment_json(g) for g in e.segments], "settled": e.settled,
        "exact_len": e.exact_len, "last_request": e.last_request, "last_used": e.last_used,
        "used_at": e.used_at, "nbytes": e.nbytes, "state": blobs.add(e.state),
        "checkpoints": [{"pos": pos, "blob": blobs.add(d)} for pos, d in e.checkpoints],
    }


def _fields(d: Any, n_vocab: int, used_at: float = 0.0) -> dict[str, Any]:
    """The checked non-buffer fields of :func:`entry_json`'s output.

    A saved slot of an older save has no ``key`` or ``last_request``; saves of nbkv 0.1 lack
    ``used_at`` (``used_at`` is the default) and ``exact_len`` (every token was rewritten).
    """
    if not isinstance(d, dict):
        raise RestoreError(f"a parked entry is not an object: {d!r:.80}")
    try:
        tokens = decode_units(d["tokens"], n_vocab)
        session, req = d["session"], d.get("last_request")
        out = {
            "key": str(d.get("key", "")), "session": None if session is None else str(session),
            "tokens": tokens, "hashes": [str(h) for h in d["hashes"]],
            "msg_ends": [int(x) for x in d["msg_ends"]],
            "segments": tuple(segment_from_json(g) for g in d["segments"]),
            "settled": int(d["settled"]), "exact_len": int(d.get("exact_len", len(tokens))),
            "last_request": None if req is None else int(req),
            "last_used": int(d["last_used"]),
            "used_at": float(d.get("used_at", used_at)),
        }
        if int(d["n_tokens"]) != len(tokens):
            raise RestoreError(f"parked entry {out['key']}: {len(tokens)} tokens, its record "
                               f"says {d['n_tokens']}")
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(f"malformed parked entry: {type(e).__name__}: {e}") from e
    return out


def info_from_json(d: Any, n_vocab: int, tier: str) -> ParkedInfo:
    """The :class:`ParkedInfo` of a JSON entry, without reading its buffers."""
    f = _fields(d, n_vocab)
    try:
        size = int(d["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(f"parked entry {f['key']}: malformed size") from e
    try:
        cps = tuple(int(c["pos"]) for c in d["checkpoints"])
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(f"parked entry {f['key']}: malformed checkpoints") from e
    return ParkedInfo(f["key"], f["session"], tuple(f["tokens"]), tuple(f["hashes"]),
                      tuple(f["msg_ends"]), f["last_used"], size, tier,
                      min(f["settled"], len(f["tokens"])), cps, f["used_at"])


def entry_from_json(d: Any, read: Callable[[str], Any], n_vocab: int,
                    state: Callable[[str], Any] | None = None,
                    used_at: float = 0.0) -> ParkedEntry:
    """Inverse of :func:`entry_json`: ``read(name)`` returns a blob's checked bytes.

    ``state`` reads the whole-sequence state instead, when it needs converting (for example
    :func:`nbkv.store.persist.restream` into another number of slots). ``used_at`` stands in
    where the record has none. Raises :class:`~nbkv.core.errors.RestoreError` on anything
    malformed or inconsistent (the entry's own checks: settled <= exact_len <= tokens,
    boundaries and checkpoints inside its tokens).
    """
    f = _fields(d, n_vocab, used_at)
    try:
        cps = [(int(c["pos"]), read(c["blob"])) for c in d["checkpoints"]]
        buf = (state or read)(d["state"])
        entry = ParkedEntry(f["session"], f["tokens"], f["hashes"], f["msg_ends"], buf, cps,
                            f["segments"], f["settled"], f["exact_len"], f["last_request"],
                            f["last_used"], f["key"], f["used_at"])
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(f"parked entry {f['key']}: {e}") from e
    if state is None and entry.nbytes != d.get("nbytes"):
        raise RestoreError(f"parked entry {f['key']}: {entry.nbytes} bytes, its record says "
                           f"{d.get('nbytes')}")
    return entry
