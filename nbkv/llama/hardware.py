"""Where the model runs and how its KV is stored: GPU offload, KV cache types, flash attention.

:class:`HardwareSettings` collects the llama.cpp settings that decide whether a model fits and
runs fast, and checks them in Python with named errors before llama.cpp sees them.
:func:`devices` lists what the build can run on (the ggml backend registry).
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp

from nbkv.core.config import KV_TYPE_SIZES, HardwareSettings

log = logging.getLogger("nbkv")

#: the ggml type of each KV cache type name (:data:`nbkv.core.config.KV_TYPE_SIZES`)
KV_TYPES: dict[str, int] = {
    "f32": llama_cpp.GGML_TYPE_F32,
    "f16": llama_cpp.GGML_TYPE_F16,
    "bf16": 30,  # GGML_TYPE_BF16
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q5_1": llama_cpp.GGML_TYPE_Q5_1,
    "q5_0": llama_cpp.GGML_TYPE_Q5_0,
    "q4_1": llama_cpp.GGML_TYPE_Q4_1,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
    "iq4_nl": llama_cpp.GGML_TYPE_IQ4_NL,
}
FLASH_ATTN = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
              "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}
SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
               "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}


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


def gpu_layers(hw: HardwareSettings) -> int:
    """The layer count passed to llama.cpp (``None`` resolved against the build)."""
    if hw.n_gpu_layers is None:
        return -1 if gpu_offload() else 0
    return hw.n_gpu_layers if gpu_offload() else 0


def offload_warnings(hw: HardwareSettings) -> list[str]:
    """What the user should know about ``hw`` on this build (a GPU asked for, none there)."""
    if hw.n_gpu_layers not in (None, 0) and not gpu_offload():
        return [f"n_gpu_layers={hw.n_gpu_layers}: this llama.cpp build has no GPU backend, so "
                "every layer runs on the CPU"]
    return []


def kv_type_id(name: str) -> int:
    """The ggml type id of a KV cache type name."""
    return KV_TYPES[name]


def kv_type_size(name: str) -> float:
    """Bytes per element of a KV cache type."""
    return KV_TYPE_SIZES[name]


def describe_devices(devs: Sequence[Device]) -> str:
    """``CPU (AMD EPYC)`` or ``CUDA0 (RTX 4090, 22.1/24.0 GiB free)``."""
    parts = []
    for d in devs:
        mem = (f", {d.free / 2**30:.1f}/{d.total / 2**30:.1f} GiB free"
               if d.kind != "cpu" and d.total else "")
        parts.append(f"{d.name} ({d.description}{mem})")
    return ", ".join(parts) or "unknown"
