"""Vision projectors through libmtmd (llama-cpp-python's ``mtmd_cpp`` bindings).

A :class:`Projector` pairs a projector (mmproj) GGUF with a loaded text :class:`~nbkv.backend.
Model`. It tokenizes prompt text carrying media markers plus images into chunks
(:class:`MediaPrompt`), runs the vision encoder on image chunks (or takes their embeddings
from an :class:`~nbkv.media.EmbeddingCache`), and decodes embeddings into any sequence of a
:class:`~nbkv.backend.Context` at any position, so the engine can rebuild a slot, or serve the
same picture in another session, without re-running the encoder.

Native code aborts the whole process on several wrong inputs (failed ``GGML_ASSERT``: a
projector key stored with another GGUF type, a tensor of the wrong shape or type, image
special tokens the text model lacks, a non-causal image larger than the micro-batch...).
:func:`inspect_projector` reads the projector with the ``gguf`` package and refuses such files
*before* llama.cpp sees them, and :class:`Projector` checks every call's arguments first.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from .backend import Batch, Context, Model, check_gguf, log_callback, take_native_errors
from .errors import ContextOverflowError, DecodeError, MediaError, ModelLoadError, ProjectorError
from .media import (
    MARKER,
    EmbeddingCache,
    Image,
    MediaKey,
    MediaSpan,
    MediaStats,
    load_image,
    spans,
)

log = logging.getLogger("nbkv.mtmd")

_log_lock = threading.Lock()
_log_installed = False
_mtmd: Any = None


def _lib() -> Any:
    """``llama_cpp.mtmd_cpp`` (imported lazily: it loads libmtmd), logging routed to Python."""
    global _mtmd, _log_installed
    with _log_lock:
        if _mtmd is None:
            from llama_cpp import mtmd_cpp

            _mtmd = mtmd_cpp
        if not _log_installed:
            _mtmd.mtmd_log_set(log_callback, ctypes.c_void_p(0))
            _mtmd.mtmd_helper_log_set(log_callback, ctypes.c_void_p(0))
            _log_installed = True
    return _mtmd


_native_errors = take_native_errors


# -- pre-flight ------------------------------------------------------------------------------

# libmtmd's projector names (tools/mtmd/clip-impl.h, PROJECTOR_TYPE_NAMES)
KNOWN_PROJECTORS = frozenset("""
    mlp mlp_norm ldp ldpv2 resampler adapter qwen2vl_merger qwen2.5vl_merger qwen3vl_merger
    ling3vl step3vl gemma3 gemma3nv gemma3na gemma4v gemma4a gemma4uv gemma4ua phi4 idefics3
    pixtral ultravox internvl llama4 qwen2a qwen3a glma qwen2.5o voxtral meralion musicflamingo
    lfm2 kimivl paddleocr lightonocr cogvlm janus_pro dots_ocr dots3note_v dots3note_a
    deepseekocr deepseekocr2 deepseek4v lfm2a glm4v glm5v youtuvl yasa2 kimik25 nemotron_v2_vl
    exaone4_5 hunyuanvl minicpmv4_6 granite_speech mimovl minimax_m3 granite4_vision
    mimo_audio parakeet qwen3tts_spkenc qwen3tts_gen pockettts_spkenc pockettts_gen
    muse-glimmer
""".split())

#: Projector types whose files nbkv checks completely (keys, tensor names, shapes, types).
VALIDATED_PROJECTORS = ("mlp", "gemma3", "idefics3")

# tokens libmtmd looks up in the text vocabulary by exact piece (mtmd.cpp, lookup_token); a
# missing one becomes token -1 in a text chunk, which aborts the process when evaluated
REQUIRED_TOKENS: dict[str, tuple[str, ...]] = {
    "idefics3": ("\n\n", "<fake_token_around_image>", "<global-img>", "\n"),
    "resampler": ("<image>", "</image>", "<slice>", "</slice>", "\n"),
    "minicpmv4_6": ("<image>", "</image>", "<slice>", "</slice>", "\n"),
    "step3vl": ("<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"),
    "lfm2": ("<|img_thumbnail|>",),
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

# GGUF value types of every key clip.cpp reads with a typed getter: gguf_get_val_* asserts the
# stored type, so an int32 where a uint32 is expected aborts the process
_U32, _I32, _F32, _BOOL, _STR, _ARR = "u32", "i32", "f32", "bool", "str", "arr"
_KEY_TYPES: dict[str, str] = {
    "general.name": _STR, "general.description": _STR,
    "clip.has_vision_encoder": _BOOL, "clip.has_audio_encoder": _BOOL,
    "clip.has_gen_audio_encoder": _BOOL, "clip.use_gelu": _BOOL, "clip.use_silu": _BOOL,
    "clip.projector_type": _STR, "clip.vision.projector_type": _STR,
    "clip.audio.projector_type": _STR, "clip.vision.mm_patch_merge_type": _STR,
    "clip.minicpmv_version": _I32, "clip.minicpmv_query_num": _U32,
    "clip.vision.attention.layer_norm_epsilon": _F32, "clip.vision.swiglu_clamp": _F32,
    "clip.vision.image_mean": _ARR, "clip.vision.image_std": _ARR,
    "clip.vision.image_grid_pinpoints": _ARR, "clip.vision.feature_layer": _ARR,
    "clip.vision.wa_layer_indexes": _ARR, "clip.vision.wa_pattern_mode": _ARR,
}
for _k in (
    "embedding_length", "attention.head_count", "attention.head_dim", "feed_forward_length",
    "block_count", "projection_dim", "attention.head_count_kv", "image_size", "patch_size",
    "image_min_pixels", "image_max_pixels", "preproc_min_tiles", "preproc_max_tiles",
    "preproc_image_size", "projector.scale_factor", "projector.query_side",
    "projector.window_side", "spatial_merge_size", "n_wa_pattern", "window_size",
    "expert_used_count", "sam.head_count", "sam.block_count", "sam.embedding_length",
):
    _KEY_TYPES[f"clip.vision.{_k}"] = _U32
_ARRAY_ITEM_TYPES = {
    "clip.vision.image_mean": _F32, "clip.vision.image_std": _F32,
    "clip.vision.image_grid_pinpoints": _I32, "clip.vision.feature_layer": _I32,
    "clip.vision.wa_layer_indexes": _I32, "clip.vision.wa_pattern_mode": _I32,
}
_REQUIRED_U32 = (
    "embedding_length", "attention.head_count", "feed_forward_length", "block_count",
    "projection_dim", "image_size", "patch_size",
)


@dataclass(frozen=True)
class ProjectorInfo:
    """What :func:`inspect_projector` learned about a projector file."""

    path: Path
    projector_type: str
    validated: bool  # a type nbkv checks completely (see VALIDATED_PROJECTORS)
    n_embd: int  # vision encoder width
    n_head: int
    n_ff: int
    n_layer: int
    image_size: int
    patch_size: int
    projection_dim: int  # metadata only: clip.cpp sizes the output from the tensors
    n_embd_out: int | None  # embedding width it produces (must equal the text model's input)
    scale_factor: int | None
    tokens_per_tile: int | None  # embeddings per image tile of image_size x image_size
    file_size: int
    n_tensors: int
    warnings: tuple[str, ...] = ()


def _gguf_type_name(field: Any) -> str:
    import gguf

    t = field.types[0] if field.types else None
    return {
        gguf.GGUFValueType.UINT32: _U32, gguf.GGUFValueType.INT32: _I32,
        gguf.GGUFValueType.FLOAT32: _F32, gguf.GGUFValueType.BOOL: _BOOL,
        gguf.GGUFValueType.STRING: _STR, gguf.GGUFValueType.ARRAY: _ARR,
    }.get(t, getattr(t, "name", "?").lower())


def _array_item_type(field: Any) -> str:
    import gguf

    t = field.types[-1] if len(field.types) > 1 else None
    return {gguf.GGUFValueType.FLOAT32: _F32, gguf.GGUFValueType.INT32: _I32}.get(
        t, getattr(t, "name", "?").lower()
    )


def inspect_projector(
    path: str | os.PathLike, model: Model | None = None, *, trust: bool = False
) -> ProjectorInfo:
    """Check a projector GGUF in Python and describe it; raise :class:`ProjectorError` if unusable.

    Nothing here calls into llama.cpp except vocabulary lookups on ``model``. Checked: the
    file is a whole GGUF (every tensor's data inside the file); it is a vision projector
    (``clip.has_vision_encoder``); its projector type is one libmtmd knows; every key
    ``clip.cpp`` reads has the GGUF type it expects (a mismatch aborts natively); the vision
    hyper-parameters are present and consistent. For the validated types (``mlp``, ``gemma3``,
    ``idefics3``) also every tensor the graph uses: present, shaped and typed as the graph
    needs. With ``model``: the embedding width it produces equals the text model's input
    width, the text model's RoPE is one nbkv handles, and every special token libmtmd looks up
    for this projector type exists in the text vocabulary (``idefics3``, SmolVLM's projector,
    needs ``<fake_token_around_image>``, which SmolLM2 lacks).

    ``trust=True`` lets other projector types through with only the generic checks: a file
    that is wrong in a way nbkv does not know may still abort the process.
    """
    p = Path(path).expanduser()
    try:
        check_gguf(p)
    except (ModelLoadError, FileNotFoundError) as e:
        msg = str(e).replace("model file", "projector file")
        raise ProjectorError(f"vision projector: {msg}") from e
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ProjectorError("checking a projector needs the gguf package: pip install gguf") from e
    size = p.stat().st_size
    arch = _first_architecture(p)
    if arch is not None and arch != "clip":  # fast path: parsing a whole text model is slow
        raise ProjectorError(
            f"{p} is a {arch!r} model, not a vision projector (mmproj) file"
        )
    try:
        reader = gguf.GGUFReader(p)
        tensors = {t.name: t for t in reader.tensors}
    except Exception as e:
        raise ProjectorError(
            f"{p} is not a readable GGUF file (corrupt or truncated): {type(e).__name__}: {e}"
        ) from e
    for t in tensors.values():
        if t.data_offset + t.n_bytes > size:
            raise ProjectorError(
                f"{p} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )

    def fld(key: str) -> Any:
        return reader.get_field(key)

    def value(key: str) -> Any:
        f = fld(key)
        return None if f is None else f.contents()

    arch = value("general.architecture")
    if fld("clip.has_vision_encoder") is None and fld("clip.projector_type") is None:
        what = f"a {arch!r} model" if arch and arch != "clip" else "not a projector"
        raise ProjectorError(
            f"{p} is {what}, not a vision projector (mmproj) file: it has no clip.* metadata"
        )
    for key, want in _KEY_TYPES.items():
        f = fld(key)
        if f is None:
            continue
        got = _gguf_type_name(f)
        if got != want:
            raise ProjectorError(
                f"{p}: key {key} is stored as {got}, libmtmd reads it as {want} (a mismatch "
                "aborts the process); the file was not written by a compatible converter"
            )
        if want == _ARR and _array_item_type(f) != _ARRAY_ITEM_TYPES[key]:
            raise ProjectorError(
                f"{p}: array {key} holds {_array_item_type(f)}, expected "
                f"{_ARRAY_ITEM_TYPES[key]}"
            )
    if not value("clip.has_vision_encoder"):
        raise ProjectorError(
            f"{p} has no vision encoder (clip.has_vision_encoder is not true): an audio-only "
            "or text projector cannot read images"
        )
    ptype = value("clip.projector_type") or value("clip.vision.projector_type")
    if not ptype:
        raise ProjectorError(f"{p}: no clip.projector_type")
    if ptype not in KNOWN_PROJECTORS:
        raise ProjectorError(
            f"{p}: projector type {ptype!r} is unknown to this llama.cpp build "
            f"(llama-cpp-python {llama_cpp.__version__})"
        )
    validated = ptype in VALIDATED_PROJECTORS
    if not validated and not trust:
        raise ProjectorError(
            f"{p}: projector type {ptype!r} is not one nbkv validates "
            f"({', '.join(VALIDATED_PROJECTORS)}); pass trust_projector=True to load it "
            "anyway (a file wrong in a way nbkv does not check may abort the process)"
        )
    if value("clip.has_audio_encoder") and not trust:
        raise ProjectorError(
            f"{p} also holds an audio encoder, which nbkv does not validate; pass "
            "trust_projector=True to load it anyway"
        )

    hp: dict[str, int] = {}
    for k in _REQUIRED_U32:
        v = value(f"clip.vision.{k}")
        if v is None:
            raise ProjectorError(f"{p}: missing clip.vision.{k}")
        hp[k] = int(v)
    if value("clip.vision.attention.layer_norm_epsilon") is None:
        raise ProjectorError(f"{p}: missing clip.vision.attention.layer_norm_epsilon")
    for k in ("image_mean", "image_std"):
        v = value(f"clip.vision.{k}")
        if v is None or len(v) < 3:
            raise ProjectorError(f"{p}: clip.vision.{k} must hold 3 floats (one per channel)")
    e, n_head, n_ff, n_layer = (hp["embedding_length"], hp["attention.head_count"],
                                hp["feed_forward_length"], hp["block_count"])
    img, patch = hp["image_size"], hp["patch_size"]
    for name, v in (("embedding_length", e), ("attention.head_count", n_head),
                    ("block_count", n_layer), ("image_size", img), ("patch_size", patch)):
        if v < 1:
            raise ProjectorError(f"{p}: clip.vision.{name} must be positive, is {v}")
    if e % n_head:
        raise ProjectorError(f"{p}: embedding_length {e} is not a multiple of head_count {n_head}")
    if img % patch:
        raise ProjectorError(f"{p}: image_size {img} is not a multiple of patch_size {patch}")
    scale = value("clip.vision.projector.scale_factor")
    scale = int(scale) if scale is not None else None

    n_out: int | None = None
    tokens: int | None = None
    warnings: list[str] = []
    if validated:
        n_out, tokens = _check_tensors(p, ptype, tensors, fld, e, n_ff, n_layer, img, patch, scale)

    if model is not None:
        n_text = int(llama_cpp.llama_model_n_embd_inp(model.ptr))
        if n_out is not None and n_out != n_text:
            raise ProjectorError(
                f"projector {p.name} produces {n_out}-wide embeddings but the text model "
                f"({model.description}) takes {n_text}: it belongs to another model"
            )
        rope = int(llama_cpp.llama_model_rope_type(model.ptr))
        if rope not in (llama_cpp.LLAMA_ROPE_TYPE_NONE, llama_cpp.LLAMA_ROPE_TYPE_NORM,
                        llama_cpp.LLAMA_ROPE_TYPE_NEOX) and not trust:
            raise ProjectorError(
                f"the text model uses RoPE type {rope} (M-RoPE: multi-axis image positions), "
                "which nbkv does not validate; pass trust_projector=True to try it"
            )
        missing = [t for t in REQUIRED_TOKENS.get(ptype, ()) if not _has_token(model, t)]
        if missing:
            raise ProjectorError(
                f"projector {p.name} ({ptype}) needs the image special token(s) "
                f"{', '.join(repr(t) for t in missing)} in the text model's vocabulary, and "
                f"{model.description} has none: the projector belongs to another model "
                "(evaluating its image chunks would abort the process)"
            )
        for t in DELIMITERS.get(ptype, ()):
            if not _has_token(model, t):
                warnings.append(
                    f"image delimiter {t!r} is not a token of the text model; it is fed as "
                    "plain text"
                )
    for w in warnings:
        log.warning("%s: %s", p.name, w)
    return ProjectorInfo(
        path=p, projector_type=ptype, validated=validated, n_embd=e, n_head=n_head, n_ff=n_ff,
        n_layer=n_layer, image_size=img, patch_size=patch, projection_dim=hp["projection_dim"],
        n_embd_out=n_out, scale_factor=scale, tokens_per_tile=tokens, file_size=size,
        n_tensors=len(tensors), warnings=tuple(warnings),
    )


def _split(n: int, step: int) -> list[int]:
    """Sub-batch sizes for ``n`` embeddings, at most ``step`` each, never a lone last one.

    llama.cpp's CPU kernels compute a one-row batch differently from larger ones (see the
    README's *Exactness*); this keeps an image's decode on the multi-row path whenever
    ``n >= 2`` and ``step >= 3``, whatever ``n % step`` is.
    """
    sizes = [step] * (n // step) + ([n % step] if n % step else [])
    if len(sizes) >= 2 and sizes[-1] == 1 and step >= 3:
        sizes[-2] -= 1
        sizes[-1] = 2
    return sizes


def _first_architecture(path: Path) -> str | None:
    """``general.architecture`` if it is the file's first key (as converters write it)."""
    import struct

    try:
        with path.open("rb") as f:
            head = f.read(24)
            if len(head) < 24:
                return None
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 256:
                return None
            key = f.read(n)
            (vtype,) = struct.unpack("<I", f.read(4))
            if key != b"general.architecture" or vtype != 8:  # 8: GGUF string
                return None
            n = struct.unpack("<Q", f.read(8))[0]
            return f.read(min(n, 256)).decode("utf-8", errors="replace") if n <= 256 else None
    except (OSError, struct.error):
        return None


def _check_tensors(
    p: Path, ptype: str, tensors: dict[str, Any], fld: Any, e: int, n_ff: int, n_layer: int,
    img: int, patch: int, scale: int | None,
) -> tuple[int, int]:
    """Shape/type checks of the validated graphs; returns (output width, tokens per tile)."""
    import gguf

    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16

    def get(name: str, required: bool = True) -> Any:
        t = tensors.get(name)
        if t is None and required:
            raise ProjectorError(f"{p} ({ptype}): missing tensor {name}")
        return t

    def shape(t: Any) -> list[int]:
        return [int(x) for x in t.shape]

    def expect(name: str, ne: list[int], required: bool = True, f32: bool = False) -> Any:
        t = get(name, required)
        if t is None:
            return None
        if shape(t) != ne:
            raise ProjectorError(
                f"{p} ({ptype}): tensor {name} has shape {shape(t)}, the graph needs {ne}"
            )
        if (f32 or len(ne) == 1) and t.tensor_type != F32:
            raise ProjectorError(
                f"{p} ({ptype}): tensor {name} is {t.tensor_type.name}; it is added to "
                "activations and must be F32 (ggml's CPU backend aborts otherwise)"
            )
        return t

    side = img // patch
    n_patches = side * side
    pe = get("v.patch_embd.weight")
    if shape(pe) != [patch, patch, 3, e] or pe.tensor_type not in (F32, F16):
        raise ProjectorError(
            f"{p} ({ptype}): v.patch_embd.weight is {pe.tensor_type.name} {shape(pe)}, "
            f"the graph needs F16/F32 {[patch, patch, 3, e]}"
        )
    expect("v.patch_embd.bias", [e], required=False)
    has_class = "v.class_embd" in tensors
    if has_class and ptype != "mlp":
        raise ProjectorError(f"{p} ({ptype}): unexpected v.class_embd")
    if has_class:
        expect("v.class_embd", [e], f32=True)
    expect("v.position_embd.weight", [e, n_patches + (1 if has_class else 0)], f32=True)
    for ln in ("pre_ln", "post_ln"):
        expect(f"v.{ln}.weight", [e], required=False)
        expect(f"v.{ln}.bias", [e], required=False)
    for i in range(n_layer):
        b = f"v.blk.{i}"
        if f"{b}.attn_qkv.weight" in tensors:
            raise ProjectorError(f"{p} ({ptype}): fused attn_qkv tensors are not validated")
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
            expect(f"{b}.{n}.weight", [e, e])
            expect(f"{b}.{n}.bias", [e], required=False)
        for n in ("ln1", "ln2"):
            expect(f"{b}.{n}.weight", [e], required=False)
            expect(f"{b}.{n}.bias", [e], required=False)
        up, down = get(f"{b}.ffn_up.weight"), get(f"{b}.ffn_down.weight")
        if shape(up) == [n_ff, e] and shape(down) == [e, n_ff]:  # legacy swapped names
            up_b, down_b = f"{b}.ffn_down.bias", f"{b}.ffn_up.bias"
        elif shape(up) == [e, n_ff] and shape(down) == [n_ff, e]:
            up_b, down_b = f"{b}.ffn_up.bias", f"{b}.ffn_down.bias"
        else:
            raise ProjectorError(
                f"{p} ({ptype}): {b}.ffn_up/ffn_down have shapes {shape(up)}/{shape(down)}, "
                f"expected [{e}, {n_ff}] and [{n_ff}, {e}]"
            )
        expect(up_b, [n_ff], required=False)
        expect(down_b, [e], required=False)
        if f"{b}.ffn_gate.weight" in tensors or f"{b}.ffn_gate_exps.weight" in tensors:
            raise ProjectorError(f"{p} ({ptype}): gated / MoE vision FFNs are not validated")

    if ptype == "mlp":
        if fld("clip.vision.image_grid_pinpoints") is not None:
            raise ProjectorError(f"{p}: LLaVA-1.6 tiling (image_grid_pinpoints) is not validated")
        if "mm.3.weight" in tensors or "mm.1.weight" in tensors:
            raise ProjectorError(f"{p}: Yi-style mlp_norm projectors are not validated")
        feature = fld("clip.vision.feature_layer")
        n_in = e * (len(feature.contents()) if feature is not None else 1)
        m0 = get("mm.0.weight")
        if len(m0.shape) != 2 or int(m0.shape[0]) != n_in:
            raise ProjectorError(
                f"{p} (mlp): mm.0.weight has shape {shape(m0)}, its first dimension must be "
                f"the vision width {n_in}"
            )
        hidden = int(m0.shape[1])
        expect("mm.0.bias", [hidden])
        m2 = get("mm.2.weight")
        if len(m2.shape) != 2 or int(m2.shape[0]) != hidden:
            raise ProjectorError(
                f"{p} (mlp): mm.2.weight has shape {shape(m2)}, expected [{hidden}, n_out]"
            )
        n_out = int(m2.shape[1])
        expect("mm.2.bias", [n_out])
        return n_out, n_patches
    if ptype == "gemma3":
        k = scale if scale is not None else 4
        if k < 1 or side % k:
            raise ProjectorError(
                f"{p} (gemma3): {side} patches per side do not pool evenly by {k}"
            )
        expect("mm.soft_emb_norm.weight", [e])
        w = get("mm.input_projection.weight")
        if len(w.shape) != 2 or int(w.shape[1]) != e:
            raise ProjectorError(
                f"{p} (gemma3): mm.input_projection.weight has shape {shape(w)}, expected "
                f"[n_out, {e}]"
            )
        return int(w.shape[0]), (side // k) ** 2
    # idefics3: pixel shuffle by `scale` per side, then one linear layer
    k = scale if scale is not None else 1
    if k < 1 or side % k:
        raise ProjectorError(f"{p} (idefics3): {side} patches per side do not shuffle by {k}")
    w = get("mm.model.fc.weight")
    if len(w.shape) != 2 or int(w.shape[0]) != e * k * k:
        raise ProjectorError(
            f"{p} (idefics3): mm.model.fc.weight has shape {shape(w)}, expected "
            f"[{e * k * k}, n_out]"
        )
    return int(w.shape[1]), (side // k) ** 2


def _has_token(model: Model, text: str) -> bool:
    """Whether some token's piece is exactly ``text`` (what libmtmd's lookup_token finds)."""
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
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    digest = _file_hashes.get(key)
    if digest is None:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        digest = _file_hashes[key] = h.hexdigest()
    return digest


# -- chunks ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ImageEmbedding:
    """Encoder output for one picture: one ``(n_tokens, n_embd)`` float32 array per image chunk.

    Read-only copies owned by Python, so they can be cached, shared between requests and
    decoded into any sequence at any position later.
    """

    image_hash: str
    projector_id: str
    arrays: tuple[np.ndarray, ...]
    encode_seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Memory held by the arrays."""
        return sum(a.nbytes for a in self.arrays)

    @property
    def n_tokens(self) -> int:
        """Embeddings over all chunks."""
        return sum(a.shape[0] for a in self.arrays)


@dataclass(frozen=True, eq=False)
class MediaChunk:
    """One chunk of a :class:`MediaPrompt`: text tokens, or one image's embeddings slot.

    ``n_tokens`` is what the chunk feeds to the model; ``n_pos`` how far it advances the KV
    position (equal, except for M-RoPE models). For an image chunk, ``image`` is the picture,
    ``image_index`` its place among the prompt's images and ``sub_index`` its place among the
    chunks that picture became (tiling projectors make several). ``placeholder`` chunks were
    tokenized without pixels because the embeddings were cached; they cannot be encoded.
    """

    index: int
    kind: str
    n_tokens: int
    n_pos: int
    tokens: tuple[int, ...] = ()
    image: Image | None = None
    image_index: int = -1
    sub_index: int = 0
    placeholder: bool = False
    _prompt: MediaPrompt | None = field(default=None, repr=False)
    _ptr: int | None = field(default=None, repr=False)

    @property
    def is_image(self) -> bool:
        """True for an image chunk."""
        return self.kind == "image"

    @property
    def key(self) -> tuple[int, ...] | MediaKey:
        """What prompt comparisons see: the text tokens, or a :class:`MediaKey`."""
        if self.image is None:
            return self.tokens
        return MediaKey(self.image.hash, self.sub_index, self.n_tokens, self.n_pos)

    def native(self) -> int:
        """The ``mtmd_input_chunk *`` (valid while the prompt is open)."""
        if self._prompt is None or self._prompt.closed or not self._ptr:
            raise MediaError("this chunk's prompt was closed; tokenize again")
        return self._ptr


class MediaPrompt:
    """The chunks of one tokenized prompt; owns the native ``mtmd_input_chunks``.

    Close it (or use ``with``) to free native memory early; garbage collection does too.
    """

    def __init__(self, projector: Projector, native: int, images: Sequence[Image]) -> None:
        self.projector = projector
        self.images = tuple(images)
        self._native = native
        self._finalizer = weakref.finalize(self, _lib().mtmd_input_chunks_free, native)
        self.chunks: tuple[MediaChunk, ...] = ()

    @property
    def closed(self) -> bool:
        """True once the native chunks were freed."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the native chunks."""
        self._finalizer()

    def __enter__(self) -> MediaPrompt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[MediaChunk]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def n_tokens(self) -> int:
        """Tokens and embeddings fed to the model."""
        return sum(c.n_tokens for c in self.chunks)

    @property
    def n_pos(self) -> int:
        """KV positions the prompt occupies."""
        return sum(c.n_pos for c in self.chunks)

    def keys(self) -> list[tuple[int, ...] | MediaKey]:
        """Chunk keys for :func:`nbkv.media.position_units` / prefix comparisons."""
        return [c.key for c in self.chunks]

    def spans(self, start: int = 0) -> list[MediaSpan]:
        """KV span of each chunk when the prompt is decoded from position ``start``."""
        return spans(self.keys(), start)

    def locate(self, n_pos: int) -> tuple[int, int]:
        """Where KV position ``n_pos`` (relative to the prompt start) falls: (chunk, offset).

        For resuming after a salvaged prefix of ``n_pos`` positions: decode the rest of chunk
        ``chunk`` from ``offset`` (a text chunk), then the following chunks. An image is
        never entered midway: a position inside one raises :class:`MediaError` (snap it with
        :func:`nbkv.media.snap_to_media_boundary` first). ``n_pos == self.n_pos`` returns
        ``(len(self.chunks), 0)``.
        """
        if not 0 <= n_pos <= self.n_pos:
            raise MediaError(f"position {n_pos} is outside the prompt (0..{self.n_pos})")
        at = 0
        for i, c in enumerate(self.chunks):
            if n_pos < at + c.n_pos:
                off = n_pos - at
                if c.is_image and off:
                    raise MediaError(f"position {n_pos} falls inside an image (chunk {i})")
                return i, off
            at += c.n_pos
        return len(self.chunks), 0

    def text_tokens(self) -> list[int]:
        """All text tokens, in order (images left out)."""
        return [t for c in self.chunks for t in c.tokens]

    def image_chunks(self) -> list[MediaChunk]:
        """The image chunks, in order."""
        return [c for c in self.chunks if c.is_image]

    def __repr__(self) -> str:
        return (
            f"MediaPrompt({len(self.chunks)} chunks, {self.n_tokens} tokens, "
            f"{self.n_pos} positions, {len(self.images)} images)"
        )


# -- projector -------------------------------------------------------------------------------


class Projector:
    """A vision projector bound to a text model: tokenize, encode (cached), decode embeddings.

    Args:
        path: the projector (mmproj) GGUF.
        model: the loaded text model it must fit (:class:`nbkv.backend.Model`).
        cache: where embeddings are kept between requests (shared by several projectors or
            engines if you like); default a private 256 MiB one.
        n_threads: encoder threads (default: all cores). On CPUs shared with other work,
            1 can be much faster: ggml's threads spin at barriers and stall when a core is
            taken (a 16-token encode went from 1 ms to ~200 ms with 2 threads on 2 busy cores).
        trust_projector: let projector types nbkv does not validate through (see
            :func:`inspect_projector`).
        flash_attn: the encoder's flash attention, llama.cpp's convention (-1 auto, 0 off).

    The projector keeps pointers into ``model``: close it before the model. Thread safety:
    tokenizing may run in any thread (not concurrently with :meth:`close`); encoding is
    serialized by a lock (it never touches a llama context, so the engine can encode in the
    caller's thread while its scheduler decodes); :meth:`decode_chunk` must run where the
    context is used.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: Model,
        *,
        cache: EmbeddingCache | None = None,
        n_threads: int | None = None,
        trust_projector: bool = False,
        flash_attn: int = -1,
        warmup: bool = True,
    ) -> None:
        self.info = inspect_projector(path, model, trust=trust_projector)
        self.model = model
        self.path = self.info.path
        self.identity = f"{self.info.projector_type}:{file_identity(self.path)[:32]}"
        self.cache = cache if cache is not None else EmbeddingCache()
        self.stats = MediaStats()
        self.n_embd = int(llama_cpp.llama_model_n_embd_inp(model.ptr))
        self._lock = threading.Lock()
        M = _lib()
        params = M.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = n_threads or max(os.cpu_count() or 1, 1)
        params.flash_attn_type = flash_attn
        params.warmup = warmup
        _native_errors()
        ptr = M.mtmd_init_from_file(str(self.path).encode(), model.ptr, params)
        if not ptr:
            detail = _native_errors()
            raise ProjectorError(
                f"libmtmd could not load the projector {self.path}"
                + (f": {detail}" if detail else "")
            )
        self._ctx = ptr
        self._finalizer = weakref.finalize(self, M.mtmd_free, ptr)
        if not M.mtmd_support_vision(ptr):
            self.close()
            raise ProjectorError(f"{self.path} has no vision encoder")
        self.marker = (M.mtmd_get_marker(ptr) or MARKER.encode()).decode()
        self.uses_mrope = bool(M.mtmd_decode_use_mrope(ptr))
        self.non_causal = bool(M.mtmd_decode_use_non_causal(ptr, None))

    # lifecycle

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the native projector (prompts tokenized with it become unusable)."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> Projector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _native(self) -> int:
        if self.closed:
            raise MediaError("the projector was closed")
        return self._ctx

    def __repr__(self) -> str:
        i = self.info
        return (
            f"Projector({i.projector_type}, {self.path.name}, vision {i.n_embd}x{i.n_layer}, "
            f"{i.image_size}px/{i.patch_size}px, out {self.n_embd})"
        )

    # tokenize

    def tokenize(
        self,
        text: str,
        images: Sequence[Any] = (),
        *,
        add_special: bool = False,
        parse_special: bool = True,
        use_cache: bool = True,
    ) -> MediaPrompt:
        """Split ``text`` at its media markers into chunks, one image per marker, in order.

        ``images`` may be :class:`~nbkv.media.Image` objects or anything
        :func:`~nbkv.media.load_image` takes. The marker is :attr:`marker` (libmtmd's
        ``<__media__>``). Images whose embeddings are cached are tokenized as placeholders
        (``use_cache=True``): only their size is passed, skipping the pixel preprocessing.
        """
        M = _lib()
        imgs = [load_image(i) for i in images]
        n_markers = text.count(self.marker)
        if n_markers != len(imgs):
            raise MediaError(
                f"the prompt has {n_markers} media marker(s) and {len(imgs)} image(s); each "
                f"image needs exactly one {self.marker!r} in the text"
            )
        ctx = self._native()
        bitmaps = []
        keep: list[Any] = []  # pixel buffers must outlive the bitmaps
        placeholders: set[int] = set()
        try:
            for i, img in enumerate(imgs):
                cached = use_cache and self.cache.peek((self.identity, img.hash)) is not None
                if cached:
                    bm = M.mtmd_bitmap_init(img.width, img.height, None)
                    placeholders.add(i)
                else:
                    buf = (ctypes.c_uint8 * img.nbytes).from_buffer_copy(img.data)
                    keep.append(buf)
                    bm = M.mtmd_bitmap_init(img.width, img.height, buf)
                if not bm:
                    raise MediaError(f"libmtmd could not create a bitmap for {img!r}")
                bitmaps.append(bm)
                M.mtmd_bitmap_set_id(bm, f"{i}:{img.hash}".encode())
            data = text.encode("utf-8")
            inp = M.mtmd_input_text(data, len(data), add_special, parse_special)
            arr = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            native = M.mtmd_input_chunks_init()
            prompt = MediaPrompt(self, native, imgs)
            _native_errors()
            rc = M.mtmd_tokenize(ctx, native, ctypes.byref(inp), arr, len(bitmaps))
        finally:
            for bm in bitmaps:
                M.mtmd_bitmap_free(bm)
        if rc != 0:
            prompt.close()
            detail = _native_errors()
            raise MediaError(
                f"libmtmd could not tokenize the prompt (code {rc}"
                + (f": {detail}" if detail else "") + ")"
            )
        prompt.chunks = self._read_chunks(prompt, native, imgs, placeholders)
        n_img = [c for c in prompt.chunks if c.is_image]
        self.stats.add(
            images_tokenized=len(imgs), image_chunks=len(n_img),
            image_tokens=sum(c.n_tokens for c in n_img),
            image_positions=sum(c.n_pos for c in n_img), placeholders=len(placeholders),
        )
        return prompt

    def _read_chunks(
        self, prompt: MediaPrompt, native: int, imgs: list[Image], placeholders: set[int]
    ) -> tuple[MediaChunk, ...]:
        M = _lib()
        out = []
        sub: dict[int, int] = {}
        for i in range(M.mtmd_input_chunks_size(native)):
            ch = M.mtmd_input_chunks_get(native, i)
            kind = M.mtmd_input_chunk_get_type(ch)
            n_pos = int(M.mtmd_input_chunk_get_n_pos(ch))
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                toks = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                tokens = tuple(toks[: n.value]) if n.value else ()
                bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
                if bad:  # an unknown special token: evaluating it would abort natively
                    prompt.close()
                    raise MediaError(
                        f"libmtmd produced invalid token id(s) {bad[:3]} for the text model; "
                        "the projector does not fit it"
                    )
                out.append(MediaChunk(i, "text", len(tokens), n_pos, tokens, _prompt=prompt,
                                      _ptr=ch))
            elif kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                cid = (M.mtmd_input_chunk_get_id(ch) or b"").decode()
                idx_s, _, h = cid.partition(":")
                idx = int(idx_s)
                if not (0 <= idx < len(imgs)) or imgs[idx].hash != h:
                    prompt.close()
                    raise MediaError(f"libmtmd returned an image chunk with unknown id {cid!r}")
                k = sub.get(idx, 0)
                sub[idx] = k + 1
                out.append(MediaChunk(
                    i, "image", int(M.mtmd_input_chunk_get_n_tokens(ch)), n_pos,
                    image=imgs[idx], image_index=idx, sub_index=k,
                    placeholder=idx in placeholders,
                    _prompt=prompt, _ptr=ch,
                ))
            else:
                prompt.close()
                raise MediaError("audio chunks are not supported")
        return tuple(out)

    # encode

    def embed(self, prompt: MediaPrompt, *, use_cache: bool = True) -> dict[str, ImageEmbedding]:
        """Embeddings of every picture in ``prompt``, by image hash: cached, else encoded.

        Each distinct picture counts one cache hit or one encode (however many times it
        appears). The result holds references, so a later cache eviction cannot take
        embeddings away from a request that already has them. ``use_cache=False`` always
        runs the encoder (the fresh result still replaces the cached one).
        """
        out: dict[str, ImageEmbedding] = {}
        for c in prompt.chunks:
            if c.is_image and c.image is not None and c.image.hash not in out:
                out[c.image.hash] = self.embedding(c.image, use_cache=use_cache, _prompt=prompt)
        return out

    def embedding(
        self, image: Any, *, use_cache: bool = True, _prompt: MediaPrompt | None = None
    ) -> ImageEmbedding:
        """The embeddings of one picture: from the cache, else by running the encoder."""
        img = load_image(image)
        key = (self.identity, img.hash)
        hit = self.cache.get(key) if use_cache else None
        if hit is not None:
            self.stats.add(cache_hits=1)
            return hit
        if use_cache:
            self.stats.add(cache_misses=1)
        chunks = []
        if _prompt is not None:
            chunks = [c for c in _prompt.chunks if c.image is not None
                      and c.image.hash == img.hash and not c.placeholder]
            first = chunks[0].image_index if chunks else -1
            chunks = [c for c in chunks if c.image_index == first]
        if chunks:
            emb = self._encode(img, chunks)
        else:  # tokenized as a placeholder, or not tokenized at all: tokenize it alone
            with self.tokenize(self.marker, [img], use_cache=False) as solo:
                emb = self._encode(img, solo.image_chunks())
        self.cache.put(key, emb)
        return emb

    def encode_chunk(self, chunk: MediaChunk) -> np.ndarray:
        """Run the encoder on one image chunk; a read-only ``(n_tokens, n_embd)`` copy.

        Counts an encoder run; does not consult or fill the cache (see :meth:`embedding`).
        """
        M = _lib()
        if not chunk.is_image:
            raise MediaError("only image chunks can be encoded")
        if chunk.placeholder:
            raise MediaError("a placeholder chunk (tokenized without pixels) cannot be encoded")
        ptr = chunk.native()
        with self._lock:
            ctx = self._native()
            _native_errors()
            t0 = time.perf_counter()
            rc = M.mtmd_encode_chunk(ctx, ptr)
            dt = time.perf_counter() - t0
            if rc != 0:
                detail = _native_errors()
                raise MediaError(
                    f"the vision encoder failed on {chunk.image!r} (code {rc}"
                    + (f": {detail}" if detail else "") + ")"
                )
            out = M.mtmd_get_output_embd(ctx)
            n = chunk.n_tokens
            arr = np.ctypeslib.as_array(out, shape=(n, self.n_embd)).copy()
        arr.setflags(write=False)
        self.stats.add(encoder_runs=1, encode_seconds=dt)
        if not np.isfinite(arr).all():
            raise MediaError(f"the vision encoder produced non-finite values for {chunk.image!r}")
        return arr

    def _encode(self, img: Image, chunks: list[MediaChunk]) -> ImageEmbedding:
        t0 = time.perf_counter()
        arrays = tuple(self.encode_chunk(c) for c in sorted(chunks, key=lambda c: c.sub_index))
        dt = time.perf_counter() - t0
        self.stats.add(images_encoded=1)
        return ImageEmbedding(img.hash, self.identity, arrays, dt)

    # decode

    def decode_chunk(
        self,
        ctx: Context,
        chunk: MediaChunk,
        seq: int,
        pos: int,
        *,
        embedding: ImageEmbedding | None = None,
        logits_last: bool = False,
        n_batch: int | None = None,
    ) -> int:
        """Decode an image chunk's embeddings into sequence ``seq`` from KV position ``pos``.

        The embeddings come from ``embedding`` (as returned by :meth:`embed`), else from the
        cache, else the encoder runs. Returns the next free position (``pos + chunk.n_pos``).
        ``logits_last`` computes logits for the last embedding (:meth:`decode_chunk_logits`
        returns them). Causal projectors are decoded in sub-batches of ``n_batch`` (default
        the context's); non-causal ones (gemma3) in one batch, which must fit the context's
        micro-batch.

        On failure nothing stays in ``seq`` from ``pos`` on (whatever was decoded is
        removed) and :class:`~nbkv.errors.DecodeError` (or a pre-flight
        :class:`~nbkv.errors.MediaError` / :class:`~nbkv.errors.ContextOverflowError`,
        before anything ran) is raised.
        """
        self._decode(ctx, chunk, seq, pos, embedding, logits_last, n_batch)
        return pos + chunk.n_pos

    def decode_chunk_logits(
        self, ctx: Context, chunk: MediaChunk, seq: int, pos: int, *,
        embedding: ImageEmbedding | None = None, n_batch: int | None = None,
    ) -> np.ndarray:
        """Like :meth:`decode_chunk` with ``logits_last``; returns a copy of those logits."""
        idx = self._decode(ctx, chunk, seq, pos, embedding, True, n_batch)
        return np.array(ctx.logits(idx), dtype=np.float32)

    def _decode(
        self, ctx: Context, chunk: MediaChunk, seq: int, pos: int,
        embedding: ImageEmbedding | None, logits_last: bool, n_batch: int | None,
    ) -> int:
        M = _lib()
        if not chunk.is_image or chunk.image is None:
            raise MediaError("decode_chunk takes image chunks (text is decoded with a Batch)")
        if not 0 <= seq < ctx.n_seq_max:
            raise MediaError(f"sequence {seq} does not exist (the context has {ctx.n_seq_max})")
        if pos < 0:
            raise MediaError(f"position {pos} is negative")
        end = pos + chunk.n_pos
        if end > ctx.n_ctx_seq:
            raise ContextOverflowError(end, ctx.n_ctx_seq)
        ptr = chunk.native()
        ctx_m = self._native()
        if embedding is None:
            embedding = self.embedding(chunk.image, _prompt=chunk._prompt)
        if embedding.image_hash != chunk.image.hash or embedding.projector_id != self.identity:
            raise MediaError("these embeddings belong to another image or projector")
        if chunk.sub_index >= len(embedding.arrays):
            raise MediaError("the embeddings have fewer chunks than the image")
        embd = embedding.arrays[chunk.sub_index]
        n = chunk.n_tokens
        if embd.shape != (n, self.n_embd) or embd.dtype != np.float32:
            raise MediaError(
                f"embeddings of shape {embd.shape} do not fit a chunk of {n} x {self.n_embd}"
            )
        embd = np.ascontiguousarray(embd)
        non_causal = bool(M.mtmd_decode_use_non_causal(ctx_m, ptr))
        n_ubatch = int(llama_cpp.llama_n_ubatch(ctx.ptr))
        if non_causal and n > n_ubatch:
            # llama.cpp asserts (aborts) on this: non-causal attention needs the whole image in
            # one micro-batch
            raise MediaError(
                f"this projector attends over a whole image at once ({n} embeddings), but the "
                f"context's micro-batch holds {n_ubatch}: create it with n_batch >= {n}"
            )
        step = n if non_causal else max(1, min(n_batch or ctx.n_batch, n_ubatch, n))
        n_pos_per = 4 if self.uses_mrope else 1
        positions = np.empty((n_pos_per, n), dtype=np.int32)
        if self.uses_mrope:
            imgt = M.mtmd_input_chunk_get_tokens_image(ptr)
            for i in range(n):
                d = M.mtmd_image_tokens_get_decoder_pos(imgt, pos, i)
                positions[:, i] = (d.t, d.y, d.x, d.z)
        else:
            positions[0] = np.arange(pos, pos + n, dtype=np.int32)
        seq_arr = (llama_cpp.llama_seq_id * 1)(seq)
        seq_ptrs = (ctypes.POINTER(llama_cpp.llama_seq_id) * step)(
            *([ctypes.cast(seq_arr, ctypes.POINTER(llama_cpp.llama_seq_id))] * step)
        )
        n_seq = (ctypes.c_int32 * step)(*([1] * step))
        logits = (ctypes.c_int8 * step)()
        last_index = -1
        t0 = time.perf_counter()
        if non_causal:
            llama_cpp.llama_set_causal_attn(ctx.ptr, False)
        try:
            off = 0
            for k in _split(n, step):
                pos_k = np.ascontiguousarray(positions[:, off : off + k])  # section-major
                emb_k = embd[off : off + k]
                for j in range(k):
                    logits[j] = 0
                if logits_last and off + k == n:
                    logits[k - 1] = 1
                    last_index = k - 1
                batch = llama_cpp.llama_batch(
                    n_tokens=k,
                    token=None,
                    embd=emb_k.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                    pos=pos_k.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos)),
                    n_seq_id=ctypes.cast(n_seq, ctypes.POINTER(ctypes.c_int32)),
                    seq_id=ctypes.cast(seq_ptrs,
                                       ctypes.POINTER(ctypes.POINTER(llama_cpp.llama_seq_id))),
                    logits=ctypes.cast(logits, ctypes.POINTER(ctypes.c_int8)),
                )
                rc = llama_cpp.llama_decode(ctx.ptr, batch)
                if rc != 0:
                    raise DecodeError(
                        f"llama_decode failed with code {rc} on {k} image embeddings of "
                        f"{chunk.image!r} (sequence {seq}, position {pos + off})"
                    )
                off += k
        except BaseException:
            llama_cpp.llama_memory_seq_rm(ctx.mem, seq, pos, -1)
            raise
        finally:
            if non_causal:
                llama_cpp.llama_set_causal_attn(ctx.ptr, True)
        self.stats.add(chunks_decoded=1, embeddings_decoded=n, positions_decoded=chunk.n_pos,
                       decode_seconds=time.perf_counter() - t0)
        return last_index

    # reference evaluation of a whole prompt (tests, demos; the engine schedules its own)

    def eval_prompt(
        self,
        ctx: Context,
        prompt: MediaPrompt,
        seq: int,
        pos: int = 0,
        *,
        start: int = 0,
        embeddings: dict[str, ImageEmbedding] | None = None,
    ) -> tuple[int, np.ndarray]:
        """Decode ``prompt.chunks[start:]`` into ``seq`` from ``pos``; (next position, logits).

        Text chunks go through a :class:`~nbkv.backend.Batch` of ``ctx.n_batch`` tokens,
        image chunks through :meth:`decode_chunk`. The logits are those of the prompt's last
        token or embedding (a copy). On failure, ``seq`` is trimmed back to ``pos``.
        """
        chunks = prompt.chunks[start:]
        if not chunks:
            raise MediaError("nothing to evaluate")
        embeddings = dict(embeddings or {})
        for c in chunks:  # before touching the sequence: an encoder failure leaves it as is
            if c.image is not None and c.image.hash not in embeddings:
                embeddings[c.image.hash] = self.embedding(c.image, _prompt=prompt)
        logits: np.ndarray | None = None
        p0 = pos
        batch = Batch(ctx.n_batch)
        try:
            for ci, c in enumerate(chunks):
                last = ci == len(chunks) - 1
                if c.is_image:
                    assert c.image is not None
                    emb = embeddings[c.image.hash]
                    if last:
                        logits = self.decode_chunk_logits(ctx, c, seq, pos, embedding=emb)
                    else:
                        self.decode_chunk(ctx, c, seq, pos, embedding=emb)
                    pos += c.n_pos
                    continue
                toks = c.tokens
                if pos + len(toks) > ctx.n_ctx_seq:
                    raise ContextOverflowError(pos + len(toks), ctx.n_ctx_seq)
                for off in range(0, len(toks), ctx.n_batch):
                    part = toks[off : off + ctx.n_batch]
                    batch.clear()
                    end = last and off + len(part) == len(toks)
                    i = batch.add_run(part, pos + off, seq, logits_last=end)
                    ctx.decode(batch)
                    if end:
                        logits = np.array(ctx.logits(i), dtype=np.float32)
                pos += len(toks)
        except BaseException:
            llama_cpp.llama_memory_seq_rm(ctx.mem, seq, p0, -1)
            raise
        finally:
            batch.close()
        assert logits is not None
        return pos, logits
