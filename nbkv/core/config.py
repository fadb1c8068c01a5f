"""The engine's settings that the magics, the traits and :class:`~nbkv.Engine` share.

One place for each choice and its default, so ``%kvcache load``, ``%config Nbkv`` and
``Engine(...)`` cannot disagree. Pure data: importing it loads no model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbkv.core import validate
from nbkv.core.errors import InvalidRequestError

CACHE_MODES = ("imc", "spc", "off")  # whole conversations, system prompt only, nothing
OVERFLOW_POLICIES = ("error", "slide")  # raise, or drop the oldest turns


@dataclass(frozen=True)
class EngineConfig:
    """Cache settings of an engine (see :class:`~nbkv.Engine` for each one)."""

    n_slots: int = 4
    n_ctx: int = 4096
    cache: str = "imc"
    cache_min_tokens: int = 100
    overflow: str = "error"

    def __post_init__(self) -> None:
        check_engine_args(n_slots=self.n_slots, n_ctx=self.n_ctx, cache=self.cache,
                          cache_min_tokens=self.cache_min_tokens, overflow=self.overflow)


def check_overflow(overflow: str) -> str:
    """``overflow`` if it is a known policy, else :class:`InvalidRequestError`."""
    if overflow not in OVERFLOW_POLICIES:
        raise InvalidRequestError(
            f"overflow must be one of {OVERFLOW_POLICIES}, not {overflow!r}")
    return overflow


#: the engine's integer arguments: name -> (least value, None allowed, what to know)
WHOLE_ARGS: dict[str, tuple[int, bool, str]] = {
    "n_slots": (1, True, "None: sized from the memory plan"),
    "n_ctx": (1, True, "None: sized from the memory plan"),
    "cache_min_tokens": (0, False, ""),
    # a decode step can hold two rows (a probe, a guess beside its token): never one
    "n_batch": (2, False, "tokens per llama_decode call; a step may decode two rows"),
    "n_threads": (1, True, "None: one per core"),
    "spc_max_entries": (1, False, "cache='off' caches nothing"),
    "max_checkpoints": (0, False, ""),
    "checkpoint_bytes": (0, True, "None: as much as a slot's KV on sliding-window models"),
    "history_size": (1, False, "request records kept"),
    "park_ram": (0, True, "None: a quarter of the free RAM, at most 4 GiB; 0: no RAM tier"),
    "park_disk": (0, True, "None: a quarter of the free disk, at most 16 GiB"),
}
#: :class:`~nbkv.llama.hardware.HardwareOptions` fields, checked there (it loads llama.cpp)
HARDWARE_ARGS = ("n_gpu_layers", "main_gpu", "split_mode", "tensor_split", "flash_attn",
                 "type_k", "type_v", "use_mmap", "use_mlock")


def check_engine_args(**args: Any) -> None:
    """Refuse, before a model is loaded, :class:`~nbkv.Engine` arguments that are wrong.

    Checks the arguments named here (a wrong type or range, an unknown cache mode...);
    other names are left to the engine. :class:`InvalidRequestError` names the argument.
    """
    for name, value in args.items():
        if name in WHOLE_ARGS:
            least, optional, hint = WHOLE_ARGS[name]
            validate.whole(name, value, least, optional, hint)
    if "wait_timeout" in args:
        validate.seconds("wait_timeout", args["wait_timeout"])
    if "cache" in args and args["cache"] not in CACHE_MODES:
        raise InvalidRequestError(f"cache must be one of {CACHE_MODES}, not {args['cache']!r}")
    if "overflow" in args:
        check_overflow(args["overflow"])
    hardware = {k: args[k] for k in HARDWARE_ARGS if k in args}
    if hardware:
        from nbkv.llama.hardware import HardwareOptions

        HardwareOptions(**hardware)


DEFAULTS = EngineConfig()
