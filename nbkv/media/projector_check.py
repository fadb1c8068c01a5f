"""Projector pre-flight: read an mmproj GGUF with the ``gguf`` package and refuse it early.

Native code aborts the whole process on several wrong inputs (failed ``GGML_ASSERT``: a
projector key stored with another GGUF type, a tensor of the wrong shape or type, image
special tokens the text model lacks...). :func:`inspect_projector` refuses such files
*before* llama.cpp sees them; :class:`nbkv.media.projector.Projector` calls it first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkv.core.errors import ModelLoadError, ProjectorError
from nbkv.llama.backend import Model, check_gguf, llama_cpp_version
from nbkv.llama.gguf_header import read_metadata

log = logging.getLogger("nbkv.media.projector")

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
VALIDATED_PROJECTORS = (
    "mlp", "gemma3", "idefics3", "lfm2", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"
)

#: Projector types that give image tokens multi-axis (M-RoPE) positions: their text model must
#: use M-RoPE, and an M-RoPE text model needs one of them.
MROPE_PROJECTORS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")

# the M-RoPE kind (Model.rope_type) of each M-RoPE projector's text models: Qwen2-VL and
# Qwen2.5-VL rotate sections in blocks, Qwen3-VL interleaves them (LLAMA_ROPE_TYPE_IMROPE)
_MROPE_KIND = {"qwen2vl_merger": "mrope-8", "qwen2.5vl_merger": "mrope-8",
               "qwen3vl_merger": "mrope-40"}
_MROPE_NAME = {"mrope-8": "M-RoPE (Qwen2-VL)", "mrope-40": "interleaved M-RoPE (Qwen3-VL)"}

# tokens libmtmd looks up in the text vocabulary by exact piece (mtmd.cpp, lookup_token); a
# missing one becomes token -1 in a text chunk, which aborts the process when evaluated
REQUIRED_TOKENS: dict[str, tuple[str, ...]] = {
    "idefics3": ("\n\n", "<fake_token_around_image>", "<global-img>", "\n"),
    "resampler": ("<image>", "</image>", "<slice>", "</slice>", "\n"),
    "minicpmv4_6": ("<image>", "</image>", "<slice>", "</slice>", "\n"),
    "step3vl": ("<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"),
    "lfm2": ("<|img_thumbnail|>",),
}

# tokens every text model of the projector's family has: not looked up by libmtmd (a missing
# one does not abort anything), but without them the text model belongs to another family
PAIR_TOKENS: dict[str, tuple[str, ...]] = {
    "qwen2vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen2.5vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3vl_merger": ("<|vision_start|>", "<|vision_end|>"),
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
    n_deepstack: int = 0  # qwen3vl_merger: ViT layers whose features follow the main output


def _gguf_type_name(field: Any) -> str:
    import gguf

    t = field.types[0] if field.types else None
    names: dict[Any, str] = {
        gguf.GGUFValueType.UINT32: _U32, gguf.GGUFValueType.INT32: _I32,
        gguf.GGUFValueType.FLOAT32: _F32, gguf.GGUFValueType.BOOL: _BOOL,
        gguf.GGUFValueType.STRING: _STR, gguf.GGUFValueType.ARRAY: _ARR,
    }
    return names.get(t, getattr(t, "name", "?").lower())


def _array_item_type(field: Any) -> str:
    import gguf

    t = field.types[-1] if len(field.types) > 1 else None
    names: dict[Any, str] = {gguf.GGUFValueType.FLOAT32: _F32, gguf.GGUFValueType.INT32: _I32}
    return names.get(t, getattr(t, "name", "?").lower())


def inspect_projector(
    path: str | os.PathLike, model: Model | None = None, *, trust: bool = False
) -> ProjectorInfo:
    """Check a projector GGUF in Python and describe it; raise :class:`ProjectorError` if unusable.

    Nothing here calls into llama.cpp except vocabulary lookups on ``model``. Checked: the
    file is a whole GGUF (every tensor's data inside the file); it is a vision projector
    (``clip.has_vision_encoder``); its projector type is one libmtmd knows; every key
    ``clip.cpp`` reads has the GGUF type it expects (a mismatch aborts natively); the vision
    hyper-parameters are present and consistent. For the validated types
    (:data:`VALIDATED_PROJECTORS`) also every tensor the graph uses: present, shaped and typed
    as the graph needs. With ``model``: the embedding width it produces equals the text
    model's input width (for ``qwen3vl_merger``: its main width equals the text model's width
    and it has as many DeepStack layers), the text model's RoPE is the kind the projector's
    positions are for, and every special token libmtmd looks up for this projector type exists
    in the text vocabulary (``idefics3``, SmolVLM's projector, needs
    ``<fake_token_around_image>``, which SmolLM2 lacks; a Qwen3-VL vocabulary has
    ``<|vision_start|>``).

    ``trust=True`` lets other projector types through with only the generic checks: a file
    that is wrong in a way nbkv does not know may still abort the process.
    """
    p = Path(path).expanduser()
    try:
        check_gguf(p)
    except (ModelLoadError, FileNotFoundError) as err:
        msg = str(err).replace("model file", "projector file")
        raise ProjectorError(f"vision projector: {msg}") from err
    try:
        import gguf
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ProjectorError("checking a projector needs the gguf package: pip install "
                             "gguf") from err
    size = p.stat().st_size
    arch = _first_architecture(p)
    if arch is not None and arch != "clip":  # fast path: parsing a whole text model is slow
        raise ProjectorError(
            f"{p} is a {arch!r} model, not a vision projector (mmproj) file"
        )
    try:
        reader = gguf.GGUFReader(p)
        tensors = {t.name: t for t in reader.tensors}
    except Exception as err:
        raise ProjectorError(
            f"{p} is not a readable GGUF file (corrupt or truncated): {type(err).__name__}: {err}"
        ) from err
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
            f"(llama-cpp-python {llama_cpp_version()})"
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
    n_ds = len(_deepstack_layers(tensors)) if ptype == "qwen3vl_merger" else 0
    warnings: list[str] = []
    if validated:
        n_out, tokens = _check_tensors(p, ptype, tensors, fld, e, n_ff, n_layer, img, patch, scale)

    if model is not None:
        n_text = model.n_embd_inp
        text_ds = model.n_embd_inp // model.n_embd - 1  # DeepStack layers (Qwen3-VL), else 0
        if n_out is not None and (n_ds or text_ds):  # Qwen3-VL: main width, DeepStack count
            n_main = n_out // (1 + n_ds)
            if n_main != model.n_embd or n_ds != text_ds:
                made = (f"{n_ds} DeepStack feature set(s) of that width ({n_out} in all)"
                        if n_ds else "no DeepStack features")
                has = f"{text_ds} DeepStack layer(s)" if text_ds else "no DeepStack layers"
                raise ProjectorError(
                    f"projector {p.name} produces {n_main}-wide embeddings and {made}, but "
                    f"the text model ({model.description}) is {model.n_embd} wide with {has} "
                    f"(it takes {n_text}): it belongs to another model"
                )
        elif n_out is not None and n_out != n_text:
            raise ProjectorError(
                f"projector {p.name} produces {n_out}-wide embeddings but the text model "
                f"({model.description}) takes {n_text}: it belongs to another model"
            )
        rope = model.rope_type
        mrope_proj = ptype in MROPE_PROJECTORS
        if mrope_proj and rope == _MROPE_KIND[ptype]:
            _check_rope_sections(model)
        elif mrope_proj and rope in _MROPE_NAME and not trust:
            raise ProjectorError(
                f"projector {p.name} ({ptype}) is for text models with "
                f"{_MROPE_NAME[_MROPE_KIND[ptype]]}, but the text model ({model.description}) "
                f"uses {_MROPE_NAME[rope]}: it belongs to another model"
            )
        elif rope not in ("none", "norm", "neox") and not trust:
            raise ProjectorError(
                f"the text model uses RoPE type {rope} (multi-axis image positions) but "
                f"projector {p.name} is {ptype!r}, which gives image tokens one position "
                "each; pass trust_projector=True to try it"
            )
        elif mrope_proj and rope in ("none", "norm", "neox") and not trust:
            raise ProjectorError(
                f"projector {p.name} ({ptype}) gives image tokens multi-axis (M-RoPE) "
                f"positions, but the text model ({model.description}) uses RoPE type {rope}: "
                "the projector belongs to a Qwen-VL model"
            )
        missing = [t for t in REQUIRED_TOKENS.get(ptype, ()) if not _has_token(model, t)]
        if missing:
            raise ProjectorError(
                f"projector {p.name} ({ptype}) needs the image special token(s) "
                f"{', '.join(repr(t) for t in missing)} in the text model's vocabulary, and "
                f"{model.description} has none: the projector belongs to another model "
                "(evaluating its image chunks would abort the process)"
            )
        missing = [t for t in PAIR_TOKENS.get(ptype, ()) if not _has_token(model, t)]
        if missing and not trust:
            raise ProjectorError(
                f"projector {p.name} ({ptype}) wraps images in the image special token(s) "
                f"{', '.join(repr(t) for t in missing)}, which every text model of its family "
                f"has and {model.description} lacks: the projector belongs to another model"
            )
        for tok in DELIMITERS.get(ptype, ()):
            if not _has_token(model, tok):
                warnings.append(
                    f"image delimiter {tok!r} is not a token of the text model; it is fed as "
                    "plain text"
                )
    for w in warnings:
        log.warning("%s: %s", p.name, w)
    return ProjectorInfo(
        path=p, projector_type=ptype, validated=validated, n_embd=e, n_head=n_head, n_ff=n_ff,
        n_layer=n_layer, image_size=img, patch_size=patch, projection_dim=hp["projection_dim"],
        n_embd_out=n_out, scale_factor=scale, tokens_per_tile=tokens, file_size=size,
        n_tensors=len(tensors), warnings=tuple(warnings), n_deepstack=n_ds,
    )


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
    qwen = ptype in MROPE_PROJECTORS
    qwen3 = ptype == "qwen3vl_merger"
    if ptype == "qwen2.5vl_merger" and fld("clip.vision.n_wa_pattern") is None:
        raise ProjectorError(f"{p} ({ptype}): missing clip.vision.n_wa_pattern")
    if qwen:  # two convolutions (a temporal pair), M-RoPE
        pe1 = get("v.patch_embd.weight.1")
        if shape(pe1) != [patch, patch, 3, e] or pe1.tensor_type not in (F32, F16):
            raise ProjectorError(
                f"{p} ({ptype}): v.patch_embd.weight.1 is {pe1.tensor_type.name} "
                f"{shape(pe1)}, the graph needs F16/F32 {[patch, patch, 3, e]}"
            )
        if qwen3:  # clip.cpp asserts both the patch bias and the position embeddings
            expect("v.patch_embd.bias", [e])
        elif "v.patch_embd.bias" in tensors:  # clip.cpp asserts it away (a process abort)
            raise ProjectorError(f"{p} ({ptype}): unexpected v.patch_embd.bias")
        if (e // int(fld("clip.vision.attention.head_count").contents())) % 4:
            raise ProjectorError(f"{p} ({ptype}): the vision head size must be a multiple of 4")
    else:
        expect("v.patch_embd.bias", [e], required=False)
    has_class = "v.class_embd" in tensors
    if has_class and ptype != "mlp":
        raise ProjectorError(f"{p} ({ptype}): unexpected v.class_embd")
    if has_class:
        expect("v.class_embd", [e], f32=True)
    if not qwen or qwen3:  # Qwen3-VL resizes them to the image's patch grid
        expect("v.position_embd.weight", [e, n_patches + (1 if has_class else 0)], f32=True)
    for ln in ("pre_ln", "post_ln"):
        expect(f"v.{ln}.weight", [e], required=False)
        expect(f"v.{ln}.bias", [e], required=False)
    for i in range(n_layer):
        b = f"v.blk.{i}"
        if qwen3:  # the graph uses one fused q, k, v matrix and its bias, unconditionally
            expect(f"{b}.attn_qkv.weight", [e, 3 * e])
            expect(f"{b}.attn_qkv.bias", [3 * e])
        elif f"{b}.attn_qkv.weight" in tensors:
            raise ProjectorError(f"{p} ({ptype}): fused attn_qkv tensors are not validated")
        for n in ("attn_out",) if qwen3 else ("attn_q", "attn_k", "attn_v", "attn_out"):
            expect(f"{b}.{n}.weight", [e, e])
            expect(f"{b}.{n}.bias", [e], required=False)
        for n in ("ln1", "ln2"):
            expect(f"{b}.{n}.weight", [e], required=False)
            expect(f"{b}.{n}.bias", [e], required=False)
        up, down = get(f"{b}.ffn_up.weight"), get(f"{b}.ffn_down.weight")
        # legacy swapped names (clip.cpp swaps them back, but not for Qwen3-VL)
        if shape(up) == [n_ff, e] and shape(down) == [e, n_ff] and not qwen3:
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
        if ptype == "qwen2.5vl_merger":  # SwiGLU: the gate is shaped like up
            expect(f"{b}.ffn_gate.weight", shape(get(up_b.replace("bias", "weight"))))
            expect(f"{b}.ffn_gate.bias", [n_ff], required=False)
        elif f"{b}.ffn_gate.weight" in tensors or f"{b}.ffn_gate_exps.weight" in tensors:
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
    if qwen:  # 2x2 neighbouring patches concatenated, mm.0 -> GELU -> mm.2
        merge = fld("clip.vision.spatial_merge_size")
        if merge is not None and int(merge.contents()) != 2:
            raise ProjectorError(
                f"{p} ({ptype}): spatial_merge_size {int(merge.contents())}; the graph merges 2x2"
            )
        n_in = 4 * e
        w0 = get("mm.0.weight")
        if len(w0.shape) != 2 or int(w0.shape[0]) != n_in:
            raise ProjectorError(
                f"{p} ({ptype}): mm.0.weight has shape {shape(w0)}, expected [{n_in}, hidden]"
            )
        hidden = int(w0.shape[1])
        expect("mm.0.bias", [hidden])
        w2 = get("mm.2.weight")
        if len(w2.shape) != 2 or int(w2.shape[0]) != hidden:
            raise ProjectorError(
                f"{p} ({ptype}): mm.2.weight has shape {shape(w2)}, expected [{hidden}, n_out]"
            )
        n_out = int(w2.shape[1])
        expect("mm.2.bias", [n_out])
        layers = _deepstack_layers(tensors) if qwen3 else ()
        for i in layers:  # DeepStack: the 2x2 merge of layer i, norm, fc1 -> GELU -> fc2
            d = f"v.deepstack.{i}"
            if i >= n_layer:  # clip.cpp ignores it: the output would be narrower than counted
                raise ProjectorError(
                    f"{p} ({ptype}): {d}.* belongs to no layer (the ViT has {n_layer})"
                )
            expect(f"{d}.norm.weight", [n_in], required=False)
            expect(f"{d}.norm.bias", [n_in], required=False)
            w1 = get(f"{d}.fc1.weight")
            if len(w1.shape) != 2 or int(w1.shape[0]) != n_in:
                raise ProjectorError(
                    f"{p} ({ptype}): {d}.fc1.weight has shape {shape(w1)}, expected "
                    f"[{n_in}, hidden]"
                )
            expect(f"{d}.fc1.bias", [int(w1.shape[1])], required=False)
            # libmtmd sizes the output as (1 + DeepStack layers) x mm.2's width, and aborts
            # when the graph's differs
            expect(f"{d}.fc2.weight", [int(w1.shape[1]), n_out])
            expect(f"{d}.fc2.bias", [n_out], required=False)
        # libmtmd resizes the image (8..4096 tokens); this is the count at image_size
        return n_out * (1 + len(layers)), (side // 2) ** 2
    if ptype == "lfm2":  # pixel unshuffle, optional layer norm, mm.1 -> GELU -> mm.2
        k = scale if scale is not None else 1
        if k < 1 or side % k:
            raise ProjectorError(f"{p} (lfm2): {side} patches per side do not unshuffle by {k}")
        n_in = e * k * k
        expect("mm.input_norm.weight", [n_in], required=False)
        expect("mm.input_norm.bias", [n_in], required=False)
        w1 = get("mm.1.weight")
        if len(w1.shape) != 2 or int(w1.shape[0]) != n_in:
            raise ProjectorError(
                f"{p} (lfm2): mm.1.weight has shape {shape(w1)}, expected [{n_in}, hidden]"
            )
        hidden = int(w1.shape[1])
        expect("mm.1.bias", [hidden], required=False)
        w2 = get("mm.2.weight")
        if len(w2.shape) != 2 or int(w2.shape[0]) != hidden:
            raise ProjectorError(
                f"{p} (lfm2): mm.2.weight has shape {shape(w2)}, expected [{hidden}, n_out]"
            )
        n_out = int(w2.shape[1])
        expect("mm.2.bias", [n_out], required=False)
        # libmtmd resizes the image to 64..256 tokens; this is the count at image_size
        return n_out, (side // k) ** 2
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


#: Projector types whose image chunks libmtmd decodes with non-causal attention, in one batch
#: (``mtmd_decode_use_non_causal``): the micro-batch must hold a whole image chunk.
NON_CAUSAL_PROJECTORS = ("gemma3", "gemma4uv", "deepseek4v")


def batch_for_projector(path: str | os.PathLike | None, n_batch: int) -> int:
    """``n_batch`` raised, with a log line, to hold one image chunk of a non-causal projector.

    Gemma 3's image tokens attend to each other both ways, so libmtmd decodes a whole image in
    one micro-batch; a smaller one makes llama.cpp assert. The count is the projector's tokens
    per image (fixed for these types: the image is resized to ``image_size``). Anything this
    cannot read is left to :func:`inspect_projector`, which reports it properly.
    """
    if path is None:
        return n_batch
    try:
        info = inspect_projector(path, trust=True)
    except ProjectorError:
        return n_batch
    need = info.tokens_per_tile
    if info.projector_type in NON_CAUSAL_PROJECTORS and need and need > n_batch:
        log.info("n_batch raised from %d to %d: %s images are decoded in one non-causal "
                 "batch of %d tokens", n_batch, need, info.projector_type, need)
        return need
    return n_batch


def _deepstack_layers(tensors: dict[str, Any]) -> tuple[int, ...]:
    """ViT layers with a DeepStack merger: clip.cpp counts those with ``v.deepstack.N.fc1``."""
    found = (re.fullmatch(r"v\.deepstack\.(\d+)\.fc1\.weight", name) for name in tensors)
    return tuple(sorted(int(m.group(1)) for m in found if m))


def _check_rope_sections(model: Model) -> None:
    """Check an M-RoPE text model's ``rope.dimension_sections``.

    They must be 4 non-negative counts of rotated pairs (time, height, width, extra) that sum
    to half the rotated head size.
    """
    arch = model.meta("general.architecture") or ""
    path = getattr(model, "path", None)
    if path is None:
        return
    sections = _gguf_array(Path(path), f"{arch}.rope.dimension_sections")
    if sections is None:
        raise ProjectorError(
            f"the text model ({model.description}) uses M-RoPE but has no "
            f"{arch}.rope.dimension_sections"
        )
    n_rot: Any = (model.meta(f"{arch}.rope.dimension_count")
                  or model.meta(f"{arch}.attention.key_length"))
    if n_rot is None:
        heads = model.meta(f"{arch}.attention.head_count")
        width = model.meta(f"{arch}.embedding_length")
        n_rot = int(width) // int(heads) if heads and width else None
    if len(sections) != 4 or any(int(x) < 0 for x in sections) or sum(sections[:3]) == 0:
        raise ProjectorError(
            f"the text model's {arch}.rope.dimension_sections {list(sections)} must be 4 "
            "non-negative counts (time, height, width, extra), not all zero"
        )
    if n_rot is not None and sum(int(x) for x in sections) != int(n_rot) // 2:
        raise ProjectorError(
            f"the text model's {arch}.rope.dimension_sections {list(sections)} sum to "
            f"{sum(int(x) for x in sections)}, but its heads rotate {int(n_rot) // 2} pairs "
            f"(rope dimension {n_rot}): image positions would be rotated wrongly"
        )


def _gguf_array(path: Path, key: str) -> list[int] | None:
    """One metadata array of a GGUF file (its header only), or None."""
    value = read_metadata(path).get(key)
    return list(value) if isinstance(value, list) else None


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

