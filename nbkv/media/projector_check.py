"""Projector pre-flight: a metadata check in Python, then libmtmd itself in a child process.

Native code aborts the whole process on many wrong inputs (a failed ``GGML_ASSERT`` in the
vision graph, a projector key stored with another GGUF type...). Rather than mirror those
asserts in Python, :func:`inspect_projector` lets libmtmd load the projector and encode one
tiny image in a child process of the same interpreter (:mod:`nbkv.media.probe`): an abort
kills the child, and the error names its exit signal or code and the tail of its stderr.
What stays here is what the GGUF header says cheaply (a whole file, a vision projector) and
what a pair of files must agree on that native code does not check (the text model's RoPE
kind, its M-RoPE sections, the image tokens of the projector's family). The child's result
is kept per projector and text model file (path, size, modification time), so it runs once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkv.core.errors import ModelLoadError, ProjectorError
from nbkv.llama.backend import Model, check_gguf
from nbkv.llama.gguf_header import read_metadata

log = logging.getLogger("nbkv.media.projector")

#: how long the pre-flight child may take (loading the text model, encoding one image)
PREFLIGHT_TIMEOUT_S = 600.0

# the projector types that give image tokens multi-axis (M-RoPE) positions, and the M-RoPE
# kind (Model.rope_type) of their text models: Qwen2-VL and Qwen2.5-VL rotate sections in
# blocks, Qwen3-VL interleaves them (LLAMA_ROPE_TYPE_IMROPE). libmtmd takes the positions'
# kind from the text model, so it decodes any pairing without complaint, into wrong positions
_MROPE_KIND = {"qwen2vl_merger": "mrope-8", "qwen2.5vl_merger": "mrope-8",
               "qwen3vl_merger": "mrope-40"}
_MROPE_NAME = {"mrope-8": "M-RoPE (Qwen2-VL)", "mrope-40": "interleaved M-RoPE (Qwen3-VL)"}

# tokens every text model of the projector's family has: libmtmd feeds them as text (a missing
# one aborts nothing), but without them the text model belongs to another family
PAIR_TOKENS: dict[str, tuple[str, ...]] = {
    "qwen2vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen2.5vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "lfm2": ("<|img_thumbnail|>",),  # looked up for tiled images: a miss makes token -1
}

# image delimiters libmtmd inserts as text: harmless when missing (they become plain text),
# but then the model never saw them in training
DELIMITERS: dict[str, tuple[str, ...]] = {
    "gemma3": ("<start_of_image>", "<end_of_image>"),
    "gemma3nv": ("<start_of_image>", "<end_of_image>"),
    "qwen2vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen2.5vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "llama4": ("<|image_start|>", "<|image_end|>"),
    "internvl": ("<img>", "</img>"),
    "lfm2": ("<|image_start|>", "<|image_end|>"),
    "glm4v": ("<|begin_of_image|>", "<|end_of_image|>"),
    "pixtral": ("[IMG_END]",),
}


@dataclass(frozen=True)
class ProjectorInfo:
    """What the pre-flight learned about a projector file (header, then libmtmd's probe)."""

    path: Path
    projector_type: str
    n_embd: int  # vision encoder width
    n_layer: int
    image_size: int
    patch_size: int
    file_size: int
    n_embd_out: int | None = None  # embedding width it produces (the text model's input)
    tokens_per_tile: int | None = None  # embeddings of the probe image's first chunk
    uses_mrope: bool = False  # libmtmd gives image tokens multi-axis (M-RoPE) positions
    non_causal: bool = False  # an image chunk is decoded in one non-causal batch
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Probe:
    """What the child reported: libmtmd's view of the projector bound to the text model."""

    n_embd_out: int
    tokens_per_tile: int
    uses_mrope: bool
    non_causal: bool


def inspect_projector(
    path: str | os.PathLike, model: Model | None = None, *, trust: bool = False
) -> ProjectorInfo:
    """Check a projector GGUF and describe it; raise :class:`ProjectorError` if unusable.

    Always: the header (a whole GGUF file with a vision encoder and a projector type). With
    ``model``: the pre-flight child (libmtmd loads the projector with the text model, tokenizes
    and encodes one tiny image; once per pair of files), then what the pair must agree on that
    native code does not check: the RoPE kind the projector's positions are for, an M-RoPE
    model's sections, the image tokens of the projector's family. ``trust=True`` skips the
    family checks (not the child, which is what keeps the kernel alive).
    """
    p, meta = read_header(path)
    ptype = str(meta.get("clip.projector_type") or meta.get("clip.vision.projector_type"))
    info = ProjectorInfo(
        path=p, projector_type=ptype, n_embd=_int(meta, "embedding_length"),
        n_layer=_int(meta, "block_count"), image_size=_int(meta, "image_size"),
        patch_size=_int(meta, "patch_size"), file_size=p.stat().st_size)
    if model is None:
        return info
    probe = preflight(p, Path(model.path))
    info = ProjectorInfo(**{**info.__dict__, "n_embd_out": probe.n_embd_out,
                            "tokens_per_tile": probe.tokens_per_tile,
                            "uses_mrope": probe.uses_mrope, "non_causal": probe.non_causal})
    _check_rope(p, ptype, model, trust)
    warnings = _check_tokens(p, ptype, model, trust)
    for w in warnings:
        log.warning("%s: %s", p.name, w)
    return ProjectorInfo(**{**info.__dict__, "warnings": tuple(warnings)})


def read_header(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The projector file checked from its header: a whole GGUF holding a vision projector."""
    p = Path(path).expanduser()
    try:
        check_gguf(p)
        meta = read_metadata(p)
    except (ModelLoadError, FileNotFoundError) as err:
        msg = str(err).replace("model file", "projector file")
        raise ProjectorError(f"vision projector: {msg}") from err
    except (OSError, ValueError) as err:
        raise ProjectorError(f"{p} is not a readable GGUF file: {err}") from err
    arch = meta.get("general.architecture")
    if not any(str(k).startswith("clip.") for k in meta):
        what = f"a {arch!r} model" if arch and arch != "clip" else "not a projector"
        raise ProjectorError(
            f"{p} is {what}, not a vision projector (mmproj) file: it has no clip.* metadata")
    if not meta.get("clip.has_vision_encoder"):
        raise ProjectorError(
            f"{p} has no vision encoder (clip.has_vision_encoder is not true): an audio-only "
            "or text projector cannot read images")
    if not (meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")):
        raise ProjectorError(f"{p}: no clip.projector_type")
    return p, meta


def _int(meta: dict[str, Any], key: str) -> int:
    v = meta.get(f"clip.vision.{key}")
    return int(v) if isinstance(v, (int, float)) else 0


_probes: dict[tuple[Any, ...], Probe | str] = {}
_probes_lock = threading.Lock()


def _file_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def preflight(projector: Path, model_path: Path) -> Probe:
    """The verdict of libmtmd on ``projector`` with the text model at ``model_path``, from a child.

    Kept per pair of files (path, size, modification time): a failure is raised again as it
    was, without a new child.
    """
    key = (_file_key(projector), _file_key(model_path))
    with _probes_lock:
        found = _probes.get(key)
        if found is None:
            found = _probes[key] = _run_child(projector, model_path)
    if isinstance(found, str):
        raise ProjectorError(found)
    return found


def _run_child(projector: Path, model_path: Path) -> Probe | str:
    """Run :mod:`nbkv.media.probe` on the pair; its result, or the error message to raise."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "nbkv.media.probe", str(model_path), str(projector)]
    what = f"the projector pre-flight ({projector.name} with {model_path.name})"
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env,
                           timeout=PREFLIGHT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        return (f"{what} did not finish in {PREFLIGHT_TIMEOUT_S:.0f} s; stderr tail: "
                f"{_tail(err.stderr)}")
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.returncode == 0 and last.startswith("{"):
        got = json.loads(last)
        if "error" in got:
            msg = str(got["error"])
            return msg if str(projector) in msg else f"{projector}: {msg}"
        return Probe(int(got["n_embd_out"]), int(got["tokens_per_tile"]),
                     bool(got["uses_mrope"]), bool(got["non_causal"]))
    if r.returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-r.returncode).name}"
        except ValueError:
            how = f"was killed by signal {-r.returncode}"
    else:
        how = f"exited with code {r.returncode}"
    return (f"{what} {how}: libmtmd cannot use this projector with this text model (in the "
            f"kernel it would have ended the process); stderr tail: {_tail(r.stderr)}")


def _tail(text: str | bytes | None, n: int = 800) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = (text or "").strip()
    return ("..." + text[-n:]) if len(text) > n else (text or "(empty)")


def _check_rope(p: Path, ptype: str, model: Model, trust: bool) -> None:
    """The text model's RoPE takes the image positions the projector gives."""
    rope = model.rope_type
    mrope = ptype in _MROPE_KIND
    if mrope and rope == _MROPE_KIND[ptype]:
        _check_rope_sections(model)
    elif trust:
        return
    elif mrope and rope in _MROPE_NAME:
        raise ProjectorError(
            f"projector {p.name} ({ptype}) is for text models with "
            f"{_MROPE_NAME[_MROPE_KIND[ptype]]}, but the text model ({model.description}) "
            f"uses {_MROPE_NAME[rope]}: it belongs to another model")
    elif not mrope and rope not in ("none", "norm", "neox"):
        raise ProjectorError(
            f"the text model uses RoPE type {rope} (multi-axis image positions) but "
            f"projector {p.name} is {ptype!r}, which gives image tokens one position "
            "each; pass trust_projector=True to try it")
    elif mrope and rope in ("none", "norm", "neox"):
        raise ProjectorError(
            f"projector {p.name} ({ptype}) gives image tokens multi-axis (M-RoPE) "
            f"positions, but the text model ({model.description}) uses RoPE type {rope}: "
            "the projector belongs to a Qwen-VL model")


def _check_tokens(p: Path, ptype: str, model: Model, trust: bool) -> list[str]:
    """The family's image tokens are in the text vocabulary; warnings for missing delimiters."""
    missing = [t for t in PAIR_TOKENS.get(ptype, ()) if not _has_token(model, t)]
    if missing and not trust:
        raise ProjectorError(
            f"projector {p.name} ({ptype}) wraps images in the image special token(s) "
            f"{', '.join(repr(t) for t in missing)}, which every text model of its family "
            f"has and {model.description} lacks: the projector belongs to another model")
    return [f"image delimiter {tok!r} is not a token of the text model; it is fed as plain text"
            for tok in DELIMITERS.get(ptype, ()) if not _has_token(model, tok)]


def batch_for_projector(path: str | os.PathLike | None, model: Model, n_batch: int) -> int:
    """``n_batch`` raised, with a log line, to hold one image chunk of a non-causal projector.

    Gemma 3's image tokens attend to each other both ways, so libmtmd decodes a whole image in
    one micro-batch; a smaller one makes llama.cpp assert. The count comes from the pre-flight
    (one tiny image, resized by these projectors to their fixed size). A projector the
    pre-flight refuses is left as it is: opening it raises the error.
    """
    if path is None:
        return n_batch
    try:
        p, _ = read_header(path)
        probe = preflight(p, Path(model.path))
    except ProjectorError:
        return n_batch
    need = probe.tokens_per_tile
    if probe.non_causal and need > n_batch:
        log.info("n_batch raised from %d to %d: the projector's images are decoded in one "
                 "non-causal batch of %d tokens", n_batch, need, need)
        return need
    return n_batch


def _check_rope_sections(model: Model) -> None:
    """Check an M-RoPE text model's ``rope.dimension_sections``.

    They must be 4 non-negative counts of rotated pairs (time, height, width, extra) that sum
    to half the rotated head size.
    """
    arch = model.meta("general.architecture") or ""
    path = getattr(model, "path", None)
    if path is None:
        return
    value = read_metadata(Path(path)).get(f"{arch}.rope.dimension_sections")
    sections = list(value) if isinstance(value, list) else None
    if sections is None:
        raise ProjectorError(
            f"the text model ({model.description}) uses M-RoPE but has no "
            f"{arch}.rope.dimension_sections")
    n_rot: Any = (model.meta(f"{arch}.rope.dimension_count")
                  or model.meta(f"{arch}.attention.key_length"))
    if n_rot is None:
        heads = model.meta(f"{arch}.attention.head_count")
        width = model.meta(f"{arch}.embedding_length")
        n_rot = int(width) // int(heads) if heads and width else None
    if len(sections) != 4 or any(int(x) < 0 for x in sections) or sum(sections[:3]) == 0:
        raise ProjectorError(
            f"the text model's {arch}.rope.dimension_sections {list(sections)} must be 4 "
            "non-negative counts (time, height, width, extra), not all zero")
    if n_rot is not None and sum(int(x) for x in sections) != int(n_rot) // 2:
        raise ProjectorError(
            f"the text model's {arch}.rope.dimension_sections {list(sections)} sum to "
            f"{sum(int(x) for x in sections)}, but its heads rotate {int(n_rot) // 2} pairs "
            f"(rope dimension {n_rot}): image positions would be rotated wrongly")


def _has_token(model: Model, text: str) -> bool:
    """Whether some token's piece is exactly ``text``."""
    want = text.encode()
    toks = model.tokenize(text)
    if len(toks) == 1 and model.piece(toks[0]) == want:
        return True
    pieces = _vocab_pieces.get(model)
    if pieces is None:  # a full scan, once per model
        pieces = _vocab_pieces[model] = frozenset(model.piece(t) for t in range(model.n_vocab))
    return want in pieces


_vocab_pieces: weakref.WeakKeyDictionary[Model, frozenset[bytes]] = weakref.WeakKeyDictionary()


_file_hashes: dict[tuple[str, int, int], str] = {}


def file_identity(path: Path) -> str:
    """SHA-256 of a file's content (memoized per path, size and mtime)."""
    key = _file_key(path)
    digest = _file_hashes.get(key)
    if digest is None:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        digest = _file_hashes[key] = h.hexdigest()
    return digest
