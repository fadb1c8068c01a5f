"""The engine: one llama.cpp context, N slots (= sequences), and a scheduler thread.

Every request is prepared in the caller's thread (template, tokens, message hashes), then
handed to the scheduler thread, the only code that touches the KV cache. It picks a slot
(:mod:`nbkv.policy`), trims or copies what the slot holds so that exactly the reusable
prefix remains, then prefills the rest and generates, decoding all active requests in
shared ``llama_decode`` batches. A slot's ``tokens`` list is the truth about its KV: it is
extended only after a successful decode, and on any failure the KV is trimmed back to it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import calibrate, invariance, memplan, policy, reasons
from .backend import Batch, Context, Model, default_threads
from .batching import Prefilling, plan_step
from .chat_api import ChatAPI, TemplatedAPI, request_totals
from .config import DEFAULTS, EngineConfig, check_engine_args
from .drafts import NgramDrafter
from .errors import (
    EngineClosedError,
    InvalidRequestError,
    MediaError,
    NbkvError,
    SlotTimeoutError,
)
from .events import (
    EventBus,
    Progress,
    RequestFinished,
    RequestRecord,
    RequestStarted,
    Segment,
    SlotRewritten,
    SlotsChanged,
    message_segments,
)
from .gguf_header import read_metadata
from .hardware import FLASH_ATTN, SPLIT_MODES, HardwareOptions, kv_type_id
from .invariance import PrefillRule
from .media import EmbeddingCache, MediaUnit, spans
from .messages import prefix_hashes
from .models import resolve_model_path
from .oracle import Verification, scratch_logits, scratch_rows
from .prompt import Prompt, PromptBuilder
from .sampling import Sampler, SamplingParams
from .slot_kv import SlotKV, probe_memory
from .spc import SystemPromptStore
from .streams import ChatResult, ChatStream
from .templates import CHATML, ChatTemplate
from .textstream import TextStream

log = logging.getLogger("nbkv")

CHECKPOINT_INTERVAL = 64  # hybrid/recurrent: a checkpoint at least this often in a prompt
REPLY_TAIL = 4  # ... and this many positions before the end of a rewritten reply
REWRITE_CHUNK = 64  # positions per idle-time rewrite step: what a new request may wait for
IMAGES_KEPT = 16  # pictures of recent prompts kept for verify()


def thrashing(history: Sequence[RequestRecord], n_slots: int, window: int = 24
              ) -> dict[str, Any]:
    """Detect cache thrashing: sessions that keep coming back to find their slot evicted.

    Looks at the last ``window`` requests: a *returning miss* is a request of a session whose
    conversation an earlier request evicted, and that then had to rebuild (strategy ``miss``).
    """
    recent = list(history)[-window:]
    evicted: set[str] = set()
    returning = 0
    for r in recent:
        if r.session is not None and r.session in evicted and r.strategy == policy.MISS:
            returning += 1
        if r.session is not None:
            evicted.discard(r.session)
        if r.evicted_session is not None:
            evicted.add(r.evicted_session)
    active = len({r.session for r in recent if r.session is not None})
    flagged = returning >= 3 and returning >= 0.25 * len(recent)
    return {
        "returning_misses": returning,
        "active_sessions": active,
        "thrashing": flagged,
        "advice": (
            f"cache thrashing: {active} sessions take turns on {n_slots} slots, so each "
            f"returning session finds its conversation evicted and rebuilds it from scratch; "
            f"load the engine with at least {active} slots"
        ) if flagged else "",
    }


def trim_valid(kv: SlotKV, units: Sequence[Any], n: int, rule: PrefillRule) -> int:
    """Cut ``kv`` back to where a canonical prefill of ``units`` may begin; returns it.

    ``kv`` holds a prefix of ``units``; the cut is the largest position ``<= n`` that is a
    valid start (:func:`nbkv.invariance.valid_start`) and that its memory can go back to.
    Memory that cannot be cut goes back to a checkpoint, which must itself be such a
    position in *this* prompt, else further back.
    """
    restored = None
    while True:
        n = invariance.valid_start(units, n, rule)
        kept = kv.trim_to(n)
        restored = kv.last_restore if kv.last_restore is not None else restored
        if kept == n:
            kv.last_restore = restored  # the checkpoint this cut went back to, if any
            return kept
        n = kept


@dataclass(frozen=True)
class SlotInfo:
    """An immutable snapshot of one slot."""

    index: int
    seq_id: int
    capacity: int
    session: str | None
    tokens: tuple[int, ...]
    hashes: tuple[str, ...]
    msg_ends: tuple[int, ...]
    last_used: int
    pending: bool
    segments: tuple[Segment, ...] = ()
    last_request: int | None = None
    settled: int = 0  # leading positions whose KV equals a batched prefill of the tokens
    checkpoints: tuple[int, ...] = ()  # positions with a checkpoint (hybrid/recurrent models)
    checkpoint_bytes: int = 0
    memory: str = "plain"  # the model's memory class (nbkv.slot_kv)
    rewriting: int = 0  # trailing positions out of the KV while a reply's KV is rewritten
    #: remote engines: False when the server's slot differs from what nbkv expects
    verified: bool = True
    note: str = ""  # ... and why

    @property
    def n_tokens(self) -> int:
        """KV positions in use."""
        return len(self.tokens)

    @property
    def n_messages(self) -> int:
        """Messages cached (the model's last reply included)."""
        return len(self.hashes)

    @property
    def empty(self) -> bool:
        """True when the slot holds nothing."""
        return not self.tokens

    @property
    def n_media(self) -> int:
        """Image chunks held in the slot's KV."""
        return sum(1 for u in self.tokens if isinstance(u, MediaUnit) and u.offset == 0)


@dataclass
class _Slot:
    """A slot: its KV (the one owner of tokens == KV) and what the cache knows about it."""

    index: int
    kv: SlotKV
    capacity: int
    session: str | None = None
    hashes: list[str] = field(default_factory=list)
    msg_ends: list[int] = field(default_factory=list)
    last_used: int = 0
    pending: bool = False
    segments: tuple[Segment, ...] = ()
    last_request: int | None = None
    redo: list[Any] = field(default_factory=list)  # positions being rewritten (settling)
    rewrite_n: int = 0  # positions the current rewrite covers
    rewrite_s: float = 0.0  # ... and the time it has taken so far

    @property
    def seq_id(self) -> int:
        return self.kv.seq_id

    @property
    def tokens(self) -> list[Any]:
        return self.kv.tokens

    def snapshot(self) -> SlotInfo:
        kv = self.kv  # a reply being rewritten is still this slot's (see Engine._settle)
        return SlotInfo(
            self.index, kv.seq_id, self.capacity, self.session, (*kv.tokens, *self.redo),
            tuple(self.hashes), tuple(self.msg_ends), self.last_used, self.pending,
            self.segments, self.last_request, kv.settled, kv.checkpoints.positions,
            kv.checkpoints.nbytes, kv.memory.kind, len(self.redo),
        )

    def reset(self) -> None:
        """Forget everything (the KV too)."""
        self.kv.clear()
        self.redo.clear()
        self.session = None
        self.hashes.clear()
        self.msg_ends.clear()
        self.segments = ()


class _Job:
    """A request inside the scheduler."""

    _ids = itertools.count(1)

    def __init__(self, prompt: Prompt, session: str | None, params: SamplingParams,
                 timeout: float) -> None:
        self.id = next(self._ids)
        self.prompt = prompt
        self.session = session
        self.params = params
        self.deadline = time.monotonic() + timeout
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.slot: _Slot | None = None
        self.todo: list[int] = []  # prompt tokens still to prefill
        self.reuse = 0
        self.capture_at: int | None = None  # SPC: save the slot's state at this length
        self.spc_key: str | None = None
        self.sampler: Sampler | None = None
        self.text = TextStream(params.stop)
        self.generated: list[int] = []
        self.next_token: int | None = None
        self.record: RequestRecord | None = None
        self.t_submit = time.perf_counter()
        self.t_prefill = 0.0
        self.t_first = 0.0
        self.t_last_progress = 0.0
        self.drafter: NgramDrafter | None = None
        self.drafted = 0  # guesses decoded (speculative, exact mode)
        self.accepted = 0  # ... that the model confirmed
        self.encoding: Future | None = None  # the vision encoder working for this request
        self.image_piece = 0  # sub-batches of the image at the head of todo already in KV
        self.embeddings: dict[str, Any] = {}  # image hash -> its embeddings, once known
        self.encoder_runs = 0  # images this request sent through the vision encoder
        self.embedding_hits = 0  # images whose embeddings came from the cache
        self.stops: tuple[int, ...] = ()  # KV positions where a checkpoint is taken


class Engine(TemplatedAPI, ChatAPI):
    """A persistent multi-slot chat engine with Incremental Message and System Prompt Caches.

    Args:
        model_path: GGUF file; ``None`` uses ``$NBKV_MODEL`` or the embedded SmolLM2-135M.
        n_slots: conversations kept in KV at once (one llama.cpp sequence each).
        n_ctx: context budget of each slot, in tokens (rounded up to a multiple of 256).
            ``None`` for either: picked from the memory plan (4 x 4096 when the KV takes at
            most a quarter of the free memory, else smaller), said in ``engine.sized``; a
            slot longer than the model's trained context is warned about.
        cache: ``"imc"`` (whole conversations), ``"spc"`` (system prompt only) or ``"off"``.
        cache_min_tokens: IMC: shortest token prefix worth salvaging from another
            conversation's slot; SPC: shortest system prompt worth caching.
        n_batch: tokens per ``llama_decode`` call (prefill chunk size).
        template: a Jinja2 chat template overriding the model's own.
        overflow: ``"error"`` raises :class:`ContextOverflowError` when a prompt does not fit
            its slot; ``"slide"`` drops the oldest turns (keeping the system prompt) instead.
        wait_timeout: seconds a request may wait for a free slot.
        system_prompt_cache: ``True`` is another way to say ``cache="spc"``.
        on_load_progress: called with the fraction of the model loaded, 0.0 to 1.0.
        flash_attn: ``"off"`` (default), ``"on"`` or ``"auto"`` (``True``/``False`` too). With
            f16 KV, llama.cpp's CPU flash-attention kernel tiles batches of 64+ tokens, so a
            prompt prefilled in pieces (what a cache hit does) gets logits up to ~0.7 away
            from the same prompt prefilled at once: ``exact=True`` refuses it. With quantized
            K and V the kernel is per-token and exactness holds.
        type_k, type_v: KV cache types: ``"f16"`` (default), ``"q8_0"`` (about half the
            memory), ``"q4_0"``, ... (:data:`nbkv.hardware.KV_TYPES`); a quantized V cache
            needs ``flash_attn="on"``.
        n_gpu_layers: layers offloaded to a GPU: ``None`` (default) is all of them when the
            llama.cpp build has a GPU backend, else 0; with ``main_gpu``, ``split_mode``
            (``"layer"``, ``"row"``, ``"none"``) and ``tensor_split`` as in llama.cpp.
        use_mmap, use_mlock: how the weights are loaded (memory-mapped; locked in RAM).
        check_memory: plan the KV bytes from the GGUF metadata and refuse, with the figures,
            a configuration that cannot fit the free memory, before llama.cpp allocates.
        exact: keep cached KV bit-identical to a from-scratch prefill. Replies are generated
            one token per step, as plain llama.cpp does; a one-token decode rounds slightly
            differently from a batched prefill, so once a reply has streamed its KV is
            rewritten as a batch in the scheduler's idle time (or by the next request that
            reuses it). ``False`` keeps the token-by-token KV: no rewrite, and a cached reply
            may then differ from a from-scratch one at near-ties.
        speculative: decode a prompt-lookup guess of the next token beside each generated
            one (:mod:`nbkv.drafts`); a right guess yields two tokens from one decode. The
            guess is checked against the token sampled the ordinary way. Off by default: a
            two-row decode costs ~1.6 rows' time on a CPU, and rounds differently from a
            one-row decode (so replies equal plain llama.cpp's only without guesses).
            Ignored on hybrid and recurrent models, whose state cannot drop a wrong guess.
        max_checkpoints: per slot, on models whose KV cannot be trimmed (hybrid, recurrent):
            partial states kept at message boundaries (the newest kept, older ones thinned).
        mmproj: a vision projector GGUF matching the model: messages may then carry images
            (OpenAI-style ``image_url`` parts, or PIL images, arrays and bytes from Python).
            It is checked before llama.cpp sees it; a mismatch raises
            :class:`~nbkv.errors.ProjectorError`.
        embedding_cache: where image embeddings are kept by content hash (share one between
            engines if you like); default a private 256 MiB LRU.
        trust_projector: accept projector types nbkv cannot validate ahead of time.
        calibration: ``"cached"`` (default) or ``"fresh"``: at load, nbkv measures how this
            model and build must group prompt rows for cached KV to equal a fresh prefill
            (:mod:`nbkv.calibrate`, about a second; cached per model, build and settings)
            and prefills that way; ``"fresh"`` measures again. The result is
            ``engine.prefill_rule`` (``engine.model.exactness`` in words).
    """

    last_save: Any = None  # the latest nbkv.persist.SaveReport
    last_restore: Any = None  # ... and RestoreReport

    def __init__(
        self,
        model_path: str | None = None,
        *,
        n_slots: int | None = DEFAULTS.n_slots,
        n_ctx: int | None = DEFAULTS.n_ctx,
        cache: str = DEFAULTS.cache,
        cache_min_tokens: int = DEFAULTS.cache_min_tokens,
        n_batch: int = 256,
        n_threads: int | None = None,
        template: str | None = None,
        overflow: str = DEFAULTS.overflow,
        spc_max_entries: int = 4,
        history_size: int = 1000,
        wait_timeout: float = 300.0,
        system_prompt_cache: bool | None = None,
        on_load_progress: Callable[[float], object] | None = None,
        flash_attn: bool | str = False,
        exact: bool = True,
        speculative: bool = False,
        max_checkpoints: int = 8,
        mmproj: str | None = None,
        embedding_cache: EmbeddingCache | None = None,
        trust_projector: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
        n_gpu_layers: int | None = None,
        main_gpu: int = 0,
        split_mode: str = "layer",
        tensor_split: Sequence[float] | None = None,
        use_mmap: bool = True,
        use_mlock: bool = False,
        check_memory: bool = True,
        calibration: str = "cached",
    ) -> None:
        check_engine_args(n_slots=n_slots, n_ctx=n_ctx, cache_min_tokens=cache_min_tokens,
                          n_batch=n_batch, n_threads=n_threads, spc_max_entries=spc_max_entries,
                          max_checkpoints=max_checkpoints, wait_timeout=wait_timeout,
                          history_size=history_size)
        if system_prompt_cache and cache == "imc":
            raise InvalidRequestError(
                "the System Prompt Cache and the Incremental Message Cache are mutually "
                "exclusive (IMC already caches the system prompt): pick cache='imc' or 'spc'"
            )
        if system_prompt_cache:
            cache = "spc"
        if calibration not in ("cached", "fresh"):
            raise InvalidRequestError(
                f"calibration must be 'cached' or 'fresh', not {calibration!r}")
        # validated now; a size left to the memory plan (None) is filled in after the load
        self.config = EngineConfig(DEFAULTS.n_slots if n_slots is None else n_slots,
                                   DEFAULTS.n_ctx if n_ctx is None else n_ctx, cache,
                                   cache_min_tokens, overflow)
        hw = HardwareOptions(n_gpu_layers, main_gpu, split_mode,
                             tuple(tensor_split) if tensor_split else None, flash_attn,
                             type_k, type_v, use_mmap, use_mlock)
        hw.check_exact(exact)
        for warning in hw.warnings:
            log.warning("%s", warning)
            warnings.warn(warning, stacklevel=2)
        self.hardware = hw
        self.flash_attn = hw.resolved_flash_attn(exact)
        self.exact = exact
        self.cache = cache
        self.cache_min_tokens = cache_min_tokens
        self.overflow = overflow
        self.wait_timeout = wait_timeout
        self.spc_max_entries = spc_max_entries
        path = resolve_model_path(model_path)
        self.model = Model(path, hw.gpu_layers, on_load_progress, main_gpu=main_gpu,
                           split_mode=SPLIT_MODES[split_mode], tensor_split=hw.tensor_split,
                           use_mmap=use_mmap, use_mlock=use_mlock)
        try:
            source = template or self.model.chat_template or CHATML
            self.template = ChatTemplate(source, self.model.bos_text, self.model.eos_text)
            meta = read_metadata(path)
            free, where = memplan.kv_memory(self.model.params.n_gpu_layers)
            picked = " and ".join(w for w, given in (("slots", n_slots), ("tokens per slot",
                                                                          n_ctx)) if given is None)
            if picked:
                auto_slots, auto_ctx = memplan.default_size(
                    meta, free, type_k=type_k, type_v=type_v,
                    recurrent=self.model.is_recurrent, hybrid=self.model.is_hybrid,
                    n_ctx_train=self.model.n_ctx_train)
                n_slots, n_ctx = n_slots or auto_slots, n_ctx or auto_ctx
            self.config = replace(self.config, n_slots=n_slots, n_ctx=n_ctx)
            slot_ctx = -(-max(n_ctx, 256) // 256) * 256
            if mmproj is not None:  # a non-causal image must fit one micro-batch
                from .projector_check import batch_for_projector

                n_batch = batch_for_projector(mmproj, n_batch)
            self.plan = memplan.plan(meta, n_slots, slot_ctx, type_k, type_v,
                                     self.model.is_recurrent, self.model.is_hybrid)
            if check_memory:
                memplan.check_fits(self.plan, free, where)
            #: what the memory plan picked, in words ("" when the caller gave both sizes)
            self.sized = memplan.fit_sentence(self.plan, free, where, picked) if picked else ""
            if self.sized:
                log.info("%s", self.sized)
            past = memplan.context_warning(slot_ctx, self.model.n_ctx_train)
            if past:
                log.warning("%s", past)
                warnings.warn(past, stacklevel=2)
            self.ctx = Context(self.model, slot_ctx * n_slots, n_slots, n_batch, n_threads,
                               flash_attn=FLASH_ATTN[self.flash_attn],
                               type_k=kv_type_id(type_k), type_v=kv_type_id(type_v))
        except BaseException:
            self.model.close()
            raise
        self._batch = Batch(self.ctx.n_batch)
        try:
            self.memory = probe_memory(self.model, self.ctx, self._batch)
        except BaseException:
            self._batch.close()
            self.ctx.close()
            self.model.close()
            raise
        try:
            self.prefill_rule = self._calibrate(calibration, n_threads, type_k, type_v)
        except BaseException:
            self._batch.close()
            self.ctx.close()
            self.model.close()
            raise
        self.model.prefill_rule = self.prefill_rule
        self.speculative = speculative and self.memory.can_trim
        if speculative and not self.speculative:
            log.info("speculative guesses are off: %s memory cannot drop a wrong guess",
                     self.memory.kind)
        self.projector = None
        if mmproj is not None:
            from .projector import Projector

            try:
                self.projector = Projector(mmproj, self.model, cache=embedding_cache,
                                           n_threads=n_threads, trust_projector=trust_projector,
                                           flash_attn=FLASH_ATTN[self.flash_attn])
            except BaseException:
                self._batch.close()
                self.ctx.close()
                self.model.close()
                raise
        self.n_ctx = self.ctx.n_ctx_seq
        self._prompts = PromptBuilder(self.model, self.template, self.projector, self.n_ctx)
        self._slots = [_Slot(i, SlotKV(self.ctx, i, self.memory, max_checkpoints), self.n_ctx)
                       for i in range(n_slots)]
        self._spc = SystemPromptStore(spc_max_entries)
        #: pictures of recent prompts by hash (verify() re-decodes them from scratch)
        self._images: OrderedDict[str, Any] = OrderedDict()
        self._whereabouts: dict[str, reasons.Whereabouts] = {}  # per session: for reasons
        self._compared: OrderedDict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = (
            OrderedDict())  # request id -> (cached units, prompt units), for explain()
        self.events = EventBus(history_size)
        self._cv = threading.Condition()
        self._queue: list[_Job] = []
        self._active: list[_Job] = []
        self._control: list[tuple[Callable[[], Any], Future]] = []
        self._clock = itertools.count(1)
        self._closed = False
        self._native = _Native(self.model, self.ctx, self._batch, self.projector)
        # the thread holds the engine only weakly: an engine nobody references is collected,
        # and its thread then frees the native objects (see _schedule)
        self._thread = threading.Thread(
            target=_schedule, args=(weakref.ref(self), self._cv, self._native),
            name="nbkv-scheduler", daemon=True)
        weakref.finalize(self, _notify, self._cv)
        self._thread.start()
        log.info(
            "nbkv engine: %s, %s memory, %d slots x %d tokens, cache=%s",
            self.model.description, self.memory.kind, n_slots, self.n_ctx, cache,
        )

    def _calibrate(self, mode: str, n_threads: int | None, type_k: str, type_v: str
                   ) -> PrefillRule:
        """The model's prefill rule (:mod:`nbkv.calibrate`), checked against ``n_batch``."""
        settings = {"n_threads": n_threads or default_threads(),
                    "flash_attn": FLASH_ATTN[self.flash_attn],
                    "type_k": kv_type_id(type_k), "type_v": kv_type_id(type_v)}
        self._context_settings = settings
        try:
            rule = calibrate.calibrate(self.model, n_seq=self.config.n_slots,
                                       can_trim=self.memory.can_trim, settings=settings,
                                       cache=mode == "cached")
        except (NbkvError, RuntimeError) as e:  # e.g. no room for the temporary context
            rule = PrefillRule(2, 1, exact=False, reason=f"the calibration failed: {e}")
        # next_chunk can then always leave the last chunk threshold rows
        need = max(2 * rule.threshold + rule.align - 2, rule.min_chunk)
        if rule.exact and self._batch.capacity < need:
            rule = replace(rule, exact=False, reason=(
                f"n_batch {self._batch.capacity} is too small: this model needs prompt chunks "
                f"of {rule.min_chunk}+ rows, so n_batch >= {need}"))
        if not rule.exact:
            msg = (f"nbkv cannot prove cached replies exact on {self.model.path.name}: "
                   f"{rule.reason}; it serves from cache anyway and marks records exact=False")
            log.warning("%s", msg)
            warnings.warn(msg, stacklevel=3)
        return rule

    # ------------------------------------------------------------------ public API

    @property
    def n_slots(self) -> int:
        """Number of slots."""
        return len(self._slots)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        session: str | None = None,
        *,
        stream: bool = False,
        overflow: str | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> ChatResult | ChatStream:
        """Reply to ``messages`` (the whole conversation so far, ending with the user's turn).

        ``session`` names the conversation for slot ownership and the event records.
        Sampling keywords: ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``min_p``,
        ``repeat_penalty``, ``repeat_last_n``, ``seed``, ``max_tokens``, ``stop``.
        With ``stream=True`` returns a :class:`ChatStream` of text deltas, else a
        :class:`ChatResult`.
        """
        self._check_request(session, timeout)
        t0 = time.perf_counter()
        params = SamplingParams.from_kwargs(**sampling)
        prompt = self._prepare(messages, overflow or self.overflow, params.max_tokens)
        job = _Job(prompt, session, params, self.wait_timeout if timeout is None else timeout)
        if self.speculative:
            job.drafter = NgramDrafter(prompt.tokens)
        job.t_submit = t0
        self._submit(job)
        s = ChatStream(self, job)
        return s if stream else s.result()

    def slots(self) -> tuple[SlotInfo, ...]:
        """An immutable snapshot of every slot."""
        with self._cv:
            return tuple(s.snapshot() for s in self._slots)

    def clear(self, slot: int | None = None) -> None:
        """Empty one slot (or all, and the system prompt cache). A busy slot can't be cleared."""
        if slot is not None and not 0 <= slot < len(self._slots):
            raise InvalidRequestError(f"no slot {slot}: slots are 0..{len(self._slots) - 1}")

        def do() -> None:
            targets = self._slots if slot is None else [self._slots[slot]]
            busy = [s.index for s in targets if s.pending]
            if slot is not None and busy:
                raise NbkvError(f"slot {slot} is serving a request; cancel it first")
            for s in targets:
                if not s.pending:
                    if s.session is not None and s.tokens:
                        self._whereabouts[s.session] = reasons.Whereabouts(
                            s.last_request or 0, reasons.CLEARED)
                    s.reset()
            if slot is None:
                self._spc.clear()
        self._call(do)
        self.events.publish(SlotsChanged("cleared"))

    def probe(self, slot: int, token: int) -> list[float]:
        """Logits the model gives ``token`` appended to ``slot``'s cached tokens (KV unchanged).

        Computed as a request extending the slot would: its settled KV is kept, the rest and
        the probe (twice: never a lone row) are prefilled canonically, then the slot is put
        back as it was. They must equal a from-scratch decode of the slot's tokens plus the
        probe (:func:`nbkv.oracle.scratch_logits`); :meth:`verify` compares them.
        """
        self._slot_index(slot)

        def do() -> list[float]:
            s = self._ready_slot(slot)
            units = [*s.kv.tokens, token, token]
            if len(units) > s.capacity:
                raise NbkvError(f"slot {slot} is full")
            return list(self._extension_logits(s, units, len(s.kv)))
        return self._call(do)

    def verify(self, slot: int | None = None, *, request: int | None = None,
               probe: int = 42) -> list[Verification]:
        """Recompute slots from scratch and compare: is the cached KV bit-identical.

        ``slot``: one slot (default: every slot that holds something); ``request``: the slot
        that served request N, if it still holds it. Each slot's probe logits (:meth:`probe`)
        are compared with a from-scratch decode of its tokens in a temporary context; where
        they differ, the first differing position is narrowed down (memory that can be cut).
        Pending reply rewrites run first: what is checked is the KV as it will be served.
        """
        if request is not None:
            rec = next((r for r in self.history if r.id == request), None)
            if rec is None:
                raise InvalidRequestError(f"no request #{request} in the history")
            owner = self._slots[rec.slot]
            if owner.last_request != request:
                raise InvalidRequestError(
                    f"slot {rec.slot} no longer holds request #{request}'s conversation")
            slot = rec.slot
        targets = [self._slot_index(slot)] if slot is not None else [
            s.index for s in self.slots() if not s.empty]
        return [self._verify(i, probe) for i in targets]

    def _slot_index(self, slot: Any) -> int:
        """``slot`` if it names a slot, else :class:`InvalidRequestError`."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not (
                0 <= slot < len(self._slots)):
            raise InvalidRequestError(f"no slot {slot!r}: slots are 0..{len(self._slots) - 1}")
        return slot

    def _ready_slot(self, index: int) -> _Slot:
        """Slot ``index`` with its pending rewrite done (scheduler thread).

        Its KV is then what a request would be served.
        """
        s = self._slots[index]
        if s.pending:
            raise NbkvError(f"slot {index} is serving a request")
        while s.redo or (self.exact and s.kv.needs_rewrite):
            self._settle(s)
        return s

    def _extension_logits(self, s: _Slot, units: Sequence[Any], row: int) -> np.ndarray:
        """The logits of ``units[row]`` prefilled over ``s``'s KV, as a request would.

        ``units`` are prefilled canonically on top of what ``s`` holds of them (its settled
        KV, or all of it without exact mode); then ``s`` holds its tokens again: memory that
        can be cut is cut and its tail prefilled again (canonically), other memory gets its
        whole state back (scheduler thread).
        """
        kv, rule = s.kv, self.prefill_rule
        tokens = list(kv.tokens)
        snap = kv.snapshot() if kv.memory.checkpoints else None
        out = None
        try:
            pos = trim_valid(kv, units, min(self._servable(kv), row), rule)
            for lo, hi in self._prefill_run(units, pos, kv.seq_id, row):
                if lo <= row < hi:
                    out = np.array(self.ctx.logits(row - lo))
        finally:
            if snap is not None:
                kv.put_back(snap)
            else:  # a state copy would keep only the window of sliding-window layers
                kv.resync()
                for lo, hi in self._prefill_run(tokens, len(kv), kv.seq_id, None):
                    kv.extend(tokens[lo:hi], settled=invariance.stable_end(tokens, hi, rule))
        assert out is not None
        return out

    def _prefill_run(self, units: Sequence[Any], pos: int, seq: int, row: int | None
                     ) -> Iterator[tuple[int, int]]:
        """Prefill ``units[pos:]`` (text) into ``seq`` in canonical chunks.

        Yields each decoded chunk's ``(from, to)``; ``row`` is the one position whose logits
        are computed.
        """
        b = self._batch
        while pos < len(units):
            if not isinstance(units[pos], int):
                raise NbkvError("an image after a slot's settled KV cannot be re-read here")
            n = invariance.next_chunk(units, pos, self.prefill_rule, b.capacity)
            b.clear()
            for k in range(pos, pos + n):
                b.add(units[k], k, seq, k == row)
            self.ctx.decode(b)
            yield pos, pos + n
            pos += n

    def _servable(self, kv: SlotKV) -> int:
        """Leading positions of ``kv`` a request may keep: its settled KV in exact mode."""
        return kv.settled if self.exact else len(kv)

    def _scratch(self, units: Sequence[Any]) -> dict[str, Any]:
        """Keywords for :func:`nbkv.oracle.scratch_rows` matching this engine.

        Its grouping, batch, context settings and, for images, projector and pictures.
        """
        kw: dict[str, Any] = {"rule": self.prefill_rule, "n_batch": self._batch.capacity,
                              **self._context_settings}
        hashes = {u.key.image_hash for u in units if isinstance(u, MediaUnit)}
        if hashes:
            missing = hashes - self._images.keys()
            if missing:
                raise NbkvError("cannot verify: the slot holds an image this engine no "
                                "longer keeps")
            kw.update(projector=self.projector, images=dict(self._images))
        return kw

    def _verify(self, index: int, probe: int) -> Verification:
        def take() -> tuple[list[Any], str | None, int, np.ndarray]:
            s = self._ready_slot(index)
            units = [*s.kv.tokens, probe, probe]
            if len(units) > s.capacity:
                raise NbkvError(f"slot {index} is full")
            return (list(s.kv.tokens), s.session, self._servable(s.kv),
                    self._extension_logits(s, units, len(s.kv)))
        tokens, session, servable, cached = self._call(take)
        fresh = scratch_logits(self.model, tokens, probe, **self._scratch(tokens))
        same = bool(np.array_equal(cached, fresh))
        first = None
        if not same and self.memory.can_trim:
            first = self._first_difference(index, tokens, servable)
        return Verification(index, session, len(tokens), same,
                            float(np.abs(cached - fresh).max()), first,
                            self.exact and self.prefill_rule.exact)

    def _first_difference(self, index: int, tokens: list[Any], servable: int
                          ) -> tuple[int, int] | None:
        """Narrow down where ``index``'s KV first differs from a fresh decode.

        Rows ending on the grid are recomputed over the cached KV before them and compared
        with a fresh run (bisection; the slot must not change meanwhile).
        """
        rule = self.prefill_rule
        step = max(16 // rule.align, 1) * rule.align
        ends = sorted({g for g in (invariance.valid_start(tokens, x, rule)
                                   for x in range(step, servable + 1, step))
                       if g >= rule.min_chunk and invariance.stable_end(tokens, g, rule) == g
                       and isinstance(tokens[g - 1], int)})
        if not ends:
            return (0, len(tokens))
        fresh = scratch_rows(self.model, tokens, [g - 1 for g in ends], **self._scratch(tokens))

        def kept_equal(g: int) -> tuple[bool, int]:
            def run() -> tuple[bool, int]:
                s = self._slots[index]
                if s.pending or s.kv.tokens[:g] != tokens[:g]:
                    raise NbkvError("the slot changed during verification")
                v = invariance.valid_start(tokens[:g], min(self._servable(s.kv), g - 1), rule)
                return bool(np.array_equal(self._extension_logits(s, tokens[:g], g - 1),
                                           fresh[g - 1])), v
            return self._call(run)

        lo_i, hi_i, lo_pos, hi_pos = -1, len(ends), 0, len(tokens)
        while hi_i - lo_i > 1:
            mid = (lo_i + hi_i) // 2
            ok, v = kept_equal(ends[mid])
            if ok:
                lo_i, lo_pos = mid, v
            else:
                hi_i, hi_pos = mid, v
        return (lo_pos, hi_pos)

    def explain(self, request: int | None = None) -> reasons.Explanation:
        """The full story of request ``request`` (default: the latest).

        Its reason, and the cached and new renderings split at the divergence point (kept
        for the last 32 requests).
        """
        return reasons.explain_request(self.history, self._compared, self._text_of, request)

    def _text_of(self, units: Sequence[Any]) -> str:
        """Text of KV units: tokens detokenized, each image as ``[image]``."""
        out, run = [], []
        for u in units:
            if isinstance(u, MediaUnit):
                if run:
                    out.append(self.model.detokenize(run))
                    run = []
                if u.offset == 0:
                    out.append("[image]")
            else:
                run.append(u)
        if run:
            out.append(self.model.detokenize(run))
        return "".join(out)

    def settle(self) -> None:
        """Rewrite every finished reply's KV now instead of in idle time (exact mode).

        Afterwards every idle slot's KV equals a batched prefill of its tokens. The engine
        does this on its own when it has nothing else to do; call it to measure, or before
        reading the KV directly.
        """
        def do() -> None:
            while (slot := self._settling_slot()) is not None:
                self._settle(slot)
        self._call(do)

    def save(self, path: str | None = None, sessions: Any = None) -> Any:
        """Save the slots, system prompts, image embeddings and sessions to disk.

        ``path``: a directory (default: one per notebook under the user's cache dir).
        Replies still decoding are not saved; finished replies are rewritten first (exact
        mode), so the saved KV is what a from-scratch prefill computes. Atomic: a crash
        mid-save leaves the previous save. See :mod:`nbkv.persist`; returns a report.
        """
        from .persist import save

        return save(self, path, sessions)

    def restore(self, path: str | None = None, sessions: Any = None) -> Any:
        """Replace the slots and caches with a save (from this or an earlier process).

        Checks everything first: a save from another model, projector, llama.cpp build or
        ``n_ctx``, or a corrupt one, raises :class:`~nbkv.errors.RestoreError` and leaves
        the engine unchanged. With fewer slots than saved, the most recently used are kept.
        """
        from .persist import restore

        return restore(self, path, sessions)

    def stats(self) -> dict[str, Any]:
        """Totals over the request history."""
        h = self.history
        drafted = sum(r.draft_tokens for r in h)
        accepted = sum(r.draft_accepted for r in h)
        return {
            **request_totals(h),
            "draft_tokens": drafted,
            "draft_accepted": accepted,
            "draft_acceptance_pct": 100.0 * accepted / drafted if drafted else 0.0,
            "evictions": sum(1 for r in h if r.evicted_session is not None or r.evicted_tokens),
            "spc_entries": len(self._spc),
            **thrashing(h, self.n_slots),
        }

    def close(self) -> None:
        """Cancel running requests, stop the scheduler and free the model and context.

        Optional: an engine nobody references is closed by garbage collection.
        """
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for j in self._queue + self._active:
                j.cancel.set()
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._spc.clear()
        self.events.publish(SlotsChanged("closed"))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ caller-thread work

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str, max_tokens: int
                 ) -> Prompt:
        if self._closed:
            raise EngineClosedError("this engine is closed")
        prompt = self._prompts.prepare(messages, overflow, max_tokens)
        for im in prompt.media.images if prompt.media is not None else ():
            self._images[im.hash] = im
            self._images.move_to_end(im.hash)
            while len(self._images) > IMAGES_KEPT:
                self._images.popitem(last=False)
        return prompt

    def _submit(self, job: _Job) -> None:
        with self._cv:
            if self._closed:
                raise EngineClosedError("this engine is closed")
            self._queue.append(job)
            self._cv.notify_all()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the scheduler thread between decode steps; return its result."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise EngineClosedError("this engine is closed")
            self._control.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    # --------------------------------------------------------------- scheduler thread

    def _has_work(self) -> bool:
        """Anything for the scheduler to do (call with ``_cv`` held)."""
        return bool(self._queue or self._active or self._control or self._closed
                    or self._settling_slot() is not None)

    def _run_once(self) -> bool:
        """One scheduler iteration; False once the engine is closed (the thread then ends)."""
        with self._cv:
            closed = self._closed
            if closed:
                jobs, self._queue = self._queue + self._active, []
                self._active = []
                for _, fut in self._control:
                    fut.set_exception(EngineClosedError("this engine is closed"))
                self._control.clear()
            else:
                jobs = []
                control, self._control = self._control, []
        if closed:
            for j in jobs:
                self._finish(j, "cancelled")
            return False
        for fn, fut in control:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        self._admit()
        if self._active:
            if not self._step():  # every active request waits for the vision encoder
                with self._cv:
                    self._cv.wait(0.05)
        elif self._queue:
            with self._cv:  # every slot busy: wait for a change, or a deadline
                self._cv.wait(0.05)
        else:  # idle: rewrite one chunk of a finished reply's KV (see exact)
            slot = self._settling_slot()
            if slot is not None:
                self._settle(slot)
        return True

    def _admit(self) -> None:
        now = time.monotonic()
        for job in list(self._queue):
            if job.cancel.is_set():
                self._queue.remove(job)
                self._fail(job, None, "cancelled")
                continue
            try:
                started = self._start(job)
            except BaseException as e:  # noqa: BLE001 - reported to the requester
                self._queue.remove(job)
                self._fail(job, e, "error")
                continue
            if started:
                self._queue.remove(job)
                self._active.append(job)
            elif now > job.deadline:
                self._queue.remove(job)
                self._fail(job, SlotTimeoutError(
                    f"no slot became free within the wait limit ({self.n_slots} slots, all busy)"
                ), "error")

    def _start(self, job: _Job) -> bool:
        """Pick a slot and prepare its KV; False when no slot is free yet."""
        p = job.prompt
        with self._cv:
            snaps = [s.snapshot() for s in self._slots]
        strategy = self.cache
        donor = None
        evicted, evicted_tokens, matched = None, 0, 0
        own = max((s for s in snaps if s.session == job.session and s.tokens
                   and job.session is not None), key=lambda s: s.last_used, default=None)
        if self.cache == "imc":
            plan = policy.select(snaps, p.tokens, p.hashes, job.session, self.cache_min_tokens)
            if plan is None:
                return False
            slot, strategy = self._slots[plan.slot], plan.strategy
            reuse = plan.reuse
            donor = plan.donor
            evicted, evicted_tokens = plan.evicted, plan.evicted_tokens
            matched = plan.matched_messages
        else:
            target = policy.pick_free(snaps, job.session)
            if target is None:
                return False
            slot, reuse = self._slots[target.index], 0
            if target.tokens and target.session != job.session:
                evicted, evicted_tokens = target.session, len(target.tokens)
        t0 = time.perf_counter()
        kv = slot.kv
        source_slot = self._slots[donor] if donor is not None else slot
        source = source_slot.kv
        prev_len = len(source) + len(source_slot.redo)
        prev_prompt_len = slot.msg_ends[-1] if slot.msg_ends and donor is None else prev_len
        wanted = reuse  # ... if every cached position were servable as it is
        absorbed = 0
        if self.exact:  # a reply decoded token by token is not servable before its rewrite
            absorbed = max(min(wanted, prev_len) - source.exact_len, 0)
            reuse = min(reuse, source.settled)
        # where a canonical prefill of this prompt may begin (nbkv.invariance)
        reuse = invariance.valid_start(p.tokens, min(reuse, len(p.tokens) - 1),
                                       self.prefill_rule)
        target = reuse  # ... on memory that can be cut anywhere
        kv.last_restore = None
        with self._cv:
            slot.pending = True
            slot.redo.clear()
        try:
            if donor is not None:
                reuse = kv.copy_from(source, reuse)
                log.debug("imc-copy-prefix: slot[%d] -> slot[%d], %d tokens",
                          donor, slot.index, reuse)
            if self.cache == "spc":
                reuse = self._spc_restore(job, slot)
                strategy = "spc" if reuse else "miss"
            elif self.cache == "off":
                kv.clear()
                reuse = 0
            trimmed = len(kv) - reuse if self.cache == "imc" else 0
            if self.cache == "imc" and trimmed > 0:
                log.debug("imc-trim-prefix: slot[%d] cached_tokens=%d trim_pos=%d",
                          slot.index, len(kv), reuse)
            reuse = trim_valid(kv, p.tokens, reuse, self.prefill_rule)
        except BaseException:
            kv.resync()
            with self._cv:
                slot.pending = False
            raise
        restored = kv.last_restore
        restore_s = time.perf_counter() - t0
        # the previous reply, as generated, against its re-tokenization in this prompt
        reply_cached = max(prev_len - prev_prompt_len, 0) if donor is None else 0
        reply_reused = min(max(reuse - prev_prompt_len, 0), reply_cached)
        with self._cv:
            slot.session = job.session
            slot.hashes = [h for h, e in zip(p.hashes, p.ends) if e <= reuse]
            slot.msg_ends = p.ends[: len(slot.hashes)]
            slot.last_used = next(self._clock)
            slot.last_request = job.id
        job.slot = slot
        job.reuse = reuse
        job.todo = list(p.tokens[reuse:])
        if self.memory.checkpoints:
            # checkpoints at message boundaries, a few positions before the prompt's end, the
            # end, and every CHECKPOINT_INTERVAL positions (what a template drift inside a
            # long message can still salvage); each where a canonical chunk can end
            n = len(p.tokens)
            every = range(CHECKPOINT_INTERVAL, n, CHECKPOINT_INTERVAL)
            job.stops = tuple(e for e in invariance.checkpoint_stops(
                p.tokens, (*p.ends, *every, n - REPLY_TAIL, n), self.prefill_rule) if e > reuse)
        why = self._reason(job, own, reuse, target, donor)
        if evicted is not None and evicted != job.session:
            self._whereabouts[evicted] = reasons.Whereabouts(
                self._whereabouts.get(evicted, reasons.Whereabouts(0)).request,
                reasons.EVICTED, job.session, job.id)
        if job.session is not None:
            self._whereabouts[job.session] = reasons.Whereabouts(job.id)
        job.sampler = Sampler(job.params, self.model.n_vocab,
                              [t for t in p.tokens if isinstance(t, int)])
        job.record = RequestRecord(
            id=job.id, session=job.session, strategy=strategy, slot=slot.index,
            prompt_tokens=len(p.tokens), reused_tokens=reuse,
            prefilled_tokens=len(job.todo), trimmed_tokens=max(trimmed, 0) if self.cache == "imc"
            else 0,
            donor_slot=donor,
            donor_session=self._slots[donor].session if donor is not None else None,
            evicted_session=evicted, evicted_tokens=evicted_tokens,
            matched_messages=matched, reply_tokens_cached=reply_cached,
            reply_tokens_reused=reply_reused, dropped_messages=p.dropped, capacity=slot.capacity,
            restore_s=restore_s, started_at=time.time(),
            segments=self._segments(job, len(p.tokens)),
            media_chunks=p.image_chunks,
            media_reused=sum(1 for u in p.tokens[:reuse]
                             if isinstance(u, MediaUnit) and u.offset == 0),
            checkpoint_pos=restored,
            reprefilled_tokens=max(wanted - reuse - absorbed, 0) if self.cache == "imc" else 0,
            rewrite_absorbed=absorbed, exact=self.exact and self.prefill_rule.exact,
            reason=why.code, reason_text=why.text, divergence=why.divergence,
        )
        if reply_cached and reply_reused < reply_cached:
            log.debug("slot[%d] previous reply re-tokenized differently: %d/%d tokens reused",
                      slot.index, reply_reused, reply_cached)
        log.debug("%s: slot[%d] prompt=%d reused=%d prefill=%d", strategy, slot.index,
                  len(p.tokens), reuse, len(job.todo))
        self.events.publish(RequestStarted(job.record))
        return True

    def _reason(self, job: _Job, own: SlotInfo | None, reuse: int, wanted: int,
                donor: int | None) -> reasons.Reason:
        """Why ``job`` reuses ``reuse`` positions (see :mod:`nbkv.reasons`)."""
        p = job.prompt
        donor_session = None
        if donor is not None:
            donor_session = self._slots[donor].session or f"slot {donor}"
        trace = self._whereabouts.get(job.session) if job.session is not None else None
        cached = (reasons.Cached(own.tokens, own.hashes, own.msg_ends) if own is not None
                  else None)
        why = reasons.explain(
            session=job.session, trace=trace, own=cached, tokens=p.tokens, hashes=p.hashes,
            ends=p.ends, roles=[m["role"] for m in p.messages], reuse=reuse, wanted=wanted,
            donor_session=donor_session, dropped=p.dropped, can_trim=self.memory.can_trim,
            cache=self.cache)
        source = own.tokens if own is not None else (
            self._slots[donor].tokens if donor is not None else ())
        self._compared[job.id] = (tuple(source), tuple(p.tokens))
        while len(self._compared) > reasons.EXPLAINED:
            self._compared.popitem(last=False)
        return why

    def _spc_restore(self, job: _Job, slot: _Slot) -> int:
        """SPC: put the system prompt's saved KV into ``slot``; returns the tokens restored.

        On the first request with a given system prompt nothing is restored: the prompt is
        prefilled as usual and the slot's state is saved when the prefill passes its end.
        """
        p = job.prompt
        slot.kv.clear()
        if p.messages[0]["role"] != "system" or p.ends[0] < self.cache_min_tokens:
            return 0
        key = p.hashes[0]
        entry = self._spc.get(key, p.tokens)
        if entry is None:
            # saved where a canonical chunk ends at or before the system prompt's end
            at = invariance.valid_start(p.tokens, p.ends[0], self.prefill_rule)
            if at >= max(self.cache_min_tokens, self.prefill_rule.min_chunk):
                job.capture_at, job.spc_key = at, key
            return 0
        slot.kv.load_state(entry.state, entry.tokens)
        return len(slot.kv)

    def _spc_capture(self, job: _Job) -> None:
        assert job.slot is not None and job.spc_key is not None
        kv = job.slot.kv
        self._spc.put(job.spc_key, kv.save_state(), kv.tokens)
        job.capture_at = None
        log.debug("spc: saved system prompt state, %d tokens", len(kv))

    def _step(self) -> bool:
        """Advance the active requests by one step (:func:`nbkv.batching.plan_step`).

        False if nothing could run (every active request waits for the vision encoder).
        """
        for job in list(self._active):
            if job.cancel.is_set():
                if job.image_piece:  # drop the part of an image decoded so far
                    job.image_piece = 0
                    job.slot.kv.resync()
                self._finish(job, "cancelled")
        by_id = {j.id: j for j in self._active}
        generating = [j for j in self._active if j.next_token is not None]
        prefilling = []
        for j in self._active:
            if not j.todo:
                continue
            image = isinstance(j.todo[0], MediaUnit)
            stops = j.stops if j.capture_at is None else (*j.stops, j.capture_at)
            take = 0 if image else invariance.next_chunk(
                j.prompt.tokens, len(j.slot.kv), self.prefill_rule, self._batch.capacity, stops)
            prefilling.append(Prefilling(j.id, len(j.todo), j.encoding is None or
                                         j.encoding.done(), image, take))
        plan = plan_step(prefilling, len(generating))
        if plan.prefill is not None:
            job = by_id[plan.prefill]
            if not job.t_prefill:
                job.t_prefill = time.perf_counter()
        if plan.image:
            ran = self._decode_image(by_id[plan.prefill])
        elif plan.prefill is not None:
            self._prefill(by_id[plan.prefill], plan.take)
            ran = True
        else:
            ran = False
        if plan.generate:
            self._generate([j for j in generating if not j.done.is_set()])
            ran = True
        return ran

    def _decode_image(self, job: _Job) -> bool:
        """Decode the image at the head of ``job``'s prefill, if its embeddings are ready.

        Embeddings come from the cache, else the encoder runs on its own thread (the other
        requests keep decoding meanwhile). False while the encoder is still at work.
        """
        unit = job.todo[0]
        chunk = job.prompt.chunk_for(unit)
        n = chunk.n_pos
        if n >= len(job.todo):
            self._fail(job, MediaError("a prompt must not end with an image"), "error")
            return True
        h = chunk.image.hash
        emb = job.embeddings.get(h)
        if emb is None and job.encoding is not None:  # done: _step skips it until then
            fut, job.encoding = job.encoding, None
            try:
                emb = fut.result()
            except BaseException as e:  # noqa: BLE001
                self._fail(job, e, "error")
                return True
        elif emb is None:
            image, media = chunk.image, job.prompt.media
            if not self.projector.has_cached(image):
                job.encoder_runs += 1
                job.encoding = self._native.encoder().submit(self.projector.embedding, image,
                                                    _prompt=media)
                job.encoding.add_done_callback(lambda _: self._wake())
                return False
            job.embedding_hits += 1
            try:
                emb = self.projector.embedding(image, _prompt=media)
            except BaseException as e:  # noqa: BLE001
                self._fail(job, e, "error")
                return True
        elif chunk.sub_index == 0 and not job.image_piece:  # the same picture again
            job.embedding_hits += 1
        job.embeddings[h] = emb
        slot = job.slot
        # a big causal image goes in sub-batches, one per step, between the other
        # requests' tokens (a non-causal one is a single batch)
        total = self.projector.pieces(self.ctx, chunk)
        piece = job.image_piece
        try:
            self.projector.decode_chunk(self.ctx, chunk, slot.seq_id, len(slot.kv),
                                        embedding=emb, piece=piece if total > 1 else None)
        except BaseException as e:  # noqa: BLE001 - decode_chunk removed what it decoded
            job.image_piece = 0
            self._fail(job, e, "error")
            return True
        if piece + 1 < total:
            job.image_piece = piece + 1
            return True
        job.image_piece = 0
        slot.kv.extend(job.todo[:n], settled=len(slot.kv) + n)
        del job.todo[:n]
        slot.kv.checkpoint()  # a follow-up question never re-decodes the image
        self._progress(job)
        return True

    def _prefill(self, job: _Job, take: int) -> None:
        """Decode the next ``take`` prompt positions of ``job`` as one batch."""
        kv = job.slot.kv
        toks = job.todo[:take]
        batch = self._batch
        batch.clear()
        done = take >= len(job.todo)
        last = batch.add_run(toks, len(kv), kv.seq_id, done)
        t0 = time.perf_counter()
        try:
            self.ctx.decode(batch)
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e, "error")
            return
        rec = job.record
        # the positions re-read first: settled ones the grouping needs, then the previous
        # reply's (absorbed: its rewrite had not run); time the absorbed share of this chunk
        read = rec.prefilled_tokens - len(job.todo)
        lo, hi = rec.reprefilled_tokens, rec.reprefilled_tokens + rec.rewrite_absorbed
        overlap = min(hi, read + take) - max(lo, read)
        if overlap > 0:
            job.record = replace(rec, rewrite_absorbed_s=rec.rewrite_absorbed_s
                                 + overlap / take * (time.perf_counter() - t0))
        end = len(kv) + take  # only now are these positions really in the KV
        kv.extend(toks, settled=invariance.stable_end(job.prompt.tokens, end, self.prefill_rule))
        del job.todo[:take]
        try:
            if end in job.stops and kv.settled == end:
                kv.checkpoint()
            if job.capture_at is not None and end >= job.capture_at:
                if end == job.capture_at and kv.settled == end:
                    self._spc_capture(job)
                job.capture_at = None
            if done:
                self._on_logits(job, last)
            else:
                self._progress(job)
        except BaseException as e:  # noqa: BLE001
            self._fail(job, e, "error")

    def _generate(self, jobs: list[_Job]) -> None:
        """Decode the next token of every generating request: one row per sequence.

        Exactly what plain llama.cpp does, so replies equal its replies. With speculative
        decoding a guess of the following token rides along (:mod:`nbkv.drafts`): if the
        model then samples that very token, its KV and logits are already there; if not,
        the guess's position is removed.
        """
        if not jobs:
            return
        jobs.sort(key=lambda j: j.slot.seq_id)  # one micro-batch (see nbkv.batching)
        # more rows than the calibration proved would take another kernel: split the step
        limit = self.prefill_rule.gen_rows
        size = max(limit // (2 if self.speculative else 1), 1) if limit else len(jobs)
        for i in range(0, len(jobs), size):
            self._generate_rows(jobs[i:i + size])

    def _generate_rows(self, jobs: list[_Job]) -> None:
        """One generation decode for ``jobs`` (see :meth:`_generate`)."""
        batch = self._batch
        batch.clear()
        plan = []
        for job in jobs:
            tok, job.next_token = job.next_token, None
            kv = job.slot.kv
            idx = batch.add(tok, len(kv), kv.seq_id, True)
            guess = extra = None
            if job.drafter is not None and len(kv) + 2 < job.slot.capacity:
                guess = job.drafter.draft()
                if guess is not None:
                    extra = batch.add(guess, len(kv) + 1, kv.seq_id, True)
            plan.append((job, tok, idx, guess, extra))
        try:
            self.ctx.decode(batch)
        except BaseException as e:  # noqa: BLE001 - every request in the batch fails cleanly
            for job, *_ in plan:
                self._fail(job, e, "error")
            return
        single = self.prefill_rule.single_row  # then a one-row decode is a canonical row
        for job, tok, *_ in plan:
            kv = job.slot.kv
            kv.extend([tok], exact=single, settled=len(kv) + 1 if single else None)
        for job, _, idx, guess, extra in plan:
            kv = job.slot.kv
            try:
                self._on_logits(job, idx)
                if guess is not None:
                    job.drafted += 1
                if guess is not None and not job.done.is_set() and job.next_token == guess:
                    job.accepted += 1
                    job.next_token = None
                    kv.extend([guess], exact=False)
                    self._on_logits(job, extra)
                elif guess is not None and not job.done.is_set():
                    kv.resync()  # drop the wrong guess's position
            except BaseException as e:  # noqa: BLE001
                self._fail(job, e, "error")

    # ------------------------------------------------------------- rewriting replies

    def _settling_slot(self) -> _Slot | None:
        """An idle slot whose KV still holds token-by-token decodes (exact mode, IMC).

        Only the Incremental Message Cache reuses a slot's reply; SPC and "off" rebuild it.
        """
        if not self.exact or self.cache != "imc":
            return None
        for s in self._slots:
            if not s.pending and (s.redo or s.kv.needs_rewrite):
                return s
        return None

    def _settle(self, slot: _Slot) -> None:
        """Rewrite one chunk of ``slot``'s token-by-token KV as a canonical prefill.

        Called when the scheduler has nothing else to do, so it never delays a token. The
        first call trims the slot back to where a canonical prefill may begin at or before
        its settled prefix (a checkpoint on hybrid and recurrent models); each call then
        prefills one chunk of what was trimmed.
        """
        kv = slot.kv
        rule = self.prefill_rule
        t0 = time.perf_counter()
        if not slot.redo:
            tokens = list(kv.tokens)
            with self._cv:  # slots() sees the tokens and the KV change together
                kept = trim_valid(kv, tokens, kv.settled, rule)
                slot.redo = tokens[kept:]
                if not all(isinstance(t, int) for t in slot.redo):
                    slot.redo = []  # back before an image: the next request rebuilds it
                    return
            slot.rewrite_s = 0.0
            slot.rewrite_n = len(slot.redo)
        units = kv.tokens + slot.redo
        # on checkpointed memory, checkpoints near the reply's end: a reply whose last word
        # re-tokenizes differently next turn still reuses the rest
        stops = (invariance.checkpoint_stops(units, (len(units) - REPLY_TAIL, len(units)), rule)
                 if kv.memory.checkpoints else ())
        take = invariance.next_chunk(units, len(kv), rule,
                                     min(REWRITE_CHUNK, self._batch.capacity), stops)
        toks = slot.redo[:take]
        batch = self._batch
        batch.clear()
        batch.add_run(toks, len(kv), kv.seq_id, False)
        try:
            self.ctx.decode(batch)
        except BaseException:  # noqa: BLE001 - drop the tail; the next request prefills it
            log.exception("slot[%d]: rewriting a reply's KV failed", slot.index)
            slot.redo.clear()
            kv.resync()
            return
        end = len(kv) + take
        with self._cv:
            kv.extend(toks, settled=invariance.stable_end(units, end, rule))
            del slot.redo[:take]
        if end in stops and kv.settled == end:
            kv.checkpoint()
        slot.rewrite_s += time.perf_counter() - t0
        if not slot.redo:
            self.events.publish(SlotRewritten(slot.index, slot.last_request, slot.rewrite_n,
                                              slot.rewrite_s))
            log.debug("slot[%d]: rewrote %d positions in %.0f ms", slot.index,
                      slot.rewrite_n, slot.rewrite_s * 1000)

    def _progress(self, job: _Job) -> None:
        done = job.record.prefilled_tokens - len(job.todo)
        phase = "extend" if job.reuse else "rebuild"
        self.events.publish(Progress(job.id, job.slot.index, phase, done,
                                     job.record.prefilled_tokens))

    def _on_logits(self, job: _Job, idx: int) -> None:
        now = time.perf_counter()
        token = job.sampler.sample(self.ctx.ptr, idx)
        if not job.t_first:  # the first token counts once it is sampled
            job.t_first = time.perf_counter()
            job.record = replace(job.record, first_decode_s=job.t_first - now)
        if self.model.is_eog(token):
            return self._finish(job, "stop")
        job.generated.append(token)
        if job.drafter is not None:
            job.drafter.append(token)
        delta = job.text.push(self.model.text_piece(token))
        if delta:
            job.out.put(("delta", delta))
        if job.text.stopped is not None:
            return self._finish(job, "stop")
        full = len(job.slot.kv) + 1 > job.slot.capacity
        if len(job.generated) >= job.params.max_tokens or full:
            return self._finish(job, "length")
        job.next_token = token
        if now - job.t_last_progress > 0.25:
            job.t_last_progress = now
            self.events.publish(Progress(job.id, job.slot.index, "generate",
                                         len(job.generated), job.params.max_tokens))

    def _finish(self, job: _Job, reason: str, error: BaseException | None = None) -> None:
        """Close a request: settle its slot's bookkeeping, publish the record, free the slot."""
        if job.done.is_set():
            return
        if job in self._active:
            self._active.remove(job)
        if job.sampler is not None:
            job.sampler.close()
        tail = job.text.flush()
        if tail:
            job.out.put(("delta", tail))
        now = time.perf_counter()
        slot = job.slot
        rec = job.record
        if slot is not None and self.ctx.ptr:  # a guessed position may follow
            try:
                slot.kv.resync()
            except BaseException:  # noqa: BLE001 - the request must still end
                log.exception("slot[%d]: could not trim past its tokens", slot.index)
                slot.reset()
        if slot is not None and rec is not None:
            p = job.prompt
            n = len(slot.tokens)
            with self._cv:
                full = [h for h, e in zip(p.hashes, p.ends) if e <= n]
                if n >= len(p.tokens):  # the prompt is in KV; so is the reply's start
                    reply = {"role": "assistant", "content": job.text.text}
                    full = prefix_hashes(p.messages + [reply], full)
                    ends = p.ends + [len(p.tokens)]
                else:
                    ends = p.ends[: len(full)]
                slot.hashes, slot.msg_ends = full, ends
                slot.segments = tuple(s for s in (
                    replace(s, end=min(s.end, n)) for s in self._segments(job, n)) if s.length > 0)
                slot.last_used = next(self._clock)
                slot.pending = False
            t_first = job.t_first or now
            rec = replace(
                rec,
                generated_tokens=len(job.generated),
                prefilled_tokens=rec.prefilled_tokens - len(job.todo),
                ttft_s=(t_first - job.t_submit) if job.t_first else 0.0,
                prefill_s=(t_first - job.t_prefill) if job.t_prefill and job.t_first else 0.0,
                wait_s=max(job.t_prefill - job.t_submit - rec.restore_s, 0.0)
                if job.t_prefill else 0.0,
                decode_s=(now - t_first) if job.t_first else 0.0,
                finish_reason=reason,
                encoder_runs=job.encoder_runs,
                embedding_cache_hits=job.embedding_hits,
                draft_tokens=job.drafted,
                draft_accepted=job.accepted,
                error=None if error is None else f"{type(error).__name__}: {error}",
                segments=slot.segments,
            )
            job.record = rec
            if rec.strategy == policy.PREFIX_SALVAGE:
                log.debug("imc-partial-rebuilt: total_cached=%d salvaged_prefix=%d "
                          "salvaged_pct=%.0f", n, rec.reused_tokens, rec.salvage_pct)
            self.events.publish(RequestFinished(rec))
        if error is not None:
            job.out.put(("error", error))
        elif rec is not None:
            job.out.put(("done", rec))
        else:
            job.out.put(("error", NbkvError("request cancelled before it started")))
        job.done.set()
        with self._cv:
            self._cv.notify_all()

    def _fail(self, job: _Job, error: BaseException | None, reason: str) -> None:
        if job.slot is not None:
            job.slot.kv.resync()
        self._finish(job, reason, error)

    def _segments(self, job: _Job, n: int) -> tuple[Segment, ...]:
        """KV map of ``job``'s slot: message spans split by reused / prefilled / generated."""
        p = job.prompt
        out = message_segments(p.messages, p.ends, len(p.tokens), job.reuse, n, job.text.text)
        runs = [(s.start, s.end, s.image_hash, s.n_tokens)
                for s in spans(p.tokens) if s.kind == "image"]
        names = {im.hash: Path(im.source).name for im in (p.media.images if p.media else ())
                 if im.source and not im.source.startswith("data:")}
        if not runs:
            return tuple(out)
        marker = self.projector.marker if self.projector is not None else "\0"
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
                                     image_name=names.get(h, ""), embeddings=n_emb))
                pos = hi
            if pos < seg.end:
                split.append(replace(seg, start=pos, end=seg.end))
        return tuple(split)


@dataclass
class _Native:
    """The native objects an engine owns; the scheduler thread frees them when it ends."""

    model: Model
    ctx: Context
    batch: Batch
    projector: Any = None
    _encoder: ThreadPoolExecutor | None = None

    def encoder(self) -> ThreadPoolExecutor:
        """The vision encoder's thread (started on first use), off the scheduler."""
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(1, thread_name_prefix="nbkv-encoder")
        return self._encoder

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.shutdown(wait=True)
        self.batch.close()
        if self.projector is not None:
            self.projector.close()  # it points into the model: free it first
        self.ctx.close()
        self.model.close()


def _schedule(ref: weakref.ref[Engine], cv: threading.Condition, native: _Native) -> None:
    """The scheduler thread: run the engine while it is open and referenced, then free it.

    Holds the engine strongly only while it works; waits with just the weak reference, so
    dropping the last reference elsewhere collects the engine (its finalizer wakes us).
    """
    try:
        while True:
            engine = ref()
            if engine is None:
                break
            with cv:
                if not engine._has_work():
                    del engine
                    cv.wait()
                    continue
            go = engine._run_once()
            del engine
            if not go:
                break
    finally:
        native.close()


def _notify(cv: threading.Condition) -> None:
    with cv:
        cv.notify_all()
