"""Where the model runs and how its KV is stored: GPU offload, KV cache types, flash attention.

:class:`HardwareOptions` collects the llama.cpp settings that decide whether a model fits and
runs fast, and checks them in Python with named errors before llama.cpp sees them.
:func:`devices` lists what the build can run on (the ggml backend registry).
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp

from nbkv.core.errors import InvalidRequestError

log = logging.getLogger("nbkv")

#: KV cache types llama.cpp accepts, with their size in bytes per element
KV_TYPES: dict[str, tuple[int, float]] = {
    "f32": (llama_cpp.GGML_TYPE_F32, 4.0),
    "f16": (llama_cpp.GGML_TYPE_F16, 2.0),
    "bf16": (30, 2.0),  # GGML_TYPE_BF16
    "q8_0": (llama_cpp.GGML_TYPE_Q8_0, 34 / 32),
    "q5_1": (llama_cpp.GGML_TYPE_Q5_1, 24 / 32),
    "q5_0": (llama_cpp.GGML_TYPE_Q5_0, 22 / 32),
    "q4_1": (llama_cpp.GGML_TYPE_Q4_1, 20 / 32),
    "q4_0": (llama_cpp.GGML_TYPE_Q4_0, 18 / 32),
    "iq4_nl": (llama_cpp.GGML_TYPE_IQ4_NL, 18 / 32),
}
FLASH_ATTN = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
              "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}
SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
               "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}


def quantized(kv_type: str) -> bool:
    """True for the block-quantized KV types (not f32/f16/bf16)."""
    return kv_type not in ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Device:
    """One compute device of the ggml backend registry."""

    name: str
    description: str
    kind: str  # "cpu", "gpu", "igpu" or "accel"
    free: int  # bytes, as the backend reports them
    total: int


_DEV_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def devices() -> list[Device]:
    """The devices this llama.cpp build can use (CPU included)."""
    lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
    try:
        g = ctypes.CDLL(str(next(lib.glob("libggml.so*"), lib / "libggml.so")))
        g.ggml_backend_dev_count.restype = ctypes.c_size_t
        g.ggml_backend_dev_get.restype = ctypes.c_void_p
        g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(g, name).restype = ctypes.c_char_p
            getattr(g, name).argtypes = [ctypes.c_void_p]
        g.ggml_backend_dev_type.restype = ctypes.c_int
        g.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        g.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                              ctypes.POINTER(ctypes.c_size_t)]
    except (OSError, AttributeError) as e:  # another build layout: say what we know
        log.debug("ggml backend registry not readable: %s", e)
        return []
    llama_cpp.llama_backend_init()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        g.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        out.append(Device(g.ggml_backend_dev_name(d).decode(),
                          g.ggml_backend_dev_description(d).decode(),
                          _DEV_KINDS.get(g.ggml_backend_dev_type(d), "?"), free.value,
                          total.value))
    return out


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan, ...)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


@dataclass(frozen=True)
class HardwareOptions:
    """llama.cpp's placement and KV settings (see the README's "Hardware and memory").

    ``n_gpu_layers=None`` offloads every layer when the build has a GPU backend, else none.
    ``flash_attn`` is ``"auto"``, ``"on"`` or ``"off"`` (``True``/``False`` work too).
    A quantized ``type_v`` needs flash attention in llama.cpp.
    """

    n_gpu_layers: int | None = None
    main_gpu: int = 0
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] | None = None
    flash_attn: str = "off"
    type_k: str = "f16"
    type_v: str = "f16"
    use_mmap: bool = True
    use_mlock: bool = False
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        fa = self.flash_attn
        if isinstance(fa, bool):
            object.__setattr__(self, "flash_attn", "on" if fa else "off")
        elif fa not in FLASH_ATTN:
            raise InvalidRequestError(f"flash_attn must be 'auto', 'on' or 'off', not {fa!r}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPES:
                raise InvalidRequestError(
                    f"{name} must be one of {sorted(KV_TYPES)}, not {getattr(self, name)!r}")
        if self.split_mode not in SPLIT_MODES:
            raise InvalidRequestError(
                f"split_mode must be one of {sorted(SPLIT_MODES)}, not {self.split_mode!r}")
        if self.n_gpu_layers is not None and (not isinstance(self.n_gpu_layers, int)
                                              or self.n_gpu_layers < -1):
            raise InvalidRequestError("n_gpu_layers must be an integer >= -1 (-1: all layers)")
        if self.main_gpu < 0:
            raise InvalidRequestError("main_gpu must be >= 0")
        if self.tensor_split is not None:
            ts = tuple(float(x) for x in self.tensor_split)
            if not ts or any(x < 0 for x in ts) or sum(ts) <= 0:
                raise InvalidRequestError("tensor_split must be non-negative shares, not all 0")
            object.__setattr__(self, "tensor_split", ts)
        if quantized(self.type_v) and self.flash_attn == "off":
            raise InvalidRequestError(
                f"type_v={self.type_v!r} needs flash attention in llama.cpp (a quantized V "
                "cache is only read by the flash-attention kernel): pass flash_attn='on'")
        warnings = []
        if self.n_gpu_layers not in (None, 0) and not gpu_offload():
            warnings.append(f"n_gpu_layers={self.n_gpu_layers}: this llama.cpp build has no "
                            "GPU backend, so every layer runs on the CPU")
        object.__setattr__(self, "warnings", tuple(warnings))

    @property
    def gpu_layers(self) -> int:
        """The layer count passed to llama.cpp (``None`` resolved against the build)."""
        if self.n_gpu_layers is None:
            return -1 if gpu_offload() else 0
        return self.n_gpu_layers if gpu_offload() else 0

    def check_exact(self, exact: bool) -> None:
        """``exact=True`` with flash attention holds only when K and V are both quantized.

        llama.cpp's CPU flash-attention kernel tiles a batch of 64+ queries (and splits one
        query over long caches) when K and V are f16, which rounds differently from smaller
        batches; with quantized K and V it always takes the per-query path, batch-invariant.
        """
        if exact and self.flash_attn == "on" and not (quantized(self.type_k)
                                                      and quantized(self.type_v)):
            raise InvalidRequestError(
                "exact=True with flash attention needs quantized type_k and type_v (e.g. "
                "'q8_0'): with f16 KV llama.cpp's CPU flash-attention kernel rounds "
                "differently for batches of 64+ tokens; pass flash_attn='off' or exact=False")

    def resolved_flash_attn(self, exact: bool) -> str:
        """``auto`` made concrete for an exact engine: on only where it keeps exactness."""
        if self.flash_attn != "auto" or not exact:
            return self.flash_attn
        return "on" if quantized(self.type_k) and quantized(self.type_v) else "off"


def kv_type_id(name: str) -> int:
    """The ggml type id of a KV cache type name."""
    return KV_TYPES[name][0]


def kv_type_size(name: str) -> float:
    """Bytes per element of a KV cache type."""
    return KV_TYPES[name][1]


def describe_devices(devs: Sequence[Device]) -> str:
    """``CPU (AMD EPYC)`` or ``CUDA0 (RTX 4090, 22.1/24.0 GiB free)``."""
    parts = []
    for d in devs:
        mem = (f", {d.free / 2**30:.1f}/{d.total / 2**30:.1f} GiB free"
               if d.kind != "cpu" and d.total else "")
        parts.append(f"{d.name} ({d.description}{mem})")
    return ", ".join(parts) or "unknown"


def as_options(**kwargs: Any) -> HardwareOptions:
    """:class:`HardwareOptions` from Engine keyword arguments (``None`` = the default)."""
    return HardwareOptions(**{k: v for k, v in kwargs.items() if v is not None
                              or k == "n_gpu_layers"})
