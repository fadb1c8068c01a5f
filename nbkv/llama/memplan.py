"""The memory plan: how many bytes each slot's KV will take, computed before llama.cpp allocates.

From the GGUF metadata (layers, KV heads per layer, head dimensions, recurrent state sizes)
and the chosen KV types. nbkv keeps sliding-window layers at full size (``swa_full``), gives
each slot its own stream of ``n_ctx`` cells, and recurrent layers one f32 state per slot.
:func:`check_fits` refuses a configuration that cannot fit the free memory, with the figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nbkv.core.errors import InsufficientMemoryError
from nbkv.llama.hardware import kv_type_size

HEADROOM = 0.9  # share of the free memory a plan may take (the rest: compute buffers, Python)
STATE_BYTES = 4  # recurrent states are f32


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the KV of ``n_slots`` slots of ``n_ctx`` tokens will take."""

    n_slots: int
    n_ctx: int  # per slot
    kv_bytes_per_token: float  # attention layers, K + V, per KV cell
    state_bytes_per_slot: int  # recurrent layers, per sequence
    attention_layers: int
    recurrent_layers: int
    type_k: str
    type_v: str
    shadow: int = 0  # sequences beside the slots, as large as one (nbkv.engine.rewrite)

    @property
    def per_slot(self) -> int:
        """Bytes one slot takes."""
        return int(self.kv_bytes_per_token * self.n_ctx) + self.state_bytes_per_slot

    @property
    def total(self) -> int:
        """Bytes all slots take (and the shadow sequence, if any)."""
        return self.per_slot * (self.n_slots + self.shadow)

    def describe(self) -> str:
        """``4 slots x 4096 tokens: 90.0 MiB per slot (22.5 KiB per token, f16/f16), 360 MiB``."""
        parts = []
        if self.attention_layers:
            parts.append(f"{self.kv_bytes_per_token / 1024:.1f} KiB per token "
                         f"(K {self.type_k}, V {self.type_v})")
        if self.recurrent_layers:
            parts.append(f"{self.state_bytes_per_slot / 2**20:.2f} MiB recurrent state")
        shadow = " (+1 for the reply rewrite)" if self.shadow else ""
        return (f"{self.n_slots} slots{shadow} x {self.n_ctx} tokens: {_mib(self.per_slot)} "
                f"per slot ({', '.join(parts)}), {_mib(self.total)} in all")


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _per_layer(value: Any, n_layer: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value[:n_layer]] + [0] * max(n_layer - len(value), 0)
    return [int(value)] * n_layer


def plan(meta: dict[str, Any], n_slots: int, n_ctx: int, type_k: str = "f16",
         type_v: str = "f16", recurrent: bool = False, hybrid: bool = False,
         shadow: int = 0) -> MemoryPlan:
    """The plan for a model with GGUF metadata ``meta`` (as ``read_metadata`` reads it).

    ``recurrent``/``hybrid`` come from llama.cpp (``llama_model_is_recurrent`` / ``_hybrid``):
    a hybrid model's recurrent layers are those with no KV heads. ``shadow``: sequences of
    one slot's size beside the slots (counted in :attr:`MemoryPlan.total`).
    """
    arch = str(meta.get("general.architecture", ""))

    def get(key: str, default: Any = 0) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_layer = int(get("block_count"))
    n_embd = int(get("embedding_length"))
    n_head = _per_layer(get("attention.head_count", 1), n_layer)
    n_head_kv = _per_layer(get("attention.head_count_kv", get("attention.head_count", 0)),
                           n_layer)
    head = max(n_head) or 1
    dk = int(get("attention.key_length", n_embd // head if head else 0))
    dv = int(get("attention.value_length", dk))
    if recurrent:
        attn = [False] * n_layer
    elif hybrid:
        attn = [h > 0 for h in n_head_kv]
    else:
        attn = [True] * n_layer
    per_token = sum(n_head_kv[i] * (dk * kv_type_size(type_k) + dv * kv_type_size(type_v))
                    for i in range(n_layer) if attn[i])
    n_recurrent = sum(1 for a in attn if not a)
    state = n_recurrent * (_state_r(get, n_embd) + _state_s(get, n_embd)) * STATE_BYTES
    return MemoryPlan(n_slots, n_ctx, per_token, state, n_layer - n_recurrent, n_recurrent,
                      type_k, type_v, shadow if not (recurrent or hybrid) else 0)


def _state_r(get: Any, n_embd: int) -> int:
    """Elements of a recurrent layer's rolling (convolution / token-shift) state."""
    if get("wkv.head_size"):
        return int(get("token_shift_count", 2)) * n_embd
    if get("shortconv.l_cache"):
        return n_embd * (int(get("shortconv.l_cache")) - 1)
    d_conv, d_inner = int(get("ssm.conv_kernel")), int(get("ssm.inner_size"))
    return max(d_conv - 1, 0) * (d_inner + 2 * int(get("ssm.group_count", 0))
                                 * int(get("ssm.state_size")))


def _state_s(get: Any, n_embd: int) -> int:
    """Elements of a recurrent layer's hidden state."""
    if get("wkv.head_size"):
        return n_embd * int(get("wkv.head_size"))
    return int(get("ssm.state_size")) * int(get("ssm.inner_size"))


def free_memory() -> int:
    """Bytes of RAM available to a new allocation (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62  # unknown: do not refuse


def kv_memory(gpu_layers: int | None) -> tuple[int, str]:
    """Free bytes where the KV goes (the GPUs' when layers are offloaded, else RAM) and where."""
    from nbkv.llama.hardware import devices, gpu_offload

    gpus = [d for d in devices() if d.kind in ("gpu", "igpu")]
    if gpus and gpu_offload() and gpu_layers != 0:
        return sum(d.free for d in gpus), "GPU memory (" + ", ".join(d.name for d in gpus) + ")"
    return free_memory(), "RAM"


def fit_sentence(p: MemoryPlan, free: int, where: str, picked: str = "") -> str:
    """What the plan takes of the free memory, computed from the plan itself.

    ``picked`` names what was chosen for the user (``"4 slots"``); e.g. ``picked 4 slots:
    4 slots x 4096 tokens take 360.0 MiB of KV, 2% of the 21.3 GiB of free RAM``.
    """
    share = 100 * p.total / free if free else 0.0
    head = f"picked {picked}: " if picked else ""
    return (f"{head}{p.n_slots} slots x {p.n_ctx} tokens take {_mib(p.total)} of KV, "
            f"{share:.0f}% of the {_mib(free)} of free {where}")


def context_warning(n_ctx: int, n_ctx_train: int) -> str | None:
    """A warning when a slot holds more tokens than the model was trained for."""
    if not n_ctx_train or n_ctx <= n_ctx_train:
        return None
    return (f"warning: each slot holds {n_ctx} tokens, past the {n_ctx_train} this model was "
            f"trained for: beyond {n_ctx_train} tokens of conversation its replies degrade, "
            f"and the extra KV memory buys nothing (use --ctx {n_ctx_train} or less)")


def check_fits(p: MemoryPlan, free: int, where: str = "RAM") -> None:
    """Raise :class:`InsufficientMemoryError` if ``p`` needs more than ``free`` allows."""
    budget = int(free * HEADROOM)
    if p.total <= budget:
        return
    fit_slots = budget // p.per_slot if p.per_slot else 0
    fit_ctx = (budget // p.n_slots - p.state_bytes_per_slot) / p.kv_bytes_per_token \
        if p.kv_bytes_per_token else 0
    hints = []
    if fit_slots >= 1:
        hints.append(f"{fit_slots} slot(s) of {p.n_ctx} tokens")
    if fit_ctx >= 256:
        hints.append(f"{p.n_slots} slots of {int(fit_ctx) // 256 * 256} tokens")
    if p.type_k == "f16" or p.type_v == "f16":
        hints.append("a quantized KV type (type_k='q8_0', type_v='q8_0', flash_attn='on' "
                     "halves it)")
    raise InsufficientMemoryError(
        f"the KV cache would need {_mib(p.total)} ({p.describe()}), but only "
        f"{_mib(free)} of {where} is free ({_mib(budget)} usable); try "
        + ("; or ".join(hints) if hints else "a smaller model"))


def default_size(meta: dict[str, Any], free: int, *, type_k: str = "f16", type_v: str = "f16",
                 recurrent: bool = False, hybrid: bool = False, n_ctx_train: int = 0,
                 share: float = 0.25) -> tuple[int, int]:
    """``(n_slots, n_ctx)`` for a load that names neither.

    4 x 4096 when that fits in ``share`` of the free memory, else fewer tokens, then fewer
    slots (at least 1 x 512).
    """
    budget = free * share
    for n_slots, n_ctx in ((4, 4096), (4, 2048), (2, 2048), (2, 1024), (1, 1024), (1, 512)):
        if n_ctx_train and n_ctx > n_ctx_train:
            continue
        p = plan(meta, n_slots, n_ctx, type_k, type_v, recurrent, hybrid)
        if p.total <= budget:
            return n_slots, n_ctx
    return 1, 512
