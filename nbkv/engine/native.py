"""The native objects an engine owns, set up in order and freed in reverse, once.

:class:`Resources` loads the model, sizes the KV (:mod:`nbkv.llama.memplan`), creates the context
and batch, probes the memory class, calibrates the prefill grouping (:mod:`nbkv.kv.calibrate`)
and opens the vision projector. Whatever fails, everything created before it is freed by the
one :meth:`Resources.close`, which is also what the scheduler thread calls when it ends.

At interpreter exit, engines nobody closed are closed by an ``atexit`` hook *before* module
teardown: a scheduler thread still inside llama.cpp while Python tears itself down crashes the
process (a segmentation fault after the script's last line). SIGTERM and SIGHUP, which end the
process without ``atexit``, close them too (:mod:`nbkv.core.signals`): a ``park_dir`` gets
what they hold, as after Ctrl-C.
"""

from __future__ import annotations

import atexit
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from nbkv.core.config import EngineSettings, HardwareSettings
from nbkv.core.errors import NbkvError
from nbkv.core.progress import Reporter, Task
from nbkv.core.signals import close_on_signal, release
from nbkv.engine.proving import NOT_PROVEN, BackgroundProof
from nbkv.kv import calibrate, invariance
from nbkv.kv.invariance import PrefillRule
from nbkv.kv.slot_kv import PLAIN, SWA, MemoryInfo, classify, probe_memory
from nbkv.llama import memplan
from nbkv.llama.backend import Batch, Context, Model, default_threads, llama_cpp_version
from nbkv.llama.gguf_header import gguf_fingerprint, read_metadata
from nbkv.llama.hardware import FLASH_ATTN, SPLIT_MODES, gpu_layers, kv_type_id
from nbkv.llama.models import display_name, resolve_model_path
from nbkv.prompt.templates import CHATML, ChatTemplate

log = logging.getLogger("nbkv")

#: with ``calibration="background"``, a model this small (parameters) is still proven during
#: its load: the proof takes seconds there, against minutes for a model of billions
QUICK_PROOF_PARAMS = 400_000_000


class Resources:
    """Model, context, batch, memory class, prefill rule and projector of one engine."""

    model: Model
    ctx: Context
    batch: Batch
    memory: MemoryInfo
    projector: Any = None

    def __init__(self, settings: EngineSettings, *, embedding_cache: Any,
                 on_load_progress: Callable[[float], object] | None,
                 progress: Reporter) -> None:
        self._closers: list[Callable[[], None]] = []
        exactness = settings.exactness
        #: exactness asked for (``exact=True``): the exact path where the rule is proven
        self.exact = exactness.exact
        #: the sequence that rewrites replies while they are generated (nbkv.engine.rewrite),
        #: after the slots' (None: none; wanted in exact IMC mode unless rewrite="idle",
        #: kept where the memory can be cut)
        self.shadow_seq: int | None = None
        self.proving = False  # a background proof is to run (calibration="background")
        self._want_shadow = (exactness.exact and settings.slots.cache == "imc"
                             and exactness.rewrite != "idle")
        self._lock = threading.Lock()
        self.sized = ""
        self.progress = progress
        try:
            self._open(settings, embedding_cache, on_load_progress)
        except BaseException:
            self.close()
            raise
        #: speculative guesses: asked for, and the memory can drop a wrong one
        self.speculative = exactness.speculative and self.memory.can_trim

    def _own(self, obj: Any, close: Callable[[], None] | None = None) -> Any:
        """Keep ``obj``, freed (in reverse order of creation) by :meth:`close`."""
        self._closers.append(close or obj.close)
        return obj

    def _open(self, settings: EngineSettings, embedding_cache: Any,
              on_load_progress: Callable[[float], object] | None) -> None:
        hw, model = settings.hardware, settings.model
        flash_attn, n_batch, template = settings.flash_attn, hw.n_batch, model.template
        path = resolve_model_path(model.model_path)
        size = path.stat().st_size if path.is_file() else 0
        label = f"loading {display_name(path)} ({size / 2**20:.0f} MiB)"
        with Task(self.progress, label, total=100, unit="%", tick=0.5) as task:

            def loaded(fraction: float) -> None:
                task.update(90 * fraction)
                if on_load_progress is not None:
                    on_load_progress(fraction)

            self.model = self._own(Model(
                path, gpu_layers(hw), loaded, main_gpu=hw.main_gpu,
                split_mode=SPLIT_MODES[hw.split_mode], tensor_split=hw.tensor_split,
                use_mmap=hw.use_mmap, use_mlock=hw.use_mlock))
            source = template or self.model.chat_template or CHATML
            self.template = ChatTemplate(source, self.model.bos_text, self.model.eos_text)
            given = (settings.slots.n_slots, settings.slots.n_ctx)
            n_slots, n_ctx = self._size(path, given, hw)
            slot_ctx = -(-max(n_ctx, 256) // 256) * 256
            task.update(90, what=f"{label}, then its KV cache: {n_slots} slots x {slot_ctx} tokens")
            if model.mmproj is not None:  # a non-causal image must fit one micro-batch
                from nbkv.media.projector_check import batch_for_projector

                n_batch = batch_for_projector(model.mmproj, self.model, n_batch)
            past = memplan.context_warning(slot_ctx, self.model.n_ctx_train)
            if past:
                log.warning("%s", past)
                warnings.warn(past, stacklevel=4)
            if self._want_shadow and classify(self.model) in (PLAIN, SWA):
                self.shadow_seq = n_slots
            n_seq = n_slots + (self.shadow_seq is not None)
            self.ctx = self._own(Context(
                self.model, slot_ctx * n_seq, n_seq, n_batch, hw.n_threads,
                flash_attn=FLASH_ATTN[flash_attn], type_k=kv_type_id(hw.type_k),
                type_v=kv_type_id(hw.type_v), fixed_rows=hw.fixed_rows,
                device_sampling=hw.device_sampling))
            # fixed-shape decodes: no chunk over the fixed row count
            self.batch = self._own(Batch(hw.fixed_rows or self.ctx.n_batch))
            self.memory = probe_memory(self.model, self.ctx, self.batch)
            task.update(100)
        #: threads llama.cpp runs (given, else what the CPU budget allows: nbkv.llama.cpus)
        self.n_threads = hw.n_threads or default_threads()
        #: the context settings a temporary context must share to compute the same logits
        self.settings = {"n_threads": self.n_threads,
                         "flash_attn": FLASH_ATTN[flash_attn],
                         "type_k": kv_type_id(hw.type_k), "type_v": kv_type_id(hw.type_v),
                         **({"fixed_rows": hw.fixed_rows} if hw.fixed_rows else {})}
        self.rule = self._calibrate(settings.exactness.calibration)
        self.model.prefill_rule = self.proven
        if model.mmproj is not None:
            from pathlib import Path

            from nbkv.media.projector import Projector

            name = Path(model.mmproj).name
            with Task(self.progress, f"opening the vision projector {name}",
                      "checked, then loaded by libmtmd", tick=0.5):
                self.projector = self._own(Projector(
                    model.mmproj, self.model, cache=embedding_cache, n_threads=hw.n_threads,
                    trust_projector=model.trust_projector, flash_attn=FLASH_ATTN[flash_attn]))

    def _size(self, path: Any, given: tuple[int | None, int | None], hw: HardwareSettings
              ) -> tuple[int, int]:
        """Slots and tokens per slot: ``given``, or picked by the memory plan (None)."""
        meta = read_metadata(path)
        free, where = memplan.kv_memory(self.model.params.n_gpu_layers)
        n_slots, n_ctx = given
        picked = " and ".join(w for w, g in zip(("slots", "tokens per slot"), given)
                              if g is None)
        if n_slots is None or n_ctx is None:
            auto_slots, auto_ctx = memplan.default_size(
                meta, free, type_k=hw.type_k, type_v=hw.type_v,
                recurrent=self.model.is_recurrent, hybrid=self.model.is_hybrid,
                n_ctx_train=self.model.n_ctx_train)
            n_slots = auto_slots if n_slots is None else n_slots
            n_ctx = auto_ctx if n_ctx is None else n_ctx
        self.n_slots = n_slots  # the config's slot count and size, as plain numbers
        slot_ctx = -(-max(n_ctx, 256) // 256) * 256
        self.plan = memplan.plan(meta, n_slots, slot_ctx, hw.type_k, hw.type_v,
                                 self.model.is_recurrent, self.model.is_hybrid,
                                 shadow=int(self._want_shadow))
        if hw.check_memory:
            memplan.check_fits(self.plan, free, where)
        #: what the memory plan picked, in words ("" when the caller gave both sizes)
        self.sized = memplan.fit_sentence(self.plan, free, where, picked) if picked else ""
        if self.sized:
            log.info("%s", self.sized)
        return n_slots, n_ctx

    def _calibrate(self, mode: str) -> PrefillRule:
        """The model's prefill rule (:mod:`nbkv.kv.calibrate`), checked against ``n_batch``.

        ``mode="background"`` and nothing cached: a model of up to :data:`QUICK_PROOF_PARAMS`
        parameters is measured now, as ``"cached"`` does (its proof takes seconds, and a proof
        adopted later would drop what the first cells cached); a larger one gets the unproven
        rule, and :attr:`proving` says a proof is to run (:meth:`start_proof`, once the
        scheduler exists).
        """
        shadow = self.shadow_seq is not None
        if mode == "background":
            found = calibrate.known(self.model, n_seq=self.n_slots,
                                    can_trim=self.memory.can_trim, settings=self.settings,
                                    shadow=shadow)
            if found is not None:
                return self.checked(found)
            if self.model.n_params > QUICK_PROOF_PARAMS:
                self.proving = True
                return PrefillRule(2, 1, exact=False, reason=NOT_PROVEN)
            mode = "cached"
        try:
            rule = calibrate.calibrate(self.model, n_seq=self.n_slots,
                                       can_trim=self.memory.can_trim, settings=self.settings,
                                       cache=mode == "cached", progress=self.progress,
                                       shadow=shadow)
        except (NbkvError, RuntimeError) as e:  # e.g. no room for the temporary context
            rule = PrefillRule(2, 1, exact=False, reason=f"the calibration failed: {e}")
        return self.checked(rule)

    def start_proof(self, busy: Callable[[], bool], wake: Callable[[], None],
                    parked: dict[str, Any]) -> BackgroundProof | None:
        """Start the background proof :meth:`_calibrate` left to do (None: none to do).

        ``parked``: the parked entries now (those still the same after the proof are kept).
        It is stopped first when the resources close (it uses the model).
        """
        if not self.proving:
            return None
        proof = BackgroundProof(self, busy, wake, cache=True)
        proof.parked_before = parked
        self._own(proof, proof.stop)
        log.info("nbkv serves %s now and proves its exact grouping in the background: "
                 "records say exact=False until then", self.model.path.name)
        proof.start()
        return proof

    def checked(self, rule: PrefillRule) -> PrefillRule:
        """``rule``, unless ``n_batch`` is too small for it; an inexact one is announced."""
        # next_chunk can then always leave the last chunk threshold rows
        need = max(2 * rule.threshold + rule.align - 2, rule.min_chunk)
        if rule.exact and self.batch.capacity < need:
            rule = replace(rule, exact=False, reason=(
                f"n_batch {self.batch.capacity} is too small: this model needs prompt chunks "
                f"of {rule.min_chunk}+ rows, so n_batch >= {need}"))
        if not rule.exact:
            msg = (f"nbkv cannot prove cached replies exact on {self.model.path.name}: "
                   f"{rule.reason}; it serves from cache anyway and marks records exact=False")
            log.warning("%s", msg)
            warnings.warn(msg, stacklevel=5)
        return rule

    @property
    def rule(self) -> PrefillRule:
        """The grouping prefills follow: the calibrated rule on the exact path, else lean.

        The lean one is :func:`nbkv.kv.invariance.lean`; setting it sets the calibrated rule.
        """
        return self._grouping

    @rule.setter
    def rule(self, rule: PrefillRule) -> None:
        self.proven = rule  # what the calibration found (the model's exactness)
        self._grouping = (rule if self.exact and rule.exact else invariance.lean(
            rule, "" if not rule.exact else "exact=False: not asked for"))

    @property
    def lean(self) -> bool:
        """The lean path: exactness not proven or not asked for (see :attr:`rule`)."""
        return not self._grouping.exact

    @property
    def path(self) -> str:
        """``"exact"`` or ``"lean"``, as records name it."""
        return "lean" if self.lean else "exact"

    def identity(self, n_ctx: int, type_k: str, type_v: str, flash_attn: str
                 ) -> dict[str, Any]:
        """The facts a saved or parked state depends on (compared field by field)."""
        proj = self.projector
        return {
            "model": {"name": self.model.path.name,
                      "fingerprint": gguf_fingerprint(self.model.path)},
            "projector": None if proj is None else {"name": proj.path.name,
                                                    "fingerprint": proj.identity},
            "llama_cpp_python": llama_cpp_version(),
            "n_ctx": n_ctx,
            "memory": self.memory.kind,
            "kv": {
                "type_k": type_k,
                "type_v": type_v,
                "kv_unified": bool(self.ctx.params.kv_unified),
                "swa_full": bool(self.ctx.params.swa_full),
                "flash_attn": flash_attn,
            },
        }

    def close(self) -> None:
        """Free everything, newest first (the projector points into the model); once."""
        with self._lock:
            closers, self._closers = self._closers, []
        for close in reversed(closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - free the rest anyway
                log.exception("freeing a native object failed")



class Closable(Protocol):
    """Anything with a ``close()``."""

    def close(self) -> None:
        """Release what it holds."""


_open_engines: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(engine: Closable) -> None:
    """Close ``engine`` at interpreter exit, or on SIGTERM/SIGHUP, if nobody has by then."""
    _open_engines.add(engine)
    close_on_signal(engine)


def forget_at_exit(engine: Closable) -> None:
    """``engine`` closed: nothing left to close at exit (the last one restores the handlers)."""
    _open_engines.discard(engine)
    release(engine)


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            log.debug("closing an engine at exit failed", exc_info=True)
