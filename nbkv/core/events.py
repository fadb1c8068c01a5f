"""What the engine reports: one record per request, progress while it runs, and a subscriber list.

User interfaces (the notebook widgets, the demo, the benchmark) are built only on these.
Subscribers are called on the engine's scheduler thread; they must be quick, and an
exception in one is logged, never raised into the engine.

The codes records carry are here too (how a slot was found, why a request reused, where it
was parked; their words, colours and patterns live in :mod:`nbkv.ui`), and
:func:`common_prefix`, the one longest-common-prefix function every layer matches with.

So is the engine's fixed cost, counted: decode calls, rows computed, host time, bytes moved
(:class:`KVCounters`, kept by the llama.cpp context; :class:`RequestCounts`, one request's
share). Counts, never timings, are what tests assert; the bench reports the times.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Union

# how the policy found the slot (``record.strategy``)
HASH_HIT = "hash-hit"
HASH_EXTEND = "hash-extend"
PREFIX_SALVAGE = "prefix-salvage"
MISS = "miss"

# why a request reused what it reused (``record.reason``)
FIRST = "first"  # the session's first request: nothing of it was cached
CONTINUED = "continued"  # the conversation grew: everything cached was reused
COPIED = "copied"  # a prefix was copied from another conversation's slot
#: a new conversation got a slot whose conversation shares its start: those tokens were kept
#: in place (no copy ran)
SHARED = "shared"
RELOADED = "reloaded"  # the engine was loaded again since the session's last request
EVICTED = "evicted"  # another session's request took this session's slot
CLEARED = "cleared"  # the user cleared the slot
#: the engine proved its exactness in the background and dropped what it had cached before
PROVEN = "proven"
EDITED = "edited"  # an earlier message changed
SYSTEM_CHANGED = "system-changed"  # the system prompt changed
TEMPLATE_DRIFT = "template-drift"  # the same messages rendered to different tokens
IMAGE_CHANGED = "image-changed"  # a different image at the same place
OVERFLOW = "overflow"  # the oldest messages were dropped to fit the slot
CHECKPOINT = "checkpoint"  # memory that cannot be cut: restored a checkpoint before the cut
UNCACHED = "uncached"  # cache mode spc/off: conversations are not kept
RESTORED = "restored"  # a parked conversation was put back into a slot
REPLAYED = "replayed"  # the same prompt and settings: the cached reply was given again

#: the codes of ``record.reason``; their words are in :data:`nbkv.ui.vocabulary.EVENTS`
REASONS = (FIRST, CONTINUED, COPIED, SHARED, RELOADED, EVICTED, CLEARED, PROVEN, EDITED,
           SYSTEM_CHANGED, TEMPLATE_DRIFT, IMAGE_CHANGED, OVERFLOW, CHECKPOINT, UNCACHED,
           RESTORED, REPLAYED)
#: a conversation's fate (not a reason): its slot was taken and it was parked
PARKED = "parked"

#: where a conversation was parked (``record.restored_from``, ``evicted_parked``), in the
#: words every surface uses (:data:`nbkv.ui.vocabulary.PARKING` takes them from here)
TIERS = {"ram": "RAM", "disk": "disk", "server-ram": "the server's RAM"}


def counted(n: int, word: str, many: str = "") -> str:
    """``1 message``, ``3 messages``: a count and its noun, never ``message(s)``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def tier_words(tier: str) -> str:
    """``RAM`` or ``disk``: where a conversation was parked."""
    return TIERS.get(tier, tier)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (C-speed slice compares).

    The one such function: token lists, hash lists and strings (template renderings) alike.
    """
    if not (isinstance(a, (str, tuple)) and type(a) is type(b)):
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


log = logging.getLogger("nbkv.core.events")

REUSED, PREFILLED, GENERATED = "reused", "prefilled", "generated"
#: positions a slot holds beyond what its latest request touched (a replay keeps later turns)
KEPT = "kept"
WINDOW = 12  # units kept on each side of a divergence, for its excerpts


@dataclass(frozen=True)
class Divergence:
    """Where the new prompt first differs from the best cached candidate.

    ``position`` is the first KV position that differs; ``message`` the index (and ``role``)
    of the new prompt's message holding it; ``cached`` and ``new`` are the units around it
    (``WINDOW`` before it, up to ``WINDOW`` from it), token ids or image units.
    """

    position: int
    message: int
    role: str
    cached: tuple[Any, ...]
    new: tuple[Any, ...]
    start: int  # position of cached[0] and new[0]

    def excerpts(self, detokenize: Callable[[Sequence[Any]], str]) -> tuple[str, str]:
        """``("…Tuesday 21 Nov…", "…Wednesday 22 Nov…")``: both sides, as text."""
        k = self.position - self.start

        def side(units: tuple[Any, ...]) -> str:
            before, after = detokenize(units[:k]), detokenize(units[k:])
            return "…" + " ".join(before.split())[-40:] + "⟨" + " ".join(after.split())[:40] + "…"

        return side(self.cached), side(self.new)

    def describe(self, detokenize: Callable[[Sequence[Any]], str]) -> str:
        """``message 0 (system), token 41: cached "…" → new "…"``."""
        old, new = self.excerpts(detokenize)
        return (f"message {self.message} ({self.role}), token {self.position}: "
                f"cached {old!r} → new {new!r}")


@dataclass(frozen=True)
class Segment:
    """A run of KV positions ``[start, end)`` that belong to one message and share one state."""

    start: int
    end: int
    message: int  # index into the request's messages; len(messages) is the reply
    role: str
    state: str  # REUSED, PREFILLED or GENERATED (this request); KEPT: not touched by it
    preview: str = ""
    kind: str = "text"  # "text", or "image" for the positions an image's embeddings occupy
    image_hash: str | None = None
    image_name: str = ""  # the image's file name, when it came from a file
    #: image segments: embeddings the image fed the model; with M-RoPE (Qwen-VL) more than
    #: the KV positions it occupies (``length``)
    embeddings: int = 0

    @property
    def length(self) -> int:
        """Number of KV positions in the segment."""
        return self.end - self.start

    @property
    def is_media(self) -> bool:
        """True for the positions of an image (or other media) chunk."""
        return self.kind != "text"


@dataclass(frozen=True)
class RequestRecord:
    """Everything measured about one request."""

    id: int
    session: str | None
    strategy: str  # how the slot was found (policy): hash-hit, hash-extend, prefix-salvage,
    # miss, spc, off; what people read is the event (``reason``, nbkv.ui.vocabulary)
    slot: int
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    trimmed_tokens: int
    generated_tokens: int = 0
    donor_slot: int | None = None  # slot the reused prefix was copied from
    donor_session: str | None = None  # session whose conversation the donor slot held
    evicted_session: str | None = None
    evicted_tokens: int = 0
    matched_messages: int = 0
    reply_tokens_cached: int = 0  # tokens of the previous reply held in the slot
    reply_tokens_reused: int = 0  # previous reply's tokens reused (re-tokenized identically)
    dropped_messages: int = 0  # oldest messages dropped by overflow='slide'
    media_chunks: int = 0  # image chunks in the prompt
    media_reused: int = 0  # image chunks already in the slot's KV
    encoder_runs: int = 0  # images sent through the vision encoder by this request
    embedding_cache_hits: int = 0  # images decoded from cached embeddings instead
    draft_tokens: int = 0  # guessed next tokens decoded alongside (speculative, exact mode)
    draft_accepted: int = 0  # guesses the model confirmed: two tokens from one decode
    checkpoint_pos: int | None = None  # the checkpoint restored (hybrid/recurrent models)
    reprefilled_tokens: int = 0  # matched positions re-prefilled: the KV could not be cut there
    rewrite_absorbed: int = 0  # previous reply positions re-prefilled before their rewrite ran
    #: of this reply's positions, those rewritten as a batch while it was generated (mixed
    #: steps, exact mode): the next request finds them ready even with no idle time between
    rewrite_mixed: int = 0
    #: the reply is proven bit-identical to a from-scratch one (exact mode, and a prefill
    #: grouping calibrated as batch-invariant on this model and build)
    exact: bool = True
    exact_note: str = ""  # why not exact, when a remote engine knows (its figures line says)
    capacity: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    restore_s: float = 0.0  # SPC restore, prefix copy, or restore of a parked conversation
    # the first-token time in parts (ttft_parts): wait + restore + prefill_s
    wait_s: float = 0.0  # before reading began: template, tokens, a free slot, the step running
    rewrite_absorbed_s: float = 0.0  # of prefill_s: re-reading the previous reply's positions
    first_decode_s: float = 0.0  # of prefill_s: sampling the first token from the last logits
    finish_reason: str = ""  # stop, length, cancelled, error
    error: str | None = None
    segments: tuple[Segment, ...] = ()
    started_at: float = 0.0  # time.time() when the request was admitted
    reason: str = ""  # why it reused what it reused (a code of nbkv.kv.admission)
    reason_text: str = ""  # the reason in plain words
    divergence: Divergence | None = None  # where the prompt left the cached conversation
    #: False when a remote server's figures disagree with what nbkv expected of the slot
    verified: bool = True
    note: str = ""  # why not verified (or another remark of a remote engine)
    #: "ram" or "disk" when a parked conversation (nbkv.store.parking) was restored into the slot
    #: first (its time is in ``restore_s``), else ""
    restored_from: str = ""
    restored_tokens: int = 0  # tokens of the restored conversation the request reused
    restored_session: str | None = None  # session whose conversation was restored
    #: the restore of a parked conversation proper, within ``restore_s``: taking the entry
    #: from the lot (a disk read too), writing its state into the slot and checking it; not
    #: the admission around it (matching, trimming) nor parking the slot's conversation
    #: (``park_s``)
    unpark_s: float = 0.0
    evicted_parked: str = ""  # "ram" or "disk": the evicted conversation was parked, not lost
    park_s: float = 0.0  # time its park took (copying the state out), in restore_s
    #: a replayed request (reason "replayed"): the reply's tokens, given again from the cache
    #: with nothing decoded (``generated_tokens`` counts only tokens decoded)
    replayed_tokens: int = 0
    #: "exact" (canonical chunks, rewrites: nbkv.kv.invariance) or "lean" (as few decodes as
    #: n_batch allows, nothing rewritten: exactness not proven or not asked for)
    path: str = ""
    #: the fixed cost (nbkv.core.events): llama_decode calls that held this request's rows,
    #: the rows they computed for it, those of its prompt, state bytes moved between host RAM
    #: and the KV for it, and host time outside llama.cpp by part (admission, sampling, ...),
    #: as of its finish (the share of the step it finished in is in the engine's totals only)
    decode_calls: int = 0
    rows_computed: int = 0
    prefill_calls: int = 0
    prefill_rows: int = 0
    kv_bytes: int = 0
    host_parts: tuple[tuple[str, float], ...] = ()

    @property
    def host_s(self) -> float:
        """Host time spent on this request outside llama.cpp's calls (all parts)."""
        return sum(s for _, s in self.host_parts)

    @property
    def new_tokens(self) -> int:
        """Prompt tokens the cache did not hold (prefilled, less matched positions re-read)."""
        return max(self.prefilled_tokens - self.reprefilled_tokens - self.rewrite_absorbed, 0)

    @property
    def rows_per_new_token(self) -> float:
        """Prompt rows computed per new prompt token: 1.0 when nothing is read twice."""
        return self.prefill_rows / self.new_tokens if self.new_tokens else 0.0

    @property
    def salvage_pct(self) -> float:
        """Share of the prompt served from cache, in percent."""
        return 100.0 * self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tps(self) -> float:
        """Prefill throughput (tokens/s); 0 when nothing was prefilled."""
        return self.prefilled_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generation throughput (tokens/s) after the first token."""
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def read_s(self) -> float:
        """Of the first-token time: reading this prompt's own new tokens (prefill)."""
        return max(self.prefill_s - self.rewrite_absorbed_s - self.first_decode_s, 0.0)

    def evolve(self, **changes: Any) -> RequestRecord:
        """A copy with ``changes``: :func:`dataclasses.replace` without a second ``__init__``.

        A request's end copies its record with a score of figures on the scheduler's thread;
        ``replace`` would pass all of its sixty fields through ``__init__`` again.
        """
        unknown = changes.keys() - _RECORD_FIELDS
        if unknown:
            raise TypeError(f"RequestRecord has no field {', '.join(sorted(unknown))}")
        new = object.__new__(RequestRecord)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new


_RECORD_FIELDS = frozenset(f.name for f in fields(RequestRecord))


@dataclass(frozen=True)
class RequestStarted:
    """A request was given a slot; ``record`` holds the plan (timings still zero)."""

    record: RequestRecord


@dataclass(frozen=True)
class Progress:
    """Work done so far on a request: prefill (``phase`` rebuild/extend) or generation."""

    request_id: int
    slot: int
    phase: str  # "rebuild", "extend" or "generate"
    done: int
    total: int  # tokens to prefill, or max_tokens when generating


@dataclass(frozen=True)
class RequestFinished:
    """A request ended (normally, cancelled or failed); ``record`` is final."""

    record: RequestRecord


@dataclass(frozen=True)
class SlotRewritten:
    """A finished reply's KV was rewritten as a batched prefill (exact mode).

    In idle time, and partly while the reply was generated (``mixed``, mixed steps).
    """

    slot: int
    request_id: int | None  # the request whose reply it was
    tokens: int  # positions rewritten
    seconds: float
    mixed: int = 0  # rows rewritten during generation (their time is in ``seconds`` too)


@dataclass(frozen=True)
class SlotsChanged:
    """Slots changed outside a request (cleared, restored from a save, engine closed)."""

    reason: str


@dataclass(frozen=True)
class ParkingDropped:
    """A parked conversation left the parking lot without its session taking it back.

    A budget evicted it, its file was deleted, or it could not be written (``why``).
    """

    session: str | None
    key: str
    tokens: int
    tier: str  # where it was: "ram" or "disk"
    why: str


class Notice:
    """Base of the events that layers above the engine publish on a bus.

    A notebook session's turns changed, for example: the bus and its subscribers know them by
    this type alone.
    """


Event = Union[RequestStarted, Progress, RequestFinished, SlotRewritten, SlotsChanged,
              ParkingDropped, Notice]
Subscriber = Callable[[Event], None]


@dataclass
class EventBus:
    """A subscriber list plus a bounded history of finished requests."""

    history_size: int = 1000
    _subs: tuple[Subscriber, ...] = ()  # replaced whole (under the lock), read without it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.history: deque[RequestRecord] = deque(maxlen=self.history_size)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for every event; returns a function that unsubscribes."""
        with self._lock:
            self._subs = (*self._subs, callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subs:
                    subs = list(self._subs)
                    subs.remove(callback)
                    self._subs = tuple(subs)

        return unsubscribe

    def publish(self, event: Event) -> None:
        """Deliver ``event`` to every subscriber; record finished requests."""
        if isinstance(event, RequestFinished):
            self.history.append(event.record)
        for cb in self._subs:
            try:
                cb(event)
            except Exception:
                log.exception("nbkv event subscriber %r failed", cb)


PARTS = ("placement", "parking", "sampling", "lifecycle", "rewrite", "shadow", "step", "gc")


@dataclass
class RequestCounts:
    """One request's share of the engine's work (mutable while the request runs)."""

    decode_calls: int = 0  # llama_decode calls that held rows of this request
    rows: int = 0  # rows of this request those calls computed (prompt, image and reply rows)
    prefill_calls: int = 0  # ... of the calls, those that read its prompt
    prefill_rows: int = 0  # ... and the rows they computed
    kv_bytes: int = 0  # state bytes moved between host RAM and the KV for it (reads + writes)
    host_s: dict[str, float] = field(default_factory=dict)  # host time by part

    def add_host(self, part: str, seconds: float) -> None:
        """Add ``seconds`` of host time to ``part``."""
        self.host_s[part] = self.host_s.get(part, 0.0) + seconds


@dataclass
class KVCounters:
    """What one llama.cpp context did since it was created: its fixed cost, counted.

    :class:`KVCounters` is kept by the llama.cpp context (:mod:`nbkv.llama.backend`): every
    ``llama_decode`` adds one call, its rows and the time spent inside llama.cpp; every state read
    or write adds its bytes; every ``seq_cp`` one copy. The engine's parts wrap their host work in
    :meth:`KVCounters.part` ("placement", "parking", "sampling", "lifecycle", "rewrite",
    "shadow", "gc"; "step" is a step's own work outside those: its plan, its batch, the KV's
    bookkeeping): the part's wall time less what llama.cpp spent inside it (and less
    any part nested in it) is its *host time*. Work done while no request is queued or running (a
    reply's rewrite, a park's copy made ahead, a garbage collection: ``idle=True``) is host time
    too, but kept apart (``idle_host_s``): no request waits for it. The requests' host time is
    also counted as CPU time of the scheduler thread (``host_cpu_s``, less its CPU time inside
    ``llama_decode``; a total, read by the outermost parts): the work alone, without the waits a
    wall clock also sees (another thread holding the interpreter's lock, a core the OS gave
    another process). :class:`RequestCounts` is one request's share: the decodes that carried its
    rows and the host time and bytes of its own admission and sampling.
    """

    decode_calls: int = 0
    rows: int = 0  # rows computed by those calls (padding rows included)
    padded_rows: int = 0  # ... of which rows of the scratch sequence (fixed-shape decodes)
    llama_s: float = 0.0  # time spent inside llama_decode
    llama_cpu_s: float = 0.0  # ... and the CPU time of the thread that called it, inside it
    state_reads: int = 0
    state_writes: int = 0
    bytes_read: int = 0  # state bytes copied from the KV into host RAM
    bytes_written: int = 0  # ... and from host RAM into the KV
    copies: int = 0  # seq_cp calls: copies inside the KV, no host RAM
    host_s: dict[str, float] = field(default_factory=dict)  # host time by part
    idle_host_s: dict[str, float] = field(default_factory=dict)  # ... of idle-time work
    #: the requests' host time as CPU time of the thread doing it (all parts; not idle-time work)
    host_cpu_s: float = 0.0
    _stack: list[Part] = field(default_factory=list, repr=False)  # parts now open

    @property
    def bytes_moved(self) -> int:
        """State bytes moved between host RAM and the KV, both ways."""
        return self.bytes_read + self.bytes_written

    def decoded(self, rows: int, seconds: float, padded: int = 0, cpu: float = 0.0) -> None:
        """One ``llama_decode`` of ``rows`` rows took ``seconds`` (``cpu`` of its thread's)."""
        self.decode_calls += 1
        self.rows += rows
        self.padded_rows += padded
        self.llama_s += seconds
        self.llama_cpu_s += cpu

    def part(self, name: str, into: RequestCounts | tuple[RequestCounts, ...] | None = None,
             idle: bool = False) -> Part:
        """Count the host time of the block as ``name``, and into ``into``.

        ``into``: one request's counts, or several (one step's requests) in equal shares.

        ``idle``: the block runs while no request is queued or running; its time goes to
        ``idle_host_s`` instead.
        """
        return Part(self, name, into, idle)

    def snapshot(self) -> dict[str, Any]:
        """The counts as a plain dict (host times in seconds, by part)."""
        return {
            "decode_calls": self.decode_calls, "rows": self.rows,
            "padded_rows": self.padded_rows, "llama_s": self.llama_s,
            "state_reads": self.state_reads, "state_writes": self.state_writes,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "bytes_moved": self.bytes_moved, "copies": self.copies,
            "host_s": dict(self.host_s), "host_total_s": sum(self.host_s.values()),
            "host_cpu_s": self.host_cpu_s, "llama_cpu_s": self.llama_cpu_s,
            "idle_host_s": dict(self.idle_host_s),
        }


class Part:
    """One block of host work counted as a part (:meth:`KVCounters.part`).

    Wall time by part; the CPU time of the thread running it only for an outermost part
    (a part nested in another is in its CPU time already): the wall time also holds waits
    (for the interpreter's lock while another thread runs Python, for a core the OS gave
    another process), the CPU time only the work. A plain context manager, not a
    generator: it runs around every generation step, where a clock read costs most.
    """

    __slots__ = ("counters", "name", "into", "idle", "start", "llama", "nested", "cpu",
                 "llama_cpu")

    def __init__(self, counters: KVCounters, name: str,
                 into: RequestCounts | tuple[RequestCounts, ...] | None, idle: bool) -> None:
        self.counters, self.name, self.into, self.idle = counters, name, into, idle
        self.start = self.llama = self.nested = 0.0  # set on entry
        self.cpu = -1.0  # the thread's CPU time on entry; -1: nested (not read)
        self.llama_cpu = 0.0

    def __enter__(self) -> None:
        c = self.counters
        stack = c._stack
        if not stack and not self.idle:
            self.llama_cpu = c.llama_cpu_s
            self.cpu = time.thread_time()
        stack.append(self)
        self.llama = c.llama_s
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        c = self.counters
        inside = end - self.start - (c.llama_s - self.llama)
        stack = c._stack
        stack.pop()
        host = max(inside - self.nested, 0.0)  # the parts nested in it count as themselves
        name = self.name
        if self.idle:
            c.idle_host_s[name] = c.idle_host_s.get(name, 0.0) + host
        else:
            c.host_s[name] = c.host_s.get(name, 0.0) + host
            if self.cpu >= 0.0:
                cpu = time.thread_time() - self.cpu - (c.llama_cpu_s - self.llama_cpu)
                c.host_cpu_s += max(cpu, 0.0)
        into = self.into
        if isinstance(into, tuple):  # a step shared by its requests: equal shares
            for counts in into:
                counts.add_host(name, host / len(into))
        elif into is not None:
            into.add_host(name, host)
        if stack:
            stack[-1].nested += inside
