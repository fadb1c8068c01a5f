"""The ``Nbkv`` traits: defaults of ``%kvcache load`` and ``%%chat``, set with ``%config``.

``%config Nbkv.slots = 2`` in a notebook, or ``c.Nbkv.slots = 2`` in ``ipython_config.py``.
The magics class inherits them; the engine's own defaults come from :mod:`nbkv.core.config`.
"""

from __future__ import annotations

from typing import Any

from traitlets import Bool, Enum, Float, Int, Unicode, validate
from traitlets.config import Configurable

from nbkv.core.config import (
    CACHE_MODES,
    DEFAULTS,
    FLASH_ATTN_MODES,
    KV_TYPE_SIZES,
    OVERFLOW_POLICIES,
    SPLIT_MODE_NAMES,
)


class Settings(Configurable):
    """Configurable defaults of the ``%kvcache`` and ``%%chat`` magics."""

    model = Unicode("", help="GGUF file %kvcache load uses by default ('' = embedded "
                             "SmolLM2-135M, or $NBKV_MODEL)").tag(config=True)
    slots = Int(None, allow_none=True, min=1, help="Conversations kept in KV at once (None: "
                "picked from the memory plan, 4 when they fit)").tag(config=True)
    ctx = Int(None, allow_none=True, min=1, help="Context budget of each slot, in tokens "
              "(None: picked from the memory plan, 4096 when it fits)").tag(config=True)
    n_gpu_layers = Int(None, allow_none=True, min=-1, help="Layers offloaded to a GPU (None: "
                       "all when llama.cpp has a GPU backend, else 0)").tag(config=True)
    main_gpu = Int(0, min=0, help="The GPU that holds the model (split_mode 'none')"
                   ).tag(config=True)
    split_mode = Enum(SPLIT_MODE_NAMES, "layer", help="How layers are split across GPUs"
                      ).tag(config=True)
    flash_attn = Enum(FLASH_ATTN_MODES, "off", help="Flash attention: 'auto', 'on' or 'off' "
                      "(a quantized type_v needs 'on')").tag(config=True)
    type_k = Enum(tuple(KV_TYPE_SIZES), "f16", help="K cache type ('q8_0' about halves it)"
                  ).tag(config=True)
    type_v = Enum(tuple(KV_TYPE_SIZES), "f16", help="V cache type (quantized needs flash_attn)"
                  ).tag(config=True)
    use_mmap = Bool(True, help="Memory-map the weights").tag(config=True)
    use_mlock = Bool(False, help="Lock the weights in RAM").tag(config=True)
    mode = Enum(CACHE_MODES, DEFAULTS.cache, help="Cache mode").tag(config=True)
    min_tokens = Int(DEFAULTS.cache_min_tokens, help="Shortest prefix worth salvaging (IMC) or "
                     "system prompt worth caching (SPC)").tag(config=True)
    overflow = Enum(OVERFLOW_POLICIES, DEFAULTS.overflow, help="What a conversation that "
                    "outgrows its slot does: 'error', or 'slide' (drop the oldest turns)"
                    ).tag(config=True)
    autoload = Bool(False, help="Load the default model on the first %%chat instead of "
                                "asking for %kvcache load").tag(config=True)
    session = Unicode("default", help="Session of a %%chat cell that names none"
                      ).tag(config=True)
    max_tokens = Int(256, min=1, help="Longest reply, in tokens").tag(config=True)
    temperature = Float(0.0, help="Sampling temperature (0 = greedy, reproducible)"
                        ).tag(config=True)
    stats = Bool(True, help="Show the cache figures under each reply").tag(config=True)
    refresh = Float(0.1, help="Seconds between redraws of a streaming reply").tag(config=True)
    autosave = Bool(False, help="Save the slots and sessions in the background after requests "
                                "(%kvcache save's default place), never delaying a reply"
                    ).tag(config=True)
    autosave_interval = Float(30.0, min=1.0, help="Autosave: seconds between two saves at least"
                              ).tag(config=True)
    park_ram = Int(None, allow_none=True, min=0, help="Bytes of RAM for conversations that "
                   "lost their slot, parked to be restored instead of read again (None: a "
                   "quarter of free RAM, at most 4 GiB)").tag(config=True)
    park_dir = Unicode("", help="Directory where parked conversations go when they leave RAM "
                                "('' = no disk tier: they are dropped)").tag(config=True)
    frontend = Enum(("auto", "notebook", "terminal"), "auto",
                    help="How %%chat shows replies: 'auto' picks 'notebook' in a Jupyter "
                         "kernel, else 'terminal' (stdout)").tag(config=True)

    @validate("refresh")
    def _refresh_positive(self, proposal: Any) -> float:
        if proposal["value"] < 0:
            raise ValueError("refresh must be >= 0 seconds")
        return proposal["value"]

    def engine_kwargs(self, slots: int | None = None, ctx: int | None = None,
                      mode: str | None = None, min_tokens: int | None = None,
                      gpu_layers: int | None = None, kv_type: str | None = None,
                      flash_attn: str | None = None, park_ram: int | None = None,
                      park_dir: str | None = None) -> dict[str, Any]:
        """:class:`~nbkv.Engine` arguments: what was given, else these traits.

        The parking options are passed only when set (the engine's defaults otherwise).
        """
        ram = self.park_ram if park_ram is None else park_ram
        where = park_dir or self.park_dir
        parking = {**({"park_ram": ram} if ram is not None else {}),
                   **({"park_dir": where} if where else {})}
        return dict(
            n_slots=self.slots if slots is None else slots,
            n_ctx=self.ctx if ctx is None else ctx, cache=mode or self.mode,
            cache_min_tokens=self.min_tokens if min_tokens is None else min_tokens,
            overflow=self.overflow,
            n_gpu_layers=self.n_gpu_layers if gpu_layers is None else gpu_layers,
            main_gpu=self.main_gpu, split_mode=self.split_mode,
            flash_attn=flash_attn or self.flash_attn, type_k=kv_type or self.type_k,
            type_v=kv_type or self.type_v, use_mmap=self.use_mmap, use_mlock=self.use_mlock,
            **parking,
        )
