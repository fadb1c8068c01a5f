"""A parked conversation: what a slot held when it was taken, and its save-format JSON.

When a request takes a slot from another conversation, the engine parks that conversation
(:class:`ParkedEntry`) instead of losing it: the whole sequence state, its checkpoints on
hybrid and recurrent memory, and the bookkeeping that lets the policy match a later prompt
against it. :class:`ParkedInfo` is the light view of one (no buffers) that the policy and
the views read. States are opaque buffers here (bytes, ctypes arrays): no model needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nbkv.core.errors import RestoreError
from nbkv.core.events import Segment
from nbkv.kv.slot_table import Conversation, HoldsConversation
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
class ParkedInfo(HoldsConversation):
    """One parked conversation as the policy and the views see it (no state buffers)."""

    key: str
    conversation: Conversation
    nbytes: int  # its state and checkpoints
    tier: str  # RAM or DISK
    #: an unnamed conversation (an edit's old branch): the session whose branch it was
    branch_of: str | None = None

    @property
    def checkpoints(self) -> tuple[int, ...]:
        """Positions of its checkpoints."""
        return tuple(self.conversation.checkpoints)


class ParkedEntry(HoldsConversation):
    """Everything needed to put a conversation back into a slot exactly as it was parked.

    ``state`` is the sequence's whole state (``llama_state_seq_get_data``); ``checkpoints``
    are ``(pos, partial state)`` pairs, or a :class:`~nbkv.kv.slot_kv.CheckpointSet`.
    ``nbytes`` is computed from the buffers; ``key`` is given by the
    :class:`~nbkv.store.parking.ParkingLot` when the entry is parked; ``settled`` and ``exact_len``
    default to every token (only proven KV is parked). The conversation's bookkeeping is its
    :class:`~nbkv.kv.slot_table.Conversation` (``conversation``; its fields read through).
    """

    def __init__(self, session: str | None, tokens: Sequence[Any], hashes: Sequence[str],
                 msg_ends: Sequence[int], state: Any, checkpoints: Any = (),
                 segments: Sequence[Segment] = (), settled: int | None = None,
                 exact_len: int | None = None, last_request: int | None = None,
                 last_used: int = 0, key: str = "", used_at: float = 0.0,
                 branch_of: str | None = None) -> None:
        cps = checkpoints
        if isinstance(getattr(cps, "items", None), list):  # a CheckpointSet
            cps = [(c.pos, c.data) for c in cps.items]
        self.checkpoints: tuple[tuple[int, Any], ...] = tuple(
            (int(pos), data) for pos, data in cps)
        n = len(tokens)
        self.exact_len: int = n if exact_len is None else exact_len
        settled = self.exact_len if settled is None else settled
        if not 0 <= settled <= self.exact_len <= n:
            raise ValueError(f"parked entry: settled {settled} <= exact_len "
                             f"{self.exact_len} <= {n} tokens does not hold")
        if len(hashes) != len(msg_ends):  # (a parked conversation knows every message)
            raise ValueError("parked entry: message hashes and boundaries disagree")
        try:
            self.conversation = Conversation(
                session, tokens, hashes, msg_ends, segments, last_used, last_request, used_at,
                settled, tuple(pos for pos, _ in self.checkpoints))
        except ValueError as e:
            raise ValueError(f"parked entry: {e}") from None
        self.state = state
        self.key = key
        #: an unnamed conversation (``session`` None): the session whose earlier branch it was
        self.branch_of = branch_of
        self.nbytes = nbytes(self.state) + sum(nbytes(d) for _, d in self.checkpoints)
        self.tier = RAM  # where it was when taken back

    def __repr__(self) -> str:
        return (f"ParkedEntry(key={self.key!r}, session={self.session!r}, "
                f"{self.conversation.n_tokens} tokens, {self.nbytes} bytes, {self.tier})")

    @classmethod
    def from_snapshot(cls, snap: Any, *, session: str | None, hashes: Sequence[str],
                      msg_ends: Sequence[int], segments: Sequence[Segment] = (),
                      last_request: int | None = None, last_used: int = 0,
                      used_at: float = 0.0, branch_of: str | None = None) -> ParkedEntry:
        """An entry from a :class:`~nbkv.kv.slot_kv.KVSnapshot` and the slot's bookkeeping."""
        return cls(session, snap.tokens, hashes, msg_ends, snap.state, snap.checkpoints,
                   segments, snap.settled, snap.exact_len, last_request, last_used,
                   used_at=used_at, branch_of=branch_of)

    def info(self, tier: str) -> ParkedInfo:
        """The light view of this entry, in ``tier``."""
        return ParkedInfo(self.key, self.conversation, self.nbytes, tier, self.branch_of)


# -- the save format -----------------------------------------------------------------------


def entry_json(e: ParkedEntry, blobs: Blobs) -> dict[str, Any]:
    """An entry as JSON, its state and checkpoints added to ``blobs`` (by content name).

    The one codec of a conversation's record: a save writes its slots with it too (a slot
    adds its ``index``), and :func:`entry_from_json` reads both back.
    """
    c = e.conversation
    return {
        "key": e.key, "session": c.session, "tokens": encode_units(c.tokens),
        "n_tokens": len(c.tokens), "hashes": list(c.hashes), "msg_ends": list(c.msg_ends),
        "segments": [segment_json(g) for g in c.segments], "settled": c.settled,
        "exact_len": e.exact_len, "last_request": c.last_request, "last_used": c.last_used,
        "used_at": c.used_at, "nbytes": e.nbytes, "state": blobs.add(e.state),
        "checkpoints": [{"pos": pos, "blob": blobs.add(d)} for pos, d in e.checkpoints],
        # an unnamed branch's session (written only then: the format of the rest is as it was)
        **({"branch_of": e.branch_of} if e.branch_of is not None else {}),
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
            # saves before unnamed branches were named have none
            "branch_of": None if d.get("branch_of") is None else str(d["branch_of"]),
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
        cps = tuple(int(c["pos"]) for c in d["checkpoints"])
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(f"parked entry {f['key']}: malformed size or checkpoints") from e
    key, branch_of = f.pop("key"), f.pop("branch_of")
    f.pop("exact_len")
    f["settled"] = min(f["settled"], len(f["tokens"]))
    try:
        conv = Conversation(**f, checkpoints=cps)
    except ValueError as e:
        raise RestoreError(f"parked entry {key}: {e}") from e
    return ParkedInfo(key, conv, size, tier, branch_of)


def entry_from_json(d: Any, read: Callable[[str], Any], n_vocab: int,
                    state: Callable[[str], Any] | None = None,
                    used_at: float = 0.0) -> ParkedEntry:
    """Inverse of :func:`entry_json`: ``read(name)`` returns a blob's checked bytes.

    ``state`` reads the whole-sequence state instead, when it needs converting (for example
    :func:`nbkv.store.save_checks.restream` into another number of slots). ``used_at`` stands
    in where the record has none. Raises :class:`~nbkv.core.errors.RestoreError` on anything
    malformed or inconsistent (the entry's own checks: settled <= exact_len <= tokens,
    boundaries and checkpoints inside its tokens).
    """
    f = _fields(d, n_vocab, used_at)
    try:
        cps = [(int(c["pos"]), read(c["blob"])) for c in d["checkpoints"]]
        entry = ParkedEntry(**f, state=(state or read)(d["state"]), checkpoints=cps)
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(f"parked entry {f['key']}: {e}") from e
    if state is None and entry.nbytes != d.get("nbytes"):
        raise RestoreError(f"parked entry {f['key']}: {entry.nbytes} bytes, its record says "
                           f"{d.get('nbytes')}")
    return entry
