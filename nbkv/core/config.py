"""The engine's settings that the magics, the traits and :class:`~nbkv.Engine` share.

One place for each choice and its default, so ``%kvcache load``, ``%config Nbkv`` and
``Engine(...)`` cannot disagree. Pure data: importing it loads no model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from nbkv.core import validate
from nbkv.core.errors import InvalidRequestError

#: KV cache types llama.cpp accepts, with their size in bytes per element
KV_TYPE_SIZES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
    "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32,
}
FLASH_ATTN_MODES = ("auto", "on", "off")
SPLIT_MODE_NAMES = ("none", "layer", "row")
CACHE_MODES = ("imc", "spc", "off")  # whole conversations, system prompt only, nothing
OVERFLOW_POLICIES = ("error", "slide")  # raise, or drop the oldest turns


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
#: the engine's file arguments: a path or None (``park_dir`` must also be a usable directory)
PATH_ARGS = ("model_path", "mmproj")
#: :class:`HardwareOptions` fields
HARDWARE_ARGS = ("n_gpu_layers", "main_gpu", "split_mode", "tensor_split", "flash_attn",
                 "type_k", "type_v", "use_mmap", "use_mlock", "fixed_rows")


def check_engine_args(**args: Any) -> None:
    """Refuse, before a model is loaded, :class:`~nbkv.Engine` arguments that are wrong.

    Checks the arguments named here (a wrong type or range, an unknown cache mode, a path
    that is not one, a ``park_dir`` that is a file or lies under one...); other names are
    left to the engine. :class:`InvalidRequestError` names the argument.
    """
    for name, value in args.items():
        if name in WHOLE_ARGS:
            least, optional, hint = WHOLE_ARGS[name]
            validate.whole(name, value, least, optional, hint)
    if "wait_timeout" in args:
        validate.seconds("wait_timeout", args["wait_timeout"])
    for name in PATH_ARGS:
        if name in args:
            validate.path(name, args[name])
    if "park_dir" in args:  # found wrong after the model loaded, else
        validate.directory("park_dir", args["park_dir"])
    if args.get("template") is not None and not isinstance(args["template"], str):
        raise InvalidRequestError(f"template must be a Jinja2 chat template (a str) or None, "
                                  f"not {type(args['template']).__name__}")
    if "cache" in args and args["cache"] not in CACHE_MODES:
        raise InvalidRequestError(f"cache must be one of {CACHE_MODES}, not {args['cache']!r}")
    if "overflow" in args:
        check_overflow(args["overflow"])
    hardware = {k: args[k] for k in HARDWARE_ARGS if k in args}
    if hardware:
        HardwareOptions(**hardware)


def quantized(kv_type: str) -> bool:
    """True for the block-quantized KV types (not f32/f16/bf16)."""
    return kv_type not in ("f32", "f16", "bf16")


@dataclass(frozen=True)
class HardwareOptions:
    """llama.cpp's placement and KV settings (see docs/howto/own-model.md).

    Checked here, by name; :mod:`nbkv.llama.hardware` maps the names to llama.cpp's ids.

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
    #: pad every text decode to this many rows (a scratch sequence's): one batch shape, for
    #: GPU builds whose kernels choose their algorithm by batch shape (0: off; <= n_batch)
    fixed_rows: int = 0

    def __post_init__(self) -> None:
        fa = self.flash_attn
        if isinstance(fa, bool):
            object.__setattr__(self, "flash_attn", "on" if fa else "off")
        elif fa not in FLASH_ATTN_MODES:
            raise InvalidRequestError(f"flash_attn must be 'auto', 'on' or 'off', not {fa!r}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPE_SIZES:
                raise InvalidRequestError(f"{name} must be one of {sorted(KV_TYPE_SIZES)}, "
                                          f"not {getattr(self, name)!r}")
        if self.split_mode not in SPLIT_MODE_NAMES:
            raise InvalidRequestError(f"split_mode must be one of {sorted(SPLIT_MODE_NAMES)}, "
                                      f"not {self.split_mode!r}")
        if self.n_gpu_layers is not None and (not isinstance(self.n_gpu_layers, int)
                                              or self.n_gpu_layers < -1):
            raise InvalidRequestError("n_gpu_layers must be an integer >= -1 (-1: all layers)")
        if isinstance(self.fixed_rows, bool) or not isinstance(self.fixed_rows, int) \
                or self.fixed_rows < 0:
            raise InvalidRequestError("fixed_rows must be an integer >= 0 (0: off)")
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


#: the stored answer for this model and build, or anew, or (none stored) proven while serving
CALIBRATIONS = ("cached", "fresh", "background")
#: when a reply's KV is rewritten as a batch in exact mode (nbkv.engine.shadow)
REWRITE_MODES = ("auto", "mixed", "idle")


@dataclass(frozen=True)
class EngineSettings:
    """Every setting of an engine, checked here, in one place, before a model is loaded.

    :class:`nbkv.Engine` takes these as keyword arguments (its docstring says what each one
    does); ``%kvcache load`` and ``%config Nbkv`` build the same object, so they cannot
    disagree. ``n_slots``/``n_ctx`` ``None`` leave the size to the memory plan. An engine
    keeps what it was asked for as ``engine.settings`` (two loads asking for equal settings
    ask for the same engine).
    """

    model_path: str | None = None
    n_slots: int | None = 4
    n_ctx: int | None = 4096
    cache: str = "imc"
    cache_min_tokens: int = 100
    overflow: str = "error"
    n_batch: int = 256
    n_threads: int | None = None
    template: str | None = None
    spc_max_entries: int = 4
    history_size: int = 1000
    wait_timeout: float = 300.0
    exact: bool = True
    rewrite: str = "auto"
    speculative: bool = False
    max_checkpoints: int = 8
    checkpoint_bytes: int | None = None
    mmproj: str | None = None
    trust_projector: bool = False
    check_memory: bool = True
    calibration: str = "cached"
    park_ram: int | None = None
    park_dir: str | None = None
    park_disk: int | None = None
    hardware: HardwareOptions = field(default_factory=HardwareOptions)

    def __post_init__(self) -> None:
        checked = {*WHOLE_ARGS, *PATH_ARGS, "park_dir", "template", "cache", "overflow",
                   "wait_timeout"}
        check_engine_args(**{f.name: getattr(self, f.name) for f in fields(self)
                             if f.name in checked})
        if self.calibration not in CALIBRATIONS:
            raise InvalidRequestError(
                f"calibration must be 'cached', 'fresh' or 'background', "
                f"not {self.calibration!r}")
        if self.rewrite not in REWRITE_MODES:
            raise InvalidRequestError(
                f"rewrite must be one of {', '.join(map(repr, REWRITE_MODES))}, "
                f"not {self.rewrite!r}")
        self.hardware.check_exact(self.exact)
        if self.hardware.fixed_rows > min(self.n_batch, 256):
            raise InvalidRequestError(f"fixed_rows must be at most n_batch ({self.n_batch}) "
                                      "and 256 (the calibration's slots)")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineSettings:
        """From :class:`nbkv.Engine`'s keyword arguments (the hardware ones included)."""
        hw = {k: kwargs.pop(k) for k in HARDWARE_ARGS if k in kwargs}
        if hw.get("tensor_split") is not None:
            hw["tensor_split"] = tuple(hw["tensor_split"])
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)} - {"hardware"})
        if unknown:
            raise InvalidRequestError(f"unknown engine setting(s) {unknown}")
        return cls(**kwargs, hardware=HardwareOptions(**hw))

    @property
    def flash_attn(self) -> str:
        """Flash attention as it will run (``auto`` made concrete for an exact engine)."""
        return self.hardware.resolved_flash_attn(self.exact)


DEFAULTS = EngineSettings()
