"""The engine's settings: five frozen groups, each field declared once, here.

A field carries its type, its default, its check and its help (``metadata``); from them come
:class:`~nbkv.Engine`'s flat keywords (:data:`FIELDS` routes each to its group), the
``%config Nbkv`` traits of ``%kvcache load`` (:mod:`nbkv.notebook.settings`) and the docs'
"Engine options" table. A new option is one field here. Pure data: importing it loads no
model code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import partial
from typing import Any, ClassVar

from nbkv.core import api
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
#: (none stored) proven while serving, or the stored answer else measured at load, or anew
CALIBRATIONS = ("background", "cached", "fresh")
#: when a reply's KV is rewritten as a batch in exact mode (nbkv.engine.rewrite)
REWRITE_MODES = ("auto", "mixed", "idle")


def setting(default: Any, help: str, *, choices: tuple[Any, ...] = (), least: int | None = None,
            optional: bool = False, hint: str = "", kind: str = "",
            trait: str = "", trait_default: Any = MISSING, env: str = "") -> Any:
    """One engine setting: its default, what it is for and how it is checked.

    ``choices``: the values allowed; ``least``: an integer at least this (``optional``: or
    None; ``hint`` says what None means); ``kind``: ``"path"``, ``"directory"``,
    ``"seconds"`` or ``"text"`` (a str or None). ``trait``: its ``%config Nbkv`` name, when
    ``%kvcache load`` offers it (``trait_default``: the trait's default, if not the field's).
    ``env``: an environment variable that, when set, is the default instead (read each time
    settings are made, so a notebook may set it before ``%kvcache load``).
    """
    meta = {"help": help, "choices": choices, "least": least, "optional": optional,
            "hint": hint, "kind": kind, "trait": trait, "default": default, "env": env,
            "trait_default": default if trait_default is MISSING else trait_default}
    if env:
        return field(default_factory=partial(env_default, env, default, choices),
                     metadata=meta)
    return field(default=default, metadata=meta)


def env_default(env: str, default: Any, choices: tuple[Any, ...]) -> Any:
    """``$env`` when set (one of ``choices``, else :class:`InvalidRequestError`), or ``default``."""
    value = os.environ.get(env, "")
    if not value:
        return default
    if value not in choices:
        raise InvalidRequestError(f"${env} must be one of {choices}, not {value!r}")
    return value


def check_overflow(overflow: str) -> str:
    """``overflow`` if it is a known policy, else :class:`InvalidRequestError`."""
    return str(check_value("overflow", overflow, {"choices": OVERFLOW_POLICIES}))


def check_value(name: str, value: Any, meta: Mapping[str, Any]) -> Any:
    """``value`` checked as a field with ``meta`` says (:func:`setting`), else the named error."""
    kind, choices = meta.get("kind", ""), meta.get("choices", ())
    if choices and value not in choices:
        raise InvalidRequestError(f"{name} must be one of {choices}, not {value!r}")
    if meta.get("least") is not None:
        api.whole(name, value, meta["least"], meta["optional"], meta["hint"])
    if kind == "path":
        api.path(name, value)
    elif kind == "directory":  # found wrong after the model loaded, else
        api.directory(name, value)
    elif kind == "seconds":
        api.seconds(name, value)
    elif kind == "text" and value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a Jinja2 chat template (a str) or None, "
                                  f"not {type(value).__name__}")
    return value


def quantized(kv_type: str) -> bool:
    """True for the block-quantized KV types (not f32/f16/bf16)."""
    return kv_type not in ("f32", "f16", "bf16")


class Group:
    """A frozen group of settings: every field checked as its metadata says, when made."""

    def __post_init__(self) -> None:
        self._normalize()
        for f in fields(self):  # type: ignore[arg-type]
            check_value(f.name, getattr(self, f.name), f.metadata)
        self._check()

    def _normalize(self) -> None:
        """Put accepted spellings into their one form (before the checks)."""

    def _check(self) -> None:
        """What involves several fields of the group (after each field's own check)."""


@dataclass(frozen=True)
class ModelSettings(Group):
    """The model, its chat template and its vision projector."""

    model_path: str | None = setting(
        None, "GGUF file; `None` uses `$NBKV_MODEL` or the embedded SmolLM2-135M",
        kind="path", trait="model", trait_default="")
    template: str | None = setting(
        None, "a Jinja2 chat template overriding the model's own", kind="text")
    mmproj: str | None = setting(
        None, "a vision projector GGUF matching the model: messages may then carry images. It "
        "is checked before llama.cpp sees it; a mismatch raises `ProjectorError`", kind="path")
    trust_projector: bool = setting(
        False, "accept projector types nbkv cannot validate ahead of time")


@dataclass(frozen=True)
class SlotSettings(Group):
    """The slots and what they cache: how many, how long, which cache mode, what overflows."""

    n_slots: int | None = setting(
        4, "conversations kept in KV at once (one llama.cpp sequence each); `None`: picked "
        "from the memory plan, 4 when they fit", least=1, optional=True,
        hint="None: sized from the memory plan", trait="slots", trait_default=None)
    n_ctx: int | None = setting(
        4096, "context budget of each slot, in tokens (rounded up to a multiple of 256). "
        "`None` for this or `n_slots`: picked from the memory plan (4 x 4096 when the KV takes "
        "at most a quarter of the free memory, else smaller), said in `engine.sized`; a slot "
        "longer than the model's trained context is warned about", least=1, optional=True,
        hint="None: sized from the memory plan", trait="ctx", trait_default=None)
    cache: str = setting(
        "imc", "`\"imc\"` (whole conversations), `\"spc\"` (system prompt only) or `\"off\"`",
        choices=CACHE_MODES, trait="mode")
    cache_min_tokens: int = setting(
        100, "IMC: shortest token prefix worth salvaging from another conversation's slot; "
        "SPC: shortest system prompt worth caching", least=0, trait="min_tokens")
    overflow: str = setting(
        "error", "`\"error\"` raises `ContextOverflowError` when a prompt does not fit its "
        "slot; `\"slide\"` drops the oldest turns (keeping the system prompt) instead",
        choices=OVERFLOW_POLICIES, trait="overflow")
    wait_timeout: float = setting(
        300.0, "seconds a request may wait for a free slot", kind="seconds")
    spc_max_entries: int = setting(
        4, "system prompts the System Prompt Cache keeps", least=1,
        hint="cache='off' caches nothing")
    history_size: int = setting(1000, "request records kept", least=1,
                                hint="request records kept")
    max_checkpoints: int = setting(
        8, "per slot, on models whose KV cannot be trimmed (hybrid, recurrent) or whose state "
        "put back from parking or a save cannot (sliding-window): partial states kept at "
        "message boundaries (the newest kept, older ones thinned)", least=0)
    checkpoint_bytes: int | None = setting(
        None, "per slot, the most bytes its checkpoints may take. `None` (default): as much "
        "as the slot's own KV on sliding-window models, where each checkpoint holds a whole "
        "window of the SWA layers; no bound on hybrid and recurrent ones", least=0,
        optional=True, hint="None: as much as a slot's KV on sliding-window models")


@dataclass(frozen=True)
class ParkingSettings(Group):
    """Parking (IMC only): where conversations that lost their slot are kept, within what.

    A request that takes a slot parks the conversation that held it, and a prompt that starts
    with it restores it (``nbkv/store/parking.py``). ``park_ram=0`` without a ``park_dir``
    turns parking off.
    """

    park_ram: int | None = setting(
        None, "bytes of RAM for parked conversations (default the smaller of a quarter of the "
        "free RAM and 4 GiB; least recently used leave first); `0` without a `park_dir`: "
        "parking is off", least=0, optional=True,
        hint="None: a quarter of the free RAM, at most 4 GiB; 0: no RAM tier", trait="park_ram")
    park_dir: str | None = setting(
        None, "an optional disk tier parked conversations spill to (several engines may share "
        "one: each writes its own namespace; `close()` spills the slots and RAM there, and the "
        "next engine opening it takes them over)", kind="directory", trait="park_dir",
        trait_default="")
    park_disk: int | None = setting(
        None, "bytes the disk tier may take", least=0, optional=True,
        hint="None: a quarter of the free disk, at most 16 GiB")


@dataclass(frozen=True)
class HardwareSettings(Group):
    """llama.cpp's threads, batch, placement and KV types (see docs/howto/own-model.md).

    :mod:`nbkv.llama.hardware` maps the names to llama.cpp's ids. A quantized ``type_v``
    needs flash attention in llama.cpp.
    """

    n_batch: int = setting(
        256, "tokens per `llama_decode` call (prefill chunk size)", least=2,
        hint="tokens per llama_decode call; a step may decode two rows")
    n_threads: int | None = setting(
        None, "llama.cpp's threads; default what this process may really use: the CPU "
        "affinity mask and the cgroup's CPU quota, whichever is smaller "
        "(`nbkv/llama/cpus.py`). `engine.n_threads` says what it runs with", least=1,
        optional=True, hint="None: one per core")
    n_gpu_layers: int | None = setting(
        None, "layers offloaded to a GPU: `None` (default) is all of them when the llama.cpp "
        "build has a GPU backend, else 0 (-1: all layers)", least=-1, optional=True,
        hint="-1: all layers", trait="n_gpu_layers")
    main_gpu: int = setting(0, "the GPU that holds the model (`split_mode=\"none\"`)", least=0,
                            trait="main_gpu")
    split_mode: str = setting("layer", "how layers are split across GPUs, as in llama.cpp",
                              choices=SPLIT_MODE_NAMES, trait="split_mode")
    tensor_split: tuple[float, ...] | None = setting(
        None, "each GPU's share of the model, as in llama.cpp")
    flash_attn: str = setting(
        "off", "`\"off\"` (default), `\"on\"` or `\"auto\"` (`True`/`False` too). With f16 KV, "
        "llama.cpp's CPU flash-attention kernel tiles batches of 64+ tokens, so a prompt "
        "prefilled in pieces (what a cache hit does) gets other logits than the same prompt "
        "prefilled at once: `exact=True` refuses it. With quantized K and V the kernel is "
        "per-token and exactness holds", choices=FLASH_ATTN_MODES, trait="flash_attn")
    type_k: str = setting(
        "f16", "K cache type: `\"f16\"` (default), `\"q8_0\"` (about half the memory), "
        "`\"q4_0\"`, ... (`nbkv.core.config.KV_TYPE_SIZES`)", choices=tuple(KV_TYPE_SIZES),
        trait="type_k")
    type_v: str = setting(
        "f16", "V cache type, as `type_k`; a quantized V cache needs `flash_attn=\"on\"`",
        choices=tuple(KV_TYPE_SIZES), trait="type_v")
    use_mmap: bool = setting(True, "memory-map the weights", trait="use_mmap")
    use_mlock: bool = setting(False, "lock the weights in RAM", trait="use_mlock")
    fixed_rows: int = setting(
        0, "experimental, for GPUs: pad every text decode to this many rows (0, the default: "
        "off; at most `n_batch` and 256) with rows of a scratch sequence, so the kernels see "
        "one batch shape; calibration then proves or refutes exactness in that shape. On a "
        "CPU it only costs time", least=0, hint="0: off")
    device_sampling: bool = setting(
        True, "greedy requests take their token from llama.cpp's graph (backend sampling: "
        "the argmax runs beside the logits, on the GPU when they are there, and only the "
        "token is copied out) instead of reading the whole logits row on the host; the "
        "engine reads rows on the host while a request samples otherwise, or has an image",
        trait="device_sampling")
    check_memory: bool = setting(
        True, "plan the KV bytes from the GGUF metadata and refuse, with the figures, a "
        "configuration that cannot fit the free memory, before llama.cpp allocates")

    def _normalize(self) -> None:
        if isinstance(self.flash_attn, bool):
            object.__setattr__(self, "flash_attn", "on" if self.flash_attn else "off")
        if self.tensor_split is not None:
            try:
                ts = tuple(float(x) for x in self.tensor_split)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError("tensor_split must be non-negative shares") from e
            if not ts or any(x < 0 for x in ts) or sum(ts) <= 0:
                raise InvalidRequestError("tensor_split must be non-negative shares, not all 0")
            object.__setattr__(self, "tensor_split", ts)

    def _check(self) -> None:
        if quantized(self.type_v) and self.flash_attn == "off":
            raise InvalidRequestError(
                f"type_v={self.type_v!r} needs flash attention in llama.cpp (a quantized V "
                "cache is only read by the flash-attention kernel): pass flash_attn='on'")
        if self.fixed_rows > min(self.n_batch, 256):
            raise InvalidRequestError(f"fixed_rows must be at most n_batch ({self.n_batch}) "
                                      "and 256 (the calibration's slots)")

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


@dataclass(frozen=True)
class ExactnessSettings(Group):
    """Whether cached KV equals a fresh prefill, how that is proven, and the reply rewrite."""

    exact: bool = setting(
        True, "keep cached KV bit-identical to a from-scratch prefill. Replies are generated "
        "one token per step, as plain llama.cpp does; a one-token decode rounds slightly "
        "differently from a batched prefill, so once a reply has streamed its KV is rewritten "
        "as a batch in the scheduler's idle time (or by the next request that reuses it). "
        "`False` keeps the token-by-token KV: no rewrite, and a cached reply may then differ "
        "from a from-scratch one at near-ties")
    rewrite: str = setting(
        "auto", "when the reply's KV is rewritten as a batch (exact mode, IMC). `\"auto\"` "
        "(default): in idle time, and, when requests come back to back, while the reply is "
        "generated, in a shadow sequence (`nbkv/engine/rewrite.py`; it takes one slot's KV "
        "memory more, and the reply then decodes slower by what its rows cost); `\"mixed\"`: "
        "always while the reply is generated; `\"idle\"`: only in idle time (or by the next "
        "request), with no shadow sequence", choices=REWRITE_MODES)
    speculative: bool = setting(
        False, "decode a prompt-lookup guess of the next token beside each generated one "
        "(`nbkv/engine/drafts.py`); a right guess yields two tokens from one decode. Off by "
        "default: a two-row decode costs more than a one-row decode on a CPU, and rounds "
        "differently (so replies equal plain llama.cpp's only without guesses). Ignored on "
        "hybrid and recurrent models, whose state cannot drop a wrong guess")
    calibration: str = setting(
        "background", "how nbkv proves which groupings of prompt rows make cached KV equal a "
        "fresh prefill on this model, llama.cpp build and CPU (`nbkv/kv/calibrate.py`): the "
        "result is `engine.prefill_rule` (`engine.model.exactness` in words), stored once "
        "measured. `\"background\"` (default): with a result stored, exact from the first "
        "request; with none (a model never seen) and over 400M parameters, the engine serves "
        "at once on the lean path, "
        "records saying `exact=False` (\"not proven yet\"), measures on a thread of its own in "
        "idle time, then (in exact mode) drops what it cached meanwhile and serves exact "
        "(`engine.wait_proven()` waits for it); a smaller model, whose proof takes seconds, is "
        "measured during its load. `\"cached\"`: with none stored, measures during "
        "the load (a progress bar), so every reply can be exact; `\"fresh\"`: measures again "
        "during the load. `$NBKV_CALIBRATION`, when set, is the default instead (CI, and "
        "tests that read exactness from the first reply, set `cached`). The file "
        "(`calibration-v3.json`) is signed with the user's key; an entry edited, copied from "
        "another user, or holding bad values is measured again",
        choices=CALIBRATIONS, env="NBKV_CALIBRATION", trait="calibration", trait_default=None)


@dataclass(frozen=True)
class EngineSettings:
    """Every setting of an engine, in five frozen groups, checked before a model is loaded.

    :class:`nbkv.Engine` takes the groups (``slots=SlotSettings(n_slots=2)``), or their fields
    as flat keywords (``n_slots=2``), routed by :meth:`of`; ``%kvcache load`` and
    ``%config Nbkv`` build the same object, so they cannot disagree. An engine keeps what it
    was asked for as ``engine.settings``, and hands it unchanged to its resources and its
    scheduler (two loads asking for equal settings ask for the same engine).
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    slots: SlotSettings = field(default_factory=SlotSettings)
    parking: ParkingSettings = field(default_factory=ParkingSettings)
    hardware: HardwareSettings = field(default_factory=HardwareSettings)
    exactness: ExactnessSettings = field(default_factory=ExactnessSettings)

    #: group name -> its class
    GROUPS: ClassVar[dict[str, type[Group]]]

    def __post_init__(self) -> None:
        for name, cls in self.GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise InvalidRequestError(f"{name} must be a {cls.__name__}, not "
                                          f"{type(getattr(self, name)).__name__}")
        self.hardware.check_exact(self.exactness.exact)

    @classmethod
    def of(cls, base: EngineSettings | None = None, groups: Mapping[str, Any] | None = None,
           **options: Any) -> EngineSettings:
        """``base`` (default: the defaults) with ``groups`` put in and flat ``options`` set.

        Each flat option names a field, routed into its group by :data:`FIELDS`; one named
        nowhere, or given beside its own group, is an :class:`InvalidRequestError`.
        ``system_prompt_cache=True`` is another way to say ``cache="spc"``.
        """
        base = base if base is not None else cls()
        if not isinstance(base, cls):
            raise InvalidRequestError(f"settings must be an EngineSettings, not "
                                      f"{type(base).__name__}")
        given = {g: v for g, v in (groups or {}).items() if v is not None}
        _legacy_spc(options, given.get("slots", base.slots))
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise InvalidRequestError(f"unknown engine setting(s) {unknown}")
        both = sorted(n for n in options if FIELDS[n] in given)
        if both:
            raise InvalidRequestError(f"{both} given both as keywords and inside their group "
                                      f"({', '.join(sorted({FIELDS[n] for n in both}))}=): "
                                      "give each setting once")
        parts: dict[str, Any] = {g: given.get(g, getattr(base, g)) for g in cls.GROUPS}
        for g, part in parts.items():
            mine = {n: v for n, v in options.items() if FIELDS[n] == g}
            if mine and isinstance(part, cls.GROUPS[g]):
                parts[g] = replace(part, **mine)  # type: ignore[type-var]
        return cls(**parts)

    @property
    def flash_attn(self) -> str:
        """Flash attention as it will run (``auto`` made concrete for an exact engine)."""
        return self.hardware.resolved_flash_attn(self.exactness.exact)


EngineSettings.GROUPS = {f.name: f.default_factory for f in fields(EngineSettings)  # type: ignore[misc]
                         if callable(f.default_factory)}


def _field_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for group, cls in EngineSettings.GROUPS.items():
        for f in fields(cls):  # type: ignore[arg-type]
            assert f.name not in table, f"{f.name} is in two groups"
            table[f.name] = group
    return table


#: every field's name -> the group that holds it: how flat keywords are routed
FIELDS: dict[str, str] = _field_table()


def described() -> list[tuple[str, Any]]:
    """Every field, with its group's name, in declaration order (for the docs and traits)."""
    return [(g, f) for g, cls in EngineSettings.GROUPS.items()
            for f in fields(cls)]  # type: ignore[arg-type]


def _legacy_spc(options: dict[str, Any], slots: SlotSettings) -> None:
    """``system_prompt_cache=True``: ``cache="spc"``; refused beside ``cache="imc"``."""
    if not options.pop("system_prompt_cache", None):
        return
    if options.get("cache", slots.cache) == "imc":
        raise InvalidRequestError(
            "the System Prompt Cache and the Incremental Message Cache are mutually "
            "exclusive (IMC already caches the system prompt): pick cache='imc' or 'spc'")
    options["cache"] = "spc"

