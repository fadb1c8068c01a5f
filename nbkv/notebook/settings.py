"""The ``Nbkv`` traits: defaults of ``%kvcache load`` and ``%%chat``, set with ``%config``.

``%config Nbkv.slots = 2`` in a notebook, or ``c.Nbkv.slots = 2`` in ``ipython_config.py``.
The magics class inherits them. The engine's settings among them are not declared here: each
is made from its field in :mod:`nbkv.core.config` (``trait=`` names it), default and help too.
"""

from __future__ import annotations

from typing import Any

from traitlets import Bool, Enum, Float, Int, MetaHasTraits, TraitType, Unicode, validate
from traitlets.config import Configurable

from nbkv.core.config import FIELDS, described


def _trait(f: Any) -> TraitType[Any, Any]:
    """The ``%config`` trait mirroring an engine setting (:func:`nbkv.core.config.setting`)."""
    meta = f.metadata
    default, helptext = meta["trait_default"], meta["help"]
    if meta["choices"] and default is None:  # not set: the engine's default (its variable)
        return Enum(meta["choices"], None, allow_none=True, help=helptext).tag(config=True)
    if meta["choices"]:
        return Enum(meta["choices"], default, help=helptext).tag(config=True)
    if meta["least"] is not None:
        return Int(default, allow_none=default is None or meta["optional"], min=meta["least"],
                   help=helptext).tag(config=True)
    if isinstance(default, bool):
        return Bool(default, help=helptext).tag(config=True)
    return Unicode(default, help=helptext).tag(config=True)


#: trait name -> the engine setting it mirrors (those ``%kvcache load`` offers)
ENGINE_TRAITS = {f.metadata["trait"]: f for _, f in described() if f.metadata["trait"]}

#: the engine's settings as traits: one class made from the settings' own declarations
EngineTraits: Any = MetaHasTraits(
    "EngineTraits", (Configurable,), {name: _trait(f) for name, f in ENGINE_TRAITS.items()})


class Settings(EngineTraits):
    """Configurable defaults of the ``%kvcache`` and ``%%chat`` magics."""

    autoload = Bool(False, help="Load the default model on the first %%chat instead of "
                                "asking for %kvcache load").tag(config=True)
    session = Unicode("default", help="Session of a %%chat cell that names none"
                      ).tag(config=True)
    max_tokens = Int(256, min=1, help="Longest reply, in tokens").tag(config=True)
    temperature = Float(0.0, help="Sampling temperature (0 = greedy, reproducible)"
                        ).tag(config=True)
    stats = Bool(True, help="Show the cache figures under each reply").tag(config=True)
    replay = Bool(True, help="A %%chat cell run again with the same prompt and deterministic "
                             "settings gets the reply the cache holds, with nothing decoded "
                             "(%%chat --fresh decodes anyway)").tag(config=True)
    refresh = Float(0.1, help="Seconds between redraws of a streaming reply").tag(config=True)
    autosave = Bool(False, help="Save the slots and sessions in the background after requests "
                                "(%kvcache save's default place), never delaying a reply"
                    ).tag(config=True)
    autosave_interval = Float(30.0, min=1.0, help="Autosave: seconds between two saves at least"
                              ).tag(config=True)
    frontend = Enum(("auto", "notebook", "terminal"), "auto",
                    help="How %%chat shows replies: 'auto' picks 'notebook' in a Jupyter "
                         "kernel, else 'terminal' (stdout)").tag(config=True)

    @validate("refresh")
    def _refresh_positive(self, proposal: Any) -> float:
        if proposal["value"] < 0:
            raise ValueError("refresh must be >= 0 seconds")
        return proposal["value"]

    def engine_kwargs(self, **given: Any) -> dict[str, Any]:
        """:class:`~nbkv.Engine` arguments: what was ``given`` (by trait name), else the traits.

        The model file is not one (it is :meth:`load`'s first argument); a setting left
        unset (``""`` or ``None`` where the engine's default is ``None`` or comes from an
        environment variable) is not passed.
        """
        out: dict[str, Any] = {}
        for name, f in ENGINE_TRAITS.items():
            value = given.get(name)
            value = getattr(self, name) if value is None or value == "" else value
            unset = value in ("", None) and (f.metadata["default"] is None or f.metadata["env"])
            if FIELDS[f.name] == "model" or unset:
                continue
            out[f.name] = value
        return out
