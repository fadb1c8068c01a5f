"""A thin, typed layer over llama-cpp-python's low-level bindings.

Only this module (and ``sampling``) touches ``llama_cpp`` directly. It owns the native
objects (model, context, batch) and frees them; it knows nothing about caching policy.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from nbkv.core.errors import DecodeError, KVOrderError, ModelLoadError, ModelNotFoundError
from nbkv.core.events import KVCounters
from nbkv.llama.gguf_header import check_complete
from nbkv.llama.models import display_name
from nbkv.llama.state_buffers import StateBuffers
from nbkv.llama.tokens import Batch, DeviceGreedy

log = logging.getLogger("nbkv.llama")
# llama.cpp's and libmtmd's own log reach the user only through logging: without a handler
# of its own, a WARNING would go to logging's last resort, stderr, which a notebook shows
# in every cell (libmtmd's "Qwen-VL models require at minimum 1024 image tokens ...")
log.addHandler(logging.NullHandler())

STATE_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

# ggml_log_level -> logging level
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_last_level = logging.DEBUG
_init_lock = threading.Lock()
_initialized = False
_errors: collections.deque[str] = collections.deque(maxlen=20)
_buffers: list[float] = []  # KV / recurrent buffer sizes llama.cpp logs while creating a context


@llama_cpp.llama_log_callback
def log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    """Route llama.cpp's (and libmtmd's) log to the ``nbkv.llama`` logger; keep its errors."""
    # llama.cpp logs line fragments; level 5 (CONT) continues the previous level
    global _last_level
    lvl = _last_level if level == 5 else _LEVELS.get(level, logging.DEBUG)
    _last_level = lvl
    if lvl == logging.DEBUG and b" buffer size = " not in text and not log.isEnabledFor(lvl):
        return  # a decode's debug lines (graph inputs) cost no more than this when not shown
    msg = text.decode("utf-8", errors="replace").rstrip("\n")
    if not msg:
        return
    if lvl >= logging.ERROR:
        _errors.append(msg.strip())
    if " buffer size = " in msg and ("KV buffer" in msg or "RS buffer" in msg):
        try:
            _buffers.append(float(msg.rsplit("=", 1)[1].split()[0]))  # MiB
        except (IndexError, ValueError):
            pass
    if log.isEnabledFor(lvl):
        log.log(lvl, "%s", msg)


def take_native_errors() -> str:
    """The last error lines native code logged since the previous call (for messages)."""
    msgs = list(_errors)
    _errors.clear()
    return "; ".join(msgs[-3:])


_mtmd_lock = threading.Lock()
_mtmd: Any = None


def mtmd_lib() -> Any:
    """``llama_cpp.mtmd_cpp`` (imported lazily: it loads libmtmd), logging routed to Python."""
    global _mtmd
    with _mtmd_lock:
        if _mtmd is None:
            from llama_cpp import mtmd_cpp

            mtmd_cpp.mtmd_log_set(log_callback, ctypes.c_void_p(0))
            mtmd_cpp.mtmd_helper_log_set(log_callback, ctypes.c_void_p(0))
            _mtmd = mtmd_cpp
    return _mtmd


def llama_cpp_version() -> str:
    """The llama-cpp-python version (it pins the llama.cpp build)."""
    return str(llama_cpp.__version__)


def system_info() -> str:
    """llama.cpp's CPU features and backends (``AVX2 = 1 | ... | REPACK = 1``)."""
    init_backend()
    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def default_threads() -> int:
    """Threads llama.cpp and libmtmd use when none are given: the CPUs this process has.

    The affinity mask and the cgroup's CPU quota, whichever is smaller
    (:func:`nbkv.llama.cpus.cpu_budget`): in a container, every core of the node is visible
    but only the quota's share can run.
    """
    from nbkv.llama.cpus import cpu_budget

    return cpu_budget().threads


def init_backend() -> None:
    """Initialise llama.cpp once, its log routed to the ``nbkv.llama`` logger."""
    global _initialized
    with _init_lock:
        if not _initialized:
            llama_cpp.llama_backend_init()
            llama_cpp.llama_log_set(log_callback, ctypes.c_void_p(0))
            _initialized = True


def check_gguf(path: str | os.PathLike) -> Path:
    """Raise a clear error unless ``path`` is an existing, plausibly whole GGUF file.

    llama.cpp is asked to load a file only after this check, so a wrong path or a truncated
    download fails in Python with a message instead of deep in native code.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelNotFoundError(f"no model file at {p}")
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ModelLoadError(f"{p} is not a GGUF model file (bad magic, {size} bytes)")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise ModelLoadError(f"{p}: unsupported GGUF version {version}")
    try:
        check_complete(p)
    except ValueError as e:
        raise ModelLoadError(f"{p} is not a whole GGUF file: {e}") from None
    return p


class Model:
    """A loaded GGUF model and its vocabulary."""

    #: how prompts must be grouped for exact caching (a :class:`nbkv.kv.invariance.PrefillRule`,
    #: set by the engine that calibrated this model)
    prefill_rule: Any = None

    @property
    def exactness(self) -> str:
        """What nbkv proved about cached KV on this model, in words."""
        rule = self.prefill_rule
        return rule.describe() if rule is not None else "exact: not calibrated"

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0,
                 on_progress: Callable[[float], object] | None = None, *, main_gpu: int = 0,
                 split_mode: int = llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                 tensor_split: Sequence[float] | None = None, use_mmap: bool = True,
                 use_mlock: bool = False) -> None:
        init_backend()
        self.path = check_gguf(path)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.main_gpu = main_gpu
        params.split_mode = split_mode
        self._tensor_split = None
        if tensor_split:
            self._tensor_split = (ctypes.c_float * len(tensor_split))(*tensor_split)
            params.tensor_split = self._tensor_split
        params.load_mode = (
            (llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK if use_mlock else llama_cpp.LLAMA_LOAD_MODE_MMAP)
            if use_mmap else
            (llama_cpp.LLAMA_LOAD_MODE_MLOCK if use_mlock else llama_cpp.LLAMA_LOAD_MODE_NONE))
        self.params = params

        @llama_cpp.llama_progress_callback
        def progress(fraction: float, _user: ctypes.c_void_p) -> bool:
            if on_progress is not None:
                try:
                    on_progress(float(fraction))
                except Exception:  # a UI callback must not abort the load
                    log.exception("model load progress callback failed")
            return True

        params.progress_callback = progress  # also silences llama.cpp's default dots
        ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path} (corrupt, truncated or an unsupported "
                "architecture; set logging.getLogger('nbkv.llama') to DEBUG for its log)"
            )
        self.ptr = ptr
        self.vocab = llama_cpp.llama_model_get_vocab(ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(ptr)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self._pieces: dict[int, bytes] = {}
        self._text: dict[int, bytes] = {}  # text_piece, cached as piece
        self._emitted: dict[int, bytes | None] = {}  # emitted, cached
        self.bos_text = self._special_text(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos_text = self._special_text(llama_cpp.llama_vocab_eos(self.vocab))

    def _special_text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", errors="replace") if token >= 0 else ""

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None."""
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    @property
    def chat_template(self) -> str | None:
        """The model's own ``tokenizer.chat_template``, if it ships one."""
        return self.meta("tokenizer.chat_template")

    @property
    def description(self) -> str:
        """Architecture, size and quantization, as llama.cpp describes the model."""
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.ptr, buf, 256)
        return buf.value.decode()

    @property
    def n_params(self) -> int:
        """Number of parameters."""
        return int(llama_cpp.llama_model_n_params(self.ptr))

    @property
    def name(self) -> str:
        """What people call the model, its parameters and quantization.

        E.g. ``SmolLM2-135M-Instruct (135M parameters, Q4_1)``: a known model's name
        (:data:`nbkv.llama.models.KNOWN_MODELS`), else the file's name (GGUF ``general.name`` is
        often a training run's, such as "Smollm2 135M 8k Lc100K Mix1 Ep2").
        """
        n = self.n_params
        count = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
        quant = self.description.rsplit(" ", 1)[-1]
        return f"{display_name(self.path)} ({count} parameters, {quant})"

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Tokenize ``text``; control tokens such as ``<|im_start|>`` are parsed as special."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens rendered as their text), cached."""
        p = self._pieces.get(token)
        if p is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, True)
            p = self._pieces[token] = buf.raw[:n]
        return p

    def text_piece(self, token: int) -> bytes:
        """The bytes a token contributes to generated text (control tokens contribute none)."""
        p = self._text.get(token)
        if p is None:
            control = llama_cpp.llama_vocab_is_control(self.vocab, token)
            p = self._text[token] = b"" if control else self.piece(token)
        return p

    def detokenize(self, tokens: Iterable[int]) -> str:
        """Tokens back to text, special tokens included."""
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def emitted(self, token: int) -> bytes | None:
        """A generated token's reply bytes (:meth:`text_piece`), cached; None: it ends the reply."""
        try:
            return self._emitted[token]
        except KeyError:
            eog = llama_cpp.llama_vocab_is_eog(self.vocab, token)
            p = self._emitted[token] = None if eog else self.text_piece(token)
            return p

    @property
    def is_recurrent(self) -> bool:
        """Every layer keeps a recurrent state (Mamba, RWKV): no KV positions to trim."""
        return bool(llama_cpp.llama_model_is_recurrent(self.ptr))

    @property
    def is_hybrid(self) -> bool:
        """Attention layers mixed with recurrent ones (LFM2, Granite-H, Jamba, Qwen3-Next)."""
        return bool(llama_cpp.llama_model_is_hybrid(self.ptr))

    @property
    def n_swa(self) -> int:
        """Sliding-window size of the model's SWA layers; 0 when it has none."""
        return int(llama_cpp.llama_model_n_swa(self.ptr))

    @property
    def has_encoder(self) -> bool:
        """An encoder-decoder model (T5 and the like)."""
        return bool(llama_cpp.llama_model_has_encoder(self.ptr))

    @property
    def has_decoder(self) -> bool:
        """The model can generate text."""
        return bool(llama_cpp.llama_model_has_decoder(self.ptr))

    @property
    def n_embd(self) -> int:
        """Width of the hidden state (and of the token embeddings)."""
        return int(llama_cpp.llama_model_n_embd(self.ptr))

    @property
    def n_embd_inp(self) -> int:
        """Width of the input embeddings (what a vision projector must produce).

        ``n_embd``, except for DeepStack models (Qwen3-VL): ``n_embd * (1 + layers)``, the
        main embedding followed by one slice per DeepStack layer (zeros for text tokens).
        """
        return int(llama_cpp.llama_model_n_embd_inp(self.ptr))

    @property
    def rope_type(self) -> str:
        """``"none"``, ``"norm"``, ``"neox"``, or ``"mrope-N"`` for multi-axis kinds."""
        t = int(llama_cpp.llama_model_rope_type(self.ptr))
        return {llama_cpp.LLAMA_ROPE_TYPE_NONE: "none", llama_cpp.LLAMA_ROPE_TYPE_NORM: "norm",
                llama_cpp.LLAMA_ROPE_TYPE_NEOX: "neox"}.get(t, f"mrope-{t}")

    def close(self) -> None:
        """Free the model's memory."""
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """One llama.cpp context with ``n_seq_max`` sequences, each with its own KV stream.

    ``kv_unified=False`` gives every sequence a private KV buffer of ``n_ctx / n_seq_max``
    cells laid out exactly as in a fresh single-sequence context, which keeps cached
    results bit-identical to from-scratch ones.
    """

    def __init__(
        self,
        model: Model,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int = 512,
        n_threads: int | None = None,
        kv_unified: bool = False,
        flash_attn: int = 0,
        swa_full: bool = True,
        type_k: int = llama_cpp.GGML_TYPE_F16,
        type_v: int = llama_cpp.GGML_TYPE_F16,
        fixed_rows: int = 0,
        device_sampling: bool = True,
    ) -> None:
        self.model = model
        #: every text decode padded to this many rows with rows of a scratch sequence, the
        #: last one (0: off): one batch shape, so the kernels choose one algorithm
        self.fixed_rows = fixed_rows
        self.scratch = n_seq_max if fixed_rows else -1
        if fixed_rows:
            if fixed_rows > n_batch or fixed_rows > n_ctx // n_seq_max:
                raise ValueError(f"fixed_rows {fixed_rows} must fit n_batch ({n_batch}) and a "
                                 f"sequence's context ({n_ctx // n_seq_max})")
            n_ctx, n_seq_max = n_ctx + n_ctx // n_seq_max, n_seq_max + 1
        p = llama_cpp.llama_context_default_params()
        p.flash_attn_type = flash_attn
        p.type_k = type_k
        p.type_v = type_v
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_batch
        p.n_seq_max = n_seq_max
        p.kv_unified = kv_unified
        # a full-size SWA cache keeps every position of the sliding-window layers, so that a
        # trim can go back further than the window (a trim below what a window-sized cache
        # still holds returns true but gives wrong logits)
        p.swa_full = swa_full
        threads = n_threads or default_threads()
        p.n_threads = threads
        p.n_threads_batch = threads
        p.no_perf = True
        _buffers.clear()
        ptr = llama_cpp.llama_init_from_model(model.ptr, p)
        #: what llama.cpp allocated for the KV cache and recurrent states (from its log)
        self.kv_buffer_bytes = int(sum(_buffers) * 2**20)
        self.params = p
        if not ptr:
            raise ModelLoadError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})"
            )
        self.ptr = ptr
        self.mem = llama_cpp.llama_get_memory(ptr)
        self.n_ctx = llama_cpp.llama_n_ctx(ptr)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(ptr)
        self.n_batch = llama_cpp.llama_n_batch(ptr)
        self.n_seq_max = n_seq_max - bool(fixed_rows)  # the caller's sequences
        self.buffers = StateBuffers()
        #: ``(src, dst)`` of the copies whose data llama.cpp runs at the next decode
        self.queued_copies: list[tuple[int, int]] = []
        #: decode calls, rows, time inside llama.cpp, state bytes and copies (nbkv.core.events)
        self.counters = KVCounters()
        #: greedy sampling in the graph for the sequences the engine names (nbkv.llama.tokens)
        self.sampling = DeviceGreedy(ptr, device_sampling)

    def decode(self, batch: Batch, padded: int = 0) -> None:
        """Run the model on ``batch``; raise :class:`DecodeError` on failure.

        ``padded``: of the batch's rows, those that only pad it to a fixed shape (counted).
        """
        n = batch.n
        if 0 < n < self.fixed_rows:  # rows of the scratch sequence, no logits
            padded = self.fixed_rows - n
            for i in range(padded):
                batch.add(0, i, self.scratch, False)
        c0, t0 = time.thread_time(), time.perf_counter()
        rc = llama_cpp.llama_decode(self.ptr, batch.raw)
        self.counters.decoded(batch.n, time.perf_counter() - t0, padded, time.thread_time() - c0)
        if self.fixed_rows:
            batch.n = n
            llama_cpp.llama_memory_seq_rm(self.mem, self.scratch, -1, -1)
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} on a batch of {batch.n} tokens")
        self.queued_copies.clear()  # a decode starts by running them
        self.sampling.decoded()

    def copy_queued(self, seq: int) -> bool:
        """A copy from or into ``seq`` waits for the next decode (see :meth:`seq_cp`)."""
        return any(seq in pair for pair in self.queued_copies)

    def logits(self, index: int) -> ctypes.Array:
        """Logits row of batch position ``index`` from the last decode (a view, not a copy)."""
        if self.sampling.seqs:  # not copied out: sampled in the graph
            raise RuntimeError("logits read while sampling in the graph: call sampling.use(())")
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, index)
        return (ctypes.c_float * self.model.n_vocab).from_address(ctypes.addressof(ptr.contents))

    def try_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq``; False when the memory cannot do it."""
        return bool(llama_cpp.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove positions ``[p0, p1)`` of sequence ``seq`` (-1: open end)."""
        if not self.try_seq_rm(seq, p0, p1):
            raise DecodeError(f"could not remove positions [{p0}, {p1}) of sequence {seq}")

    def seq_pos_min(self, seq: int) -> int:
        """Smallest position held by ``seq``, -1 if empty."""
        return llama_cpp.llama_memory_seq_pos_min(self.mem, seq)

    def seq_pos_max(self, seq: int) -> int:
        """Largest position held by ``seq``, -1 if empty."""
        return llama_cpp.llama_memory_seq_pos_max(self.mem, seq)

    def seq_cp(self, src: int, dst: int) -> None:
        """Copy all of sequence ``src`` into ``dst``.

        Only whole sequences: with non-unified KV a partial range aborts the process. The
        cells' metadata is copied at once, but llama.cpp *queues* the data of the attention
        layers (a whole-stream copy) and runs it at the start of the next ``llama_decode``.
        Until then ``src``'s state must not be written, nor ``dst``'s read or written: the copy
        would carry, or be overwritten by, other KV. :meth:`state_get` and :meth:`state_set`
        refuse that with :class:`KVOrderError`; :meth:`copy_queued` tells the caller to wait.
        """
        llama_cpp.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        self.counters.copies += 1
        if src != dst and not self.params.kv_unified:
            self.queued_copies.append((src, dst))

    def state_get(self, seq: int, partial: bool = False) -> ctypes.Array:
        """The state of sequence ``seq``, as a ctypes byte array (restored without copies).

        ``partial`` keeps only what a trim cannot restore (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY):
        the recurrent state, or the sliding-window layers' window: a *checkpoint*. A whole
        state is written into a buffer handed back by :meth:`recycle` when one fits.
        """
        if any(dst == seq for _, dst in self.queued_copies):
            raise KVOrderError(f"sequence {seq}'s state was read while a copy into it waits for "
                               "the next decode")
        flags = STATE_PARTIAL if partial else 0
        size = llama_cpp.llama_state_seq_get_size_ext(self.ptr, seq, flags)
        buf = None if partial else self.buffers.take(size)
        if buf is None:
            buf = (ctypes.c_uint8 * size)() if partial else self.buffers.fresh(size)
        n = llama_cpp.llama_state_seq_get_data_ext(self.ptr, buf, size, seq, flags)
        if n != size:
            raise DecodeError(f"could not read the state of sequence {seq} ({n}/{size} bytes)")
        self.counters.state_reads += 1
        self.counters.bytes_read += size
        return buf

    def recycle(self, state: Any) -> bool:
        """Hand back a whole state nothing else refers to, for the next :meth:`state_get`.

        Reading a state into a fresh buffer pays for the allocation and for the first touch
        of every page (page faults); a buffer used before is already mapped. The caller must
        hold the only reference (checked: one still read elsewhere, by a save in progress
        say, is not taken).
        """
        return self.buffers.give(state, owners=2)  # the caller's, and this parameter

    def state_set(self, seq: int, state: ctypes.Array, partial: bool = False) -> None:
        """Load a state from :meth:`state_get` into sequence ``seq``.

        A whole state goes into an empty sequence; a partial one over a sequence that holds
        at least the positions it was taken at (trim past them afterwards). A partial state
        (the recurrent part, which a copy takes at once) may go into the destination of a
        queued copy; nothing may go into its source (:meth:`seq_cp`).
        """
        if any(src == seq or (dst == seq and not partial) for src, dst in self.queued_copies):
            raise KVOrderError(f"a state was to be written into sequence {seq} while a copy "
                               "from or into it waits for the next decode")
        size = ctypes.sizeof(state)
        flags = STATE_PARTIAL if partial else 0
        if llama_cpp.llama_state_seq_set_data_ext(self.ptr, state, size, seq, flags) != size:
            self.seq_rm(seq)
            raise DecodeError(f"could not restore a saved state into sequence {seq}")
        self.counters.state_writes += 1
        self.counters.bytes_written += size

    @property
    def n_ubatch(self) -> int:
        """Micro-batch size: the most tokens one compute graph takes."""
        return int(llama_cpp.llama_n_ubatch(self.ptr))

    def decode_embeddings(self, embd: np.ndarray, positions: np.ndarray, seq: int,
                          logits_last: bool = False, causal: bool = True) -> None:
        """Decode rows of input embeddings (an image chunk's) into ``seq`` in one call.

        ``embd`` is ``(k, n_embd)`` float32; ``positions`` is ``(n_axes, k)`` int32, one row per
        position axis (4 for M-RoPE, else 1), laid out axis-major as llama.cpp reads it.
        ``causal=False`` attends over all ``k`` rows at once (gemma3's images). Raises
        :class:`DecodeError`; the caller removes what a failed decode left.
        """
        k = embd.shape[0]
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        seq_arr = (llama_cpp.llama_seq_id * 1)(seq)
        seq_p = ctypes.cast(seq_arr, ctypes.POINTER(llama_cpp.llama_seq_id))
        seq_ptrs = (ctypes.POINTER(llama_cpp.llama_seq_id) * k)(*([seq_p] * k))
        n_seq = (ctypes.c_int32 * k)(*([1] * k))
        logits = (ctypes.c_int8 * k)()
        if logits_last:
            logits[k - 1] = 1
        batch = llama_cpp.llama_batch(
            n_tokens=k,
            token=None,
            embd=embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos=pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos)),
            n_seq_id=ctypes.cast(n_seq, ctypes.POINTER(ctypes.c_int32)),
            seq_id=ctypes.cast(seq_ptrs, ctypes.POINTER(ctypes.POINTER(llama_cpp.llama_seq_id))),
            logits=ctypes.cast(logits, ctypes.POINTER(ctypes.c_int8)),
        )
        if not causal:
            llama_cpp.llama_set_causal_attn(self.ptr, False)
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            rc = llama_cpp.llama_decode(self.ptr, batch)
        finally:
            self.counters.decoded(k, time.perf_counter() - t0, cpu=time.thread_time() - c0)
            if not causal:
                llama_cpp.llama_set_causal_attn(self.ptr, True)
        if rc == 0:
            self.queued_copies.clear()
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} on {k} input embeddings "
                              f"(sequence {seq}, position {int(pos[0, 0])})")

    def clear(self) -> None:
        """Empty every sequence."""
        llama_cpp.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        """Free the context."""
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
            self.sampling.close()
