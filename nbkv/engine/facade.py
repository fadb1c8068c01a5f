"""The engine: one llama.cpp context, N slots (= sequences), and a scheduler thread.

A facade: the public API over the pieces that do the work. :mod:`nbkv.engine.native` owns the
model, context, batch and projector; :mod:`nbkv.kv.slot_table` knows which conversation sits
in which slot; :mod:`nbkv.engine.scheduler` is the thread that alone touches the KV (placement,
prefill, generation, the idle reply rewrite); :mod:`nbkv.kv.spc` keeps system prompts;
:mod:`nbkv.engine.state` turns the caches into data for :mod:`nbkv.store.persist`. The
control calls (parking by hand, clearing, the probe, the caches as data) are inherited from
:class:`nbkv.engine.calls.ControlCalls`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from nbkv.core import api
from nbkv.core.api import ChatAPI, TemplatedAPI, request_totals, thrashing
from nbkv.core.config import (
    EngineSettings,
    ExactnessSettings,
    HardwareSettings,
    ParkingSettings,
    SlotSettings,
)
from nbkv.core.errors import EngineClosedError, InvalidRequestError
from nbkv.core.events import EventBus, ParkingDropped, SlotsChanged
from nbkv.core.progress import Reporter
from nbkv.core.progress import resolve as resolve_progress
from nbkv.core.streams import ChatStream, SamplingParams, TextStream
from nbkv.engine import verify
from nbkv.engine.calls import ControlCalls
from nbkv.engine.core import EngineCore
from nbkv.engine.drafts import NgramDrafter
from nbkv.engine.jobs import Job
from nbkv.engine.native import Resources, close_at_exit, forget_at_exit
from nbkv.engine.proving import forget
from nbkv.engine.scheduler import Scheduler
from nbkv.engine.slots import EngineSlot, EngineTable
from nbkv.kv import admission
from nbkv.kv.invariance import PrefillRule
from nbkv.kv.oracle import Verification
from nbkv.kv.slot_kv import SlotKV
from nbkv.kv.slot_table import SlotInfo
from nbkv.kv.spc import SystemPromptStore
from nbkv.llama.hardware import offload_warnings
from nbkv.media.embeddings import EmbeddingCache
from nbkv.media.units import MediaUnit
from nbkv.prompt.builder import Prompt, PromptBuilder
from nbkv.store.parking import Dropped, ParkedInfo, ParkingLot, parking_stats

log = logging.getLogger("nbkv")

IMAGES_KEPT = 16  # pictures of recent prompts kept for verify()

__all__ = ["Engine", "SlotInfo", "thrashing"]


class Engine(TemplatedAPI, ChatAPI, ControlCalls):
    """A persistent multi-slot chat engine with Incremental Message and System Prompt Caches.

    One llama.cpp context holds ``n_slots`` sequences, each a conversation kept in KV, so a
    new turn prefills only what the model has not seen. ``model_path`` is a GGUF file
    (``None``: ``$NBKV_MODEL`` or the embedded SmolLM2-135M). The settings are one
    :class:`~nbkv.core.config.EngineSettings` (``settings``), its groups (``slots``,
    ``parking``, ``hardware``, ``exactness``) or their fields as flat keywords
    (``n_slots=2, cache="spc", park_dir=...``), checked before the model loads; the docs'
    "Engine options" page says what each one is for. ``progress`` says where the
    load's long steps are shown and ``on_load_progress`` is called with the fraction of the
    model loaded. A model never calibrated on this build and CPU serves at once (the default
    ``calibration="background"``), records saying ``exact=False`` until the exactness proof
    ends in idle time (:meth:`wait_proven`); ``calibration="cached"`` measures during the load.

    Use it as a context manager, or call :meth:`close`; a closed engine spills what its
    slots and parking hold to ``park_dir`` when it has one.
    """

    #: ``chat(..., replay=True)`` is understood (a re-run notebook cell asks for it)
    replays = True
    last_save: Any = None  # the latest nbkv.store.persist.SaveReport
    last_restore: Any = None  # the latest nbkv.store.persist.RestoreReport

    #: the thread that alone touches the KV (composed here, and imported nowhere else)
    scheduler: Scheduler

    def __init__(
        self,
        model_path: str | None = None,
        *,
        settings: EngineSettings | None = None,
        slots: SlotSettings | None = None,
        parking: ParkingSettings | None = None,
        hardware: HardwareSettings | None = None,
        exactness: ExactnessSettings | None = None,
        progress: Reporter | bool | None = None,
        on_load_progress: Callable[[float], object] | None = None,
        embedding_cache: EmbeddingCache | None = None,
        **options: Any,
    ) -> None:
        if model_path is not None:
            options["model_path"] = model_path
        # every setting checked at once, before anything loads (nbkv.core.config)
        self.settings = settings = EngineSettings.of(settings, {
            "slots": slots, "parking": parking, "hardware": hardware, "exactness": exactness,
        }, **options)
        for warning in offload_warnings(settings.hardware):
            log.warning("%s", warning)
            warnings.warn(warning, stacklevel=2)
        self.res = res = Resources(settings, embedding_cache=embedding_cache,
                                   on_load_progress=on_load_progress,
                                   progress=resolve_progress(progress))
        self.sized, self.plan = res.sized, res.plan
        self.model, self.ctx, self.memory, self.projector = (res.model, res.ctx, res.memory,
                                                             res.projector)
        self.template, self.n_threads = res.template, res.n_threads
        if settings.exactness.speculative and not res.speculative:
            log.info("speculative guesses are off: %s memory cannot drop a wrong guess",
                     self.memory.kind)
        self.n_ctx = self.ctx.n_ctx_seq
        try:
            self._start()
        except BaseException:
            res.close()
            raise
        close_at_exit(self)
        log.info("nbkv engine: %s, %s memory, %d slots x %d tokens, cache=%s, %s threads",
                 self.model.description, self.memory.kind, self.n_slots, self.n_ctx,
                 self.cache, self.n_threads)

    def _start(self) -> None:
        """The caches, the slot table and the scheduler thread over loaded resources."""
        slots, park = self.settings.slots, self.settings.parking
        budget = slots.checkpoint_bytes
        if budget is None and self.memory.kind == "sliding-window":
            budget = self.plan.per_slot
        self._prompts = PromptBuilder(self.model, self.template, self.projector, self.n_ctx)
        self.events = EventBus(slots.history_size)
        self.table = EngineTable(  # its lock is the scheduler's condition variable too
            [EngineSlot(i, self.n_ctx, kv=SlotKV(self.ctx, i, self.memory,
                                                 slots.max_checkpoints, budget))
             for i in range(self.res.n_slots)], threading.Condition())
        self.spc = SystemPromptStore(slots.spc_max_entries)
        #: conversations that lost their slot, in RAM and on disk (None: parking is off)
        self.parking = None
        if slots.cache == "imc" and (park.park_ram != 0 or park.park_dir is not None):
            self.parking = ParkingLot(park.park_ram, park.park_dir, park.park_disk,
                                      {**self.identity(), "n_slots": self.n_slots,
                                       "kv_streams": self.kv_streams},
                                      self.model.n_vocab, _announce_drops(self.events))
        shadow = None  # the sequence that rewrites replies while they are generated
        if self.res.shadow_seq is not None:
            shadow = SlotKV(self.ctx, self.res.shadow_seq, self.memory, slots.max_checkpoints)
        #: what the scheduler and the control calls share (nbkv.engine.core)
        self.core = core = EngineCore(self.res, self.settings, self.table, self.events,
                                      self.spc, self.parking, self._prompts)
        self.scheduler = Scheduler(core, shadow)
        self.scheduler.start(self)
        before = {i.key: i for i in self.parking.entries()} if self.parking is not None else {}
        core.proof = self.res.start_proof(core.busy, self.scheduler.wake, before)

    @property
    def cache(self) -> str:
        """The cache mode: ``"imc"``, ``"spc"`` or ``"off"``."""
        return self.settings.slots.cache

    @property
    def cache_min_tokens(self) -> int:
        """The shortest prefix worth salvaging (IMC) or system prompt worth caching (SPC)."""
        return self.settings.slots.cache_min_tokens

    @property
    def exact(self) -> bool:
        """Exactness asked for (:attr:`prefill_rule` says whether it is proven)."""
        return self.settings.exactness.exact

    @property
    def hardware(self) -> HardwareSettings:
        """llama.cpp's threads, batch, placement and KV types, as asked for."""
        return self.settings.hardware

    @property
    def flash_attn(self) -> str:
        """Flash attention as it runs (``auto`` made concrete)."""
        return self.settings.flash_attn

    @property
    def speculative(self) -> bool:
        """Speculative guesses are on (asked for, and the memory can drop a wrong one)."""
        return bool(self.res.speculative)

    # ------------------------------------------------------------------ public API

    @property
    def prefill_rule(self) -> PrefillRule:
        """How prompts are grouped for exact caching, as proven (:mod:`nbkv.kv.invariance`)."""
        rule: PrefillRule = self.res.rule
        return rule

    def wait_proven(self, timeout: float | None = None) -> bool:
        """Wait for a background proof (``calibration="background"``, the default) to be adopted.

        True once :attr:`prefill_rule` is final (at once if nothing was left to prove);
        False if ``timeout`` seconds passed first.
        """
        proof = self.core.proof
        return proof is None or proof.wait(timeout)

    @property
    def n_slots(self) -> int:
        """Number of slots."""
        return len(self.table)

    @property
    def kv_streams(self) -> int:
        """The context's KV streams: one per slot, and the exact mode's shadow sequence."""
        return int(self.ctx.params.n_seq_max)

    def _submit(self, messages: Sequence[Mapping[str, Any]], session: str | None,
                overflow: str | None, timeout: float | None, replay: bool = False,
                **sampling: Any) -> ChatStream:
        """Queue one checked request for the scheduler (``replay``: see :meth:`chat`)."""
        t0 = time.perf_counter()
        params = SamplingParams.from_kwargs(**sampling)
        slots = self.settings.slots
        prompt = self._prepare(messages, overflow or slots.overflow, params.max_tokens)
        job = Job(prompt, session, params, slots.wait_timeout if timeout is None else timeout,
                  TextStream(params.stop), replay=bool(replay),
                  drafter=NgramDrafter(prompt.tokens) if self.speculative else None)
        job.t_submit = t0
        self.scheduler.submit(job)
        return ChatStream(self, job)

    @contextlib.contextmanager
    def hold_admission(self) -> Iterator[None]:
        """Queue requests without admitting them; on exit, they are admitted in one pass.

        Requests sent inside the ``with`` block wait in the queue; when it ends, the
        scheduler admits them together, in the order they were sent, in one admission pass
        (what concurrent callers get when they arrive within one decode step). Tests use it
        to make "several admissions in one pass" happen on purpose, not by timing.
        """
        self.scheduler.hold(True)
        try:
            yield
        finally:
            self.scheduler.hold(False)

    def slots(self) -> tuple[SlotInfo, ...]:
        """An immutable snapshot of every slot."""
        return self.table.snapshots()

    def parked(self) -> tuple[ParkedInfo, ...]:
        """The parked conversations, most recently used first (see :mod:`nbkv.store.parking`)."""
        return self.parking.entries() if self.parking is not None else ()

    def identity(self) -> dict[str, Any]:
        """What a saved or parked state depends on: model, projector, build, n_ctx, KV."""
        return self.res.identity(self.n_ctx, self.hardware.type_k, self.hardware.type_v,
                                 self.flash_attn)

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
            if self.table[rec.slot].last_request != request:
                raise InvalidRequestError(
                    f"slot {rec.slot} no longer holds request #{request}'s conversation")
            slot = rec.slot
        probe = api.token("probe", probe, self.model.n_vocab)
        targets = [self.table.index(slot)] if slot is not None else [
            s.index for s in self.slots() if not s.empty]
        return [verify.verify_slot(self.core, i, probe) for i in targets]

    def explain(self, request: int | None = None) -> admission.Explanation:
        """The full story of request ``request`` (default: the latest).

        Its reason, and the cached and new renderings split at the divergence point (kept
        for the last 32 requests).
        """
        return self.table.explain(self.history, self._text_of, request)

    def _text_of(self, units: Sequence[Any]) -> str:
        """Text of KV units: tokens detokenized, each image as ``[image]``."""
        out: list[str] = []
        run: list[int] = []
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

    def save(self, path: str | None = None, sessions: Any = None,
             progress: Reporter | bool | None = None) -> Any:
        """Save the slots, system prompts, image embeddings and sessions to disk.

        ``path``: a directory (default: one per notebook under the user's cache dir).
        Replies still decoding are not saved; finished replies are rewritten first (exact
        mode), so the saved KV is what a from-scratch prefill computes. Atomic: a crash
        mid-save leaves the previous save. See :mod:`nbkv.store.persist`; returns a report.
        A save of 64 MiB or more shows its progress (``progress``, as :class:`Engine`'s).
        """
        from nbkv.store.persist import save

        return save(self, path, sessions, progress=progress)

    def restore(self, path: str | None = None, sessions: Any = None,
                progress: Reporter | bool | None = None, *, trust: bool = False) -> Any:
        """Replace the slots and caches with a save (from this or an earlier process).

        Checks everything first: a save from another model, projector, llama.cpp build or
        ``n_ctx``, or a corrupt one, raises :class:`~nbkv.core.errors.RestoreError` and leaves
        the engine unchanged. With fewer slots than saved, the most recently used are kept.
        A save not signed by your key raises :class:`~nbkv.core.errors.UntrustedSaveError`;
        ``trust=True`` restores it, recomputing every slot by a full prefill first. Reading
        64 MiB or more shows its progress.
        """
        from nbkv.store.persist import restore

        return restore(self, path, sessions, progress=progress, trust=trust)

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
            "spc_entries": len(self.spc),
            **parking_stats(self.parking),
            **thrashing(h, self.n_slots),
        }

    def counters(self) -> dict[str, Any]:
        """The fixed cost so far: decode calls, rows, host time by part, bytes moved.

        From :class:`nbkv.core.events.KVCounters`, read between steps, plus ``path``:
        ``"exact"`` or ``"lean"`` (exactness not proven or not asked for).
        """
        snap = self.core.call(self.ctx.counters.snapshot)
        return {**snap, "path": self.res.path}

    def close(self) -> None:
        """Cancel running requests, stop the scheduler and free the model and context.

        Optional: an engine nobody references is closed by garbage collection, and one
        still open at interpreter exit by an ``atexit`` hook.
        """
        if self.core.closed:
            return
        lot = self.parking
        on_thread = threading.current_thread() is self.scheduler.thread  # (a subscriber)
        if lot is not None and lot.disk is not None and not on_thread:  # slots, RAM: to disk
            def spill() -> int:
                proof = self.core.proof
                if proof is not None and proof.pending():  # never spill unproven KV
                    forget(proof, self.table, self.spc, lot, self.scheduler.shadow)
                self.core.rewriter.settle_all()  # whole replies parked: rewritten first
                return self.core.parker.spill_all()

            try:
                self.core.call(spill)
            except Exception:  # noqa: BLE001 - closing must not fail
                log.exception("could not spill the parked conversations to disk at close")
        self.scheduler.stop()
        if lot is not None:
            lot.close()
        self.spc.clear()
        forget_at_exit(self)
        self.events.publish(SlotsChanged("closed"))

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.core.closed

    def wake(self) -> None:
        """Let the scheduler look at its requests now (a stream was cancelled)."""
        self.scheduler.wake()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str, max_tokens: int
                 ) -> Prompt:
        if self.core.closed:
            raise EngineClosedError("this engine is closed")
        prompt = self._prompts.prepare(messages, overflow, max_tokens)
        images = self.core.images
        for im in prompt.media.images if prompt.media is not None else ():
            images[im.hash] = im
            images.move_to_end(im.hash)
            while len(images) > IMAGES_KEPT:
                images.popitem(last=False)
        return prompt


def _announce_drops(events: EventBus) -> Callable[[Dropped], None]:
    """The parking lot's ``on_drop``: each conversation it drops, as a ParkingDropped event.

    It holds the event bus, not the engine: a lot that referred back to its engine would keep
    a dropped engine alive until the next garbage collection, and its scheduler thread with it.
    """
    def announce(d: Dropped) -> None:
        events.publish(ParkingDropped(d.session, d.key, d.n_tokens, d.tier, d.why))

    return announce
