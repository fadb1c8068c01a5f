"""Which conversation sits in which slot, and the trail that explains it: shared by engines.

A conversation's bookkeeping is one record, :class:`Conversation` (whose conversation, the
units its KV holds, where each message ends and its hash, the KV map's segments, the LRU
clocks, how much of the KV is canonical), with its own checks: every holder of its KV (a
slot's :class:`SlotState`, a parked entry, a save) carries it and adds only what is its own.

The in-kernel :class:`~nbkv.Engine` and :class:`~nbkv.remote.LlamaServerEngine` keep
the same bookkeeping per slot (session, message hashes, where each message ends, LRU clock)
and make the same decisions with it: placement through :mod:`nbkv.kv.policy`, the own-slot
choice, the eviction and clear trail that :mod:`nbkv.kv.admission` reads, the comparisons kept
for ``explain``, the hashes a slot holds after a reply, and the fields every request record
starts with. They differ only in what holds the KV (a llama.cpp sequence, or a server slot),
which their slot subclasses add.

Every method that changes a slot takes the table's lock (the engine's condition variable),
so :meth:`SlotTable.snapshots` never sees half an update.

A slot's KV map is built here too (:func:`prompt_segments`, :func:`message_segments`): which
positions hold which message, reused, prefilled or generated; presentation data the records
carry for the views, built by both engines from a prompt and one request's counts.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from nbkv.core.errors import InvalidRequestError, NbkvError
from nbkv.core.events import GENERATED, PREFILLED, REUSED, RequestRecord, Segment
from nbkv.core.messages import prefix_hashes, preview
from nbkv.kv import admission, policy
from nbkv.media.units import MediaUnit, spans
from nbkv.prompt.builder import Prompt


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


@dataclass(frozen=True)
class SlotInfo(HoldsConversation):
    """An immutable snapshot of one slot: its conversation, and what holds its KV.

    ``conversation`` is the slot's bookkeeping (:class:`~nbkv.kv.slot_table.Conversation`,
    built with :meth:`~nbkv.kv.slot_table.Conversation.held`); its fields read through.
    """

    index: int
    seq_id: int
    capacity: int
    conversation: Conversation
    pending: bool
    checkpoint_bytes: int = 0
    memory: str = "plain"  # the model's memory class (nbkv.kv.slot_kv)
    rewriting: int = 0  # trailing positions out of the KV while a reply's KV is rewritten
    cut_floor: int = 0  # the lowest position its KV can be cut to without a checkpoint
    #: remote engines: False when the server's slot differs from what nbkv expects
    verified: bool = True
    note: str = ""  # why not verified
    #: OpenAI-compatible servers (a row per session): leading positions the server's prefix
    #: cache holds now, from its KV cache events (None: not followed)
    server_cached: int | None = None

    @property
    def checkpoints(self) -> tuple[int, ...]:
        """Positions with a checkpoint (hybrid/recurrent models)."""
        return tuple(self.conversation.checkpoints)

    @property
    def n_messages(self) -> int:
        """Messages cached (the model's last reply included)."""
        return len(self.conversation.hashes)

    @property
    def empty(self) -> bool:
        """True when the slot holds nothing."""
        return not self.conversation.tokens

    @property
    def n_media(self) -> int:
        """Image chunks held in the slot's KV."""
        return sum(1 for u in self.conversation.tokens
                   if isinstance(u, MediaUnit) and u.offset == 0)


@dataclass
class TableSlot:
    """What the cache knows of one slot; subclasses add what holds its KV."""

    index: int
    capacity: int
    session: str | None = None
    hashes: list[str] = field(default_factory=list)
    msg_ends: list[int] = field(default_factory=list)
    last_used: int = 0
    pending: bool = False
    segments: tuple[Segment, ...] = ()
    last_request: int | None = None
    used_at: float = 0.0  # wall clock of the last use (parked entries keep it: LRU order)

    @property
    def tokens(self) -> Sequence[Any]:
        """What the slot's KV holds, one unit per position."""
        raise NotImplementedError

    def snapshot(self) -> SlotInfo:
        """An immutable copy for the caller's thread."""
        raise NotImplementedError

    def conversation(self, tokens: Sequence[Any] | None = None, settled: int = -1,
                     checkpoints: Sequence[int] = ()) -> Conversation:
        """The slot's bookkeeping as a record, over ``tokens`` (default: what its KV holds)."""
        return Conversation.held(self.session, self.tokens if tokens is None else tokens,
                                 self.hashes, self.msg_ends, self.segments, self.last_used,
                                 self.last_request, self.used_at, settled, checkpoints)

    def forget_messages(self) -> None:
        """Drop the message bookkeeping (the holder of the KV empties itself)."""
        self.session = None
        self.hashes = []
        self.msg_ends = []
        self.segments = ()


@dataclass(frozen=True)
class SlotState(HoldsConversation):
    """One slot's conversation as a save, a park or a restore carries it.

    ``conversation`` is its bookkeeping (:class:`~nbkv.kv.slot_table.Conversation`; its
    fields read through); ``kv`` is what holds its KV (a :class:`~nbkv.kv.slot_kv.KVSnapshot`
    in the kernel; the token list for a server slot, whose KV the server saves itself; None
    where only the bookkeeping is carried).
    """

    index: int
    conversation: Conversation
    kv: Any


@dataclass(frozen=True)
class EngineState:
    """Every idle slot (``SlotState.kv`` a :class:`KVSnapshot`), busy slots, SPC entries."""

    slots: tuple[SlotState, ...]
    busy: tuple[int, ...]
    spc: tuple[tuple[str, Any], ...]  # (system prompt hash, nbkv.kv.spc.SavedPrompt)


S = TypeVar("S", bound=TableSlot)


class SlotTable(Generic[S]):
    """The slots of one engine and the bookkeeping both engines share."""

    def __init__(self, slots: Sequence[S], lock: threading.Condition) -> None:
        self.slots: list[S] = list(slots)
        self.lock = lock
        self.clock = itertools.count(1)
        #: per session: where its conversation went (for reasons)
        self.whereabouts: dict[str, admission.Whereabouts] = {}
        #: request id -> (cached units, prompt units), for explain()
        self.compared: OrderedDict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[S]:
        return iter(self.slots)

    def __getitem__(self, index: int) -> S:
        return self.slots[index]

    def index(self, slot: Any) -> int:
        """``slot`` if it names a slot, else :class:`InvalidRequestError`."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not (
                0 <= slot < len(self.slots)):
            raise InvalidRequestError(f"no slot {slot!r}: slots are 0..{len(self.slots) - 1}")
        return slot

    def snapshots(self) -> tuple[SlotInfo, ...]:
        """An immutable snapshot of every slot."""
        with self.lock:
            return tuple(s.snapshot() for s in self.slots)

    def tick(self) -> int:
        """The next value of the LRU clock."""
        return next(self.clock)

    # ------------------------------------------------------------------ placement

    def place(self, snaps: Sequence[SlotInfo], prompt: Prompt, session: str | None, *,
              cache: str, min_tokens: int, copies: bool = True,
              parked: Sequence[policy.ParkedLike] = (), judge: policy.Judge | None = None
              ) -> policy.Plan | None:
        """Where ``prompt`` goes and what of the slot's KV it keeps; None when all are busy.

        ``cache="imc"`` asks :func:`nbkv.kv.policy.select`; other modes take a free slot and
        reuse nothing of it. ``copies=False`` (a server cannot copy a prefix between slots)
        turns a donor copy into a rebuild in the target slot, keeping what it shares.
        ``parked`` conversations are candidates too (:mod:`nbkv.store.parking`); ``judge``
        says what each candidate really serves (:class:`nbkv.kv.policy.Judge`).
        """
        if cache != "imc":
            target = policy.pick_free(snaps, session)
            if target is None:
                return None
            taken = bool(target.tokens) and target.session != session
            return policy.Plan(cache, target.index, 0,
                               evicted=target.session if taken else None,
                               evicted_tokens=len(target.tokens) if taken else 0)
        plan = policy.select(snaps, prompt.tokens, prompt.hashes, session, min_tokens,
                             parked=parked, judge=judge)
        if plan is not None and plan.donor is not None and not copies:
            t = snaps[plan.slot]
            reuse = min(policy.common_prefix(t.tokens, prompt.tokens),
                        policy.reuse_limit(len(prompt.tokens)))
            plan = policy.Plan(policy.MISS, t.index, reuse,
                               evicted=t.session if t.tokens else None,
                               evicted_tokens=len(t.tokens) - reuse if t.tokens else 0)
        return plan

    @staticmethod
    def own(snaps: Iterable[SlotInfo], session: str | None) -> SlotInfo | None:
        """The slot that last served ``session``'s conversation, if it still holds any."""
        if session is None:
            return None
        return max((s for s in snaps if s.session == session and s.tokens),
                   key=lambda s: s.last_used, default=None)

    def reason(self, request: int, prompt: Prompt, session: str | None,
               own: SlotInfo | None, source: Sequence[Any], *, reuse: int, wanted: int,
               donor_session: str | None = None, can_trim: bool = True,
               cache: str = "imc", restored: admission.Restored | None = None,
               kept_from: str | None = None, still_parked: bool = False) -> admission.Reason:
        """Why ``request`` reuses ``reuse`` positions; keeps the comparison for explain()."""
        story = admission.Story(
            session, prompt.tokens, prompt.hashes, prompt.ends,
            [m["role"] for m in prompt.messages], prompt.dropped,
            self.whereabouts.get(session) if session is not None else None,
            admission.Cached(own.tokens, own.hashes, own.msg_ends) if own is not None else None,
            cache, kept_from, still_parked)
        why = admission.words(admission.decide(story, reuse=reuse, wanted=wanted,
                                             donor_session=donor_session, can_trim=can_trim,
                                             restored=restored))
        if restored is not None:
            source = restored.cached.tokens
        self.compare(request, own.tokens if own is not None else source, prompt.tokens)
        return why

    def compare(self, request: int, cached: Sequence[Any], new: Sequence[Any]) -> None:
        """Keep what ``request``'s prompt was compared with, for explain()."""
        self.compared[request] = (tuple(cached), tuple(new))
        while len(self.compared) > admission.EXPLAINED:
            self.compared.popitem(last=False)

    def explain(self, history: Sequence[RequestRecord], text_of: Callable[[Sequence[Any]], str],
                request: int | None) -> admission.Explanation:
        """The full story of ``request`` (default: the latest)."""
        return admission.explain_request(history, self.compared, text_of, request)

    def claim(self, slot: S, request: int, session: str | None, prompt: Prompt, reuse: int,
              evicted: str | None, parked: bool = False,
              keep: tuple[Sequence[str], Sequence[int]] | None = None) -> None:
        """``slot`` now serves ``request``: its kept messages, the clock and the trail.

        ``parked``: the conversation ``evicted`` from the slot was parked, not lost.
        ``keep``: the slot keeps every message it holds (a replay cuts nothing), whose
        hashes and ends these are.
        """
        with self.lock:
            if evicted is not None and evicted != session:
                self.whereabouts[evicted] = admission.Whereabouts(
                    self.whereabouts.get(evicted, admission.Whereabouts(0)).request,
                    admission.PARKED if parked else admission.EVICTED, session, request,
                    slot.index, slot.hashes[0] if slot.hashes else None)
            if session is not None:
                self.whereabouts[session] = admission.Whereabouts(request)
            slot.session = session
            if keep is not None:
                slot.hashes, slot.msg_ends = list(keep[0]), list(keep[1])
            else:
                slot.hashes = [h for h, e in zip(prompt.hashes, prompt.ends) if e <= reuse]
                slot.msg_ends = list(prompt.ends[: len(slot.hashes)])
            slot.last_used = self.tick()
            slot.used_at = time.time()
            slot.last_request = request

    def replied(self, slot: S, prompt: Prompt, reply: str, n: int) -> None:
        """``slot`` holds ``n`` positions of ``prompt`` and its reply: its messages then.

        Once the prompt is in the KV, so is the reply's start: its hash counts (a reply that
        re-tokenizes differently next turn is what :func:`nbkv.kv.policy.select` allows for).
        """
        full = [h for h, e in zip(prompt.hashes, prompt.ends) if e <= n]
        if n >= len(prompt.tokens):
            slot.hashes = prefix_hashes(
                [*prompt.messages, {"role": "assistant", "content": reply}], full)
            slot.msg_ends = [*prompt.ends, len(prompt.tokens)]
        else:
            slot.hashes, slot.msg_ends = full, list(prompt.ends[: len(full)])
        slot.last_used = self.tick()
        slot.used_at = time.time()

    def cleared(self, slots: Iterable[S], fate: str = admission.CLEARED) -> None:
        """Note that the conversations in ``slots`` were cleared (lock held).

        By the user, or (``fate=PROVEN``) when the engine's exactness was proven.
        """
        for s in slots:
            if s.session is not None and s.tokens:
                self.whereabouts[s.session] = admission.Whereabouts(s.last_request or 0, fate)

    def clear_targets(self, slot: int | None) -> list[S]:
        """The slots ``clear(slot)`` empties (lock held): one named slot must be idle."""
        if slot is not None:
            s = self.slots[self.index(slot)]
            if s.pending:
                raise NbkvError(f"slot {slot} is serving a request; cancel it first")
            return [s]
        return [s for s in self.slots if not s.pending]

    def carry_over(self, sessions: Iterable[str]) -> None:
        """Sessions another engine held before this one replaced it."""
        for name in sessions:
            self.whereabouts.setdefault(name, admission.Whereabouts(0, admission.RELOADED))

    # ------------------------------------------------------------------ state

    def state_of(self, slot: S, kv: Any) -> SlotState:
        """``slot``'s bookkeeping with ``kv``, for a save or a park."""
        return SlotState(slot.index, slot.conversation(), kv)

    def adopt(self, slot: S, state: SlotState) -> None:
        """Give ``slot`` the bookkeeping of ``state`` (its KV is already in place)."""
        with self.lock:
            slot.session = state.session
            slot.hashes = list(state.hashes)
            slot.msg_ends = list(state.msg_ends)
            slot.segments = tuple(state.segments)
            slot.last_used = self.tick()
            slot.used_at = state.used_at or time.time()
            slot.last_request = None

    # ------------------------------------------------------------------ records

    def record(self, request: int, session: str | None, prompt: Prompt, slot: S,
               plan: policy.Plan, reuse: int, why: admission.Reason, **fields: Any
               ) -> RequestRecord:
        """A request's record as it starts: what every engine says of it."""
        return RequestRecord(
            id=request, session=session, strategy=plan.strategy, slot=slot.index,
            prompt_tokens=len(prompt.tokens), reused_tokens=reuse,
            evicted_session=plan.evicted, evicted_tokens=plan.evicted_tokens,
            matched_messages=plan.matched_messages, dropped_messages=prompt.dropped,
            capacity=slot.capacity, started_at=time.time(),
            media_reused=sum(1 for u in prompt.tokens[:reuse]
                             if isinstance(u, MediaUnit) and u.offset == 0),
            reason=why.code, reason_text=why.text, divergence=why.divergence, **fields)


# -- a slot's KV map (see the module docstring) ---------------------------------------------

#: a message's preview by its prefix hash (:func:`nbkv.core.messages.prefix_hashes`): a
#: conversation's messages are previewed again at every turn, twice
_PREVIEWS: dict[str, str] = {}
_PREVIEWS_MAX = 4096


def _preview(message: Mapping[str, Any], key: str | None) -> str:
    if key is None:
        return preview(message)
    text = _PREVIEWS.get(key)
    if text is None:
        if len(_PREVIEWS) >= _PREVIEWS_MAX:
            _PREVIEWS.clear()
        text = _PREVIEWS[key] = preview(message)
    return text


def message_segments(messages: Sequence[Mapping[str, Any]], ends: Sequence[int],
                     n_prompt: int, reuse: int, n: int, reply: str,
                     keys: Sequence[str] = ()) -> tuple[Segment, ...]:
    """A slot's KV map: a span per message and the reply, split by reused/prefilled/generated.

    The prompt has ``n_prompt`` positions, the first ``reuse`` from cache; the slot holds ``n``
    (the reply's after the prompt). Text only: the engine splits image positions out itself.
    ``keys``: the messages' prefix hashes, where known (their previews are kept by them).
    """
    spans, start = [], 0
    for i, end in enumerate(ends):
        key = keys[i] if i < len(keys) else None
        spans.append((start, end, i, messages[i]["role"], _preview(messages[i], key)))
        start = end
    k = len(messages)
    said = preview({"content": reply})
    # the reply's message begins with the generation prompt: its span says the reply too
    # (the views merge the two into one message), until there is none yet
    spans.append((start, n_prompt, k, "assistant", said or "(generation prompt)"))
    spans.append((n_prompt, max(n, n_prompt), k, "assistant", said))
    out = []
    for a, b, i, role, text in spans:
        for lo, hi, state in ((a, min(b, reuse), REUSED),
                              (max(a, reuse), min(b, n_prompt), PREFILLED),
                              (max(a, n_prompt), b, GENERATED)):
            if hi > lo:
                out.append(Segment(lo, hi, i, role, state, text))
    return tuple(out)


def prompt_segments(p: Prompt, reuse: int, n: int, reply: str, marker: str = "\0"
                    ) -> tuple[Segment, ...]:
    """:func:`message_segments` of a prompt, with its image positions split out.

    ``marker`` is the projector's image placeholder text, shown as ``[image]`` in previews.
    """
    out = message_segments(p.messages, p.ends, len(p.tokens), reuse, n, reply, p.hashes)
    if p.media is None:  # a prompt holds image positions only with its media (nbkv.prompt)
        return out
    runs = [(s.start, s.end, s.image_hash, s.n_tokens)
            for s in spans(p.tokens) if s.kind == "image"]
    if not runs:
        return out
    names = {im.hash: Path(im.source).name for im in (p.media.images if p.media else ())
             if im.source and not im.source.startswith("data:")}
    split = []
    for seg in out:
        seg = replace(seg, preview=seg.preview.replace(marker, "[image]"))
        pos = seg.start
        for a, b, h, n_emb in runs:
            lo, hi = max(a, seg.start), min(b, seg.end)
            if hi <= lo:
                continue
            if lo > pos:
                split.append(replace(seg, start=pos, end=lo))
            split.append(replace(seg, start=lo, end=hi, kind="image", image_hash=h,
                                 image_name=names.get(h or "", ""), embeddings=n_emb))
            pos = hi
        if pos < seg.end:
            split.append(replace(seg, start=pos, end=seg.end))
    return tuple(split)
