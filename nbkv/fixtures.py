"""Synthetic vision projectors (mmproj GGUF files) for tests and demos.

No vision model is downloaded anywhere in nbkv's tests: :func:`make_mmproj` writes a projector
with fixed-seed random weights that libmtmd loads and runs like a real one, shaped for a given
text model width (576 for the embedded SmolLM2-135M). The image it "sees" is real (an
inverted picture gives different embeddings); what it says about it is noise.

Files are written with the ``gguf`` package (``pip install gguf``), once, into a cache
directory (``$NBKV_CACHE_DIR``, else ``~/.cache/nbkv``), named after every parameter that
changes their content. A missing, truncated or foreign file is regenerated.

Two sizes:

- ``"tiny"``: a 32-px image cut in 8-px patches, a 64-wide 2-block ViT; under 1 MB, encodes
  in well under a millisecond. With the ``mlp`` projector an image is 16 tokens.
- ``"realistic"``: SmolVLM-shaped (768 wide, 12 blocks, 12 heads, 512-px image, 16-px
  patches, ~170 MB in F16); an image costs seconds on a laptop CPU. ``mlp`` gives 1024 tokens
  per image, ``gemma3`` (4x4 average pooling) 64, the Qwen mergers (2x2) 256.

Projector heads: ``mlp`` (LLaVA-1.5: ``mm.0`` -> GELU -> ``mm.2``), ``gemma3`` (pooling,
RMS norm, ``mm.input_projection``), ``idefics3`` (SmolVLM's pixel shuffle + ``mm.model.fc``;
it needs image special tokens that SmolLM2 lacks, which is what makes it a useful *wrong*
projector in tests), ``lfm2`` (pixel unshuffle, layer norm, ``mm.1`` -> GELU -> ``mm.2``;
libmtmd resizes images to 64..256 tokens), ``qwen2vl_merger`` (Qwen2-VL: two patch
convolutions, M-RoPE inside the ViT, 2x2 merge, ``mm.0`` -> GELU -> ``mm.2``),
``qwen2.5vl_merger`` (the same with window attention and SwiGLU blocks) and
``qwen3vl_merger`` (Qwen3-VL: fused ``attn_qkv``, a patch bias and learned position
embeddings resized to the image, and DeepStack: the features of some ViT layers, merged 2x2
by their own ``v.deepstack.N`` MLPs, are concatenated after the main output, so an image
embedding is ``text_width * (1 + deepstack layers)`` wide). llama.cpp's
``tools/mtmd/clip.cpp`` is the authority on keys and shapes.

:func:`make_text_model` writes tiny text models (~14 MB, 64 wide, 4 layers) of the memory
classes SmolLM2 does not cover, with SmolLM2's tokenizer: ``gemma3`` (sliding-window
attention), ``lfm2`` (short convolutions + attention), ``mamba2`` (recurrent) and
``granitehybrid`` (Mamba-2 + attention); and, as text halves of vision pairs, ``llama``
(plain attention), ``qwen2vl`` (M-RoPE, ``rope.dimension_sections``) and ``qwen3vl`` (Qwen3:
per-head q/k norms; interleaved M-RoPE; 2 DeepStack layers, so it takes 3 x 64 = 192-wide
input embeddings), with ``vision=PROJECTOR_TYPE`` appending that projector's image special
tokens to the vocabulary.
Their loaders in llama.cpp's ``src/models/`` are the authority on keys and shapes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Bump when the generator changes what it writes (invalidates cached files).
FIXTURE_VERSION = 2

PROJECTORS = ("mlp", "gemma3", "idefics3", "lfm2", "qwen2vl_merger", "qwen2.5vl_merger",
              "qwen3vl_merger")
_QWEN = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
_QWEN2 = ("qwen2vl_merger", "qwen2.5vl_merger")  # no patch bias, positions or post-norm
KINDS = ("tiny", "realistic")


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that determines a generated projector file's content."""

    kind: str
    projector: str
    seed: int
    text_width: int
    n_embd: int
    n_head: int
    n_ff: int
    n_layer: int
    image_size: int
    patch_size: int
    mm_hidden: int
    scale_factor: int  # gemma3 pooling / idefics3 pixel shuffle / Qwen merge (per side)
    version: int = FIXTURE_VERSION

    @property
    def n_patches(self) -> int:
        """Patches per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        """Embeddings one image becomes (for a single-tile image)."""
        if self.projector == "mlp":
            return self.n_patches
        return self.n_patches // (self.scale_factor**2)

    @property
    def deepstack_layers(self) -> tuple[int, ...]:
        """ViT layers whose features also feed the text model (``qwen3vl_merger`` only).

        Two, like the ``qwen3vl`` text model's DeepStack layers: every layer of the tiny ViT,
        layers 4 and 8 of the realistic one (Qwen3-VL taps 3 of 24 or 27).
        """
        if self.projector != "qwen3vl_merger":
            return ()
        return (0, 1) if self.n_layer <= 2 else (self.n_layer // 3, 2 * self.n_layer // 3)

    @property
    def digest(self) -> str:
        """A short hash of the spec (file names, and a key inside the file)."""
        blob = repr(sorted(asdict(self).items())).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def fixture_spec(
    kind: str = "tiny", projector: str = "mlp", seed: int = 0, text_width: int = 576
) -> FixtureSpec:
    """The shape :func:`make_mmproj` uses for these arguments."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if projector not in PROJECTORS:
        raise ValueError(f"projector must be one of {PROJECTORS}, not {projector!r}")
    if text_width < 1:
        raise ValueError("text_width must be positive")
    if kind == "tiny":
        dims = dict(n_embd=64, n_head=4, n_ff=128, n_layer=2, image_size=32, patch_size=8,
                    mm_hidden=256, scale_factor=2)
    else:  # SmolVLM-256M's vision tower: SigLIP-B/16 at 512 px
        dims = dict(n_embd=768, n_head=12, n_ff=3072, n_layer=12, image_size=512,
                    patch_size=16, mm_hidden=text_width,
                    scale_factor=2 if projector in _QWEN else 4)  # Qwen merges 2x2
    return FixtureSpec(kind=kind, projector=projector, seed=seed, text_width=text_width, **dims)


def cache_dir() -> Path:
    """Where generated files live: ``$NBKV_CACHE_DIR`` or ``~/.cache/nbkv``."""
    env = os.environ.get("NBKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nbkv"


def make_mmproj(
    path: str | os.PathLike | None = None,
    *,
    kind: str = "tiny",
    projector: str = "mlp",
    seed: int = 0,
    text_width: int = 576,
) -> Path:
    """Return the path of a projector GGUF for these parameters, writing it if needed.

    ``path=None`` caches the file in :func:`cache_dir` under a name derived from the
    parameters. An existing file is reused only if it is whole and was generated from the
    same parameters (checked against a digest stored in its metadata); otherwise it is
    rewritten, atomically (concurrent test processes never see a half-written file).

    ``text_width`` is the text model's width (``n_embd``). A ``qwen3vl_merger`` produces it
    once for the main path and once per DeepStack layer, concatenated: its embeddings are
    ``text_width * (1 + len(spec.deepstack_layers))`` wide, the text model's ``n_embd_inp``.
    """
    spec = fixture_spec(kind, projector, seed, text_width)
    if path is None:
        name = f"mmproj-{kind}-{projector}-w{text_width}-s{seed}-{spec.digest}.gguf"
        target = cache_dir() / name
    else:
        target = Path(path).expanduser()
    return _cached(target, spec, _write)


def _cached(target: Path, spec: Any, write: Any) -> Path:
    """``target`` if it already holds ``spec``'s file, else written atomically by ``write``."""
    if _is_valid(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(Path(tmp), spec)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _is_valid(path: Path, spec: FixtureSpec | TextModelSpec) -> bool:
    if not path.is_file():
        return False
    try:
        kv, end = _scan_gguf(path, lambda key: key == "nbkv.fixture.digest")
        field = kv.get("nbkv.fixture.digest")
        return field is not None and field[2] == spec.digest and end <= path.stat().st_size
    except Exception:  # truncated, not a GGUF, unreadable: regenerate
        return False


# GGUF metadata value types (gguf.GGUFValueType) with a fixed-size struct format
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _scan_gguf(path: Path, keep: Callable[[str], bool]) -> tuple[dict[str, tuple], int]:
    """Read a GGUF header quickly, without ``gguf.GGUFReader``.

    Returns ``{key: (type, array item type, value)}`` for the keys ``keep`` accepts, and the
    end offset of the last tensor's data. ``gguf.GGUFReader`` takes seconds on a file with a
    49k-token vocabulary; this skips what it is not asked for.
    """
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def unpack(fmt: str):
            nonlocal pos
            value = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def string(decode: bool = True):
            nonlocal pos
            n = unpack("<Q")
            raw = buf[pos:pos + n] if decode else None
            pos += n
            if pos > len(buf):
                raise ValueError("truncated string")
            return raw.decode("utf-8") if decode else None

        def value(vtype: int, decode: bool):
            nonlocal pos
            if vtype == _STRING:
                return string(decode)
            if vtype in _SCALAR_FMT:
                return unpack(_SCALAR_FMT[vtype])
            if vtype != _ARRAY:
                raise ValueError(f"unknown GGUF value type {vtype}")
            sub, n = unpack("<I"), unpack("<Q")
            if sub == _STRING:
                return [string(decode) for _ in range(n)]
            if sub == _ARRAY:
                return [value(_ARRAY, decode) for _ in range(n)]
            dtype = np.dtype(_SCALAR_FMT[sub])
            items = np.frombuffer(buf, dtype=dtype, count=n, offset=pos) if decode else None
            pos += n * dtype.itemsize
            return items.tolist() if decode else None

        if buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        pos = 4
        unpack("<I")  # version
        n_tensors, n_kv = unpack("<Q"), unpack("<Q")
        kv: dict[str, tuple] = {}
        alignment = 32
        for _ in range(n_kv):
            key = string()
            vtype = unpack("<I")
            sub = struct.unpack_from("<I", buf, pos)[0] if vtype == _ARRAY else None
            wanted = keep(key) or key == "general.alignment"
            v = value(vtype, wanted)
            if key == "general.alignment":
                alignment = int(v)
            if keep(key):
                kv[key] = (vtype, sub, v)
        extents = []
        for _ in range(n_tensors):
            string(False)
            dims = [unpack("<Q") for _ in range(unpack("<I"))]
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(unpack("<I"))]
            extents.append((unpack("<Q"), int(np.prod(dims)) // block * size))
        start = -(-pos // alignment) * alignment
        end = max((start + off + n for off, n in extents), default=start)
    return kv, end


def _write(path: Path, spec: FixtureSpec) -> None:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("generating a projector needs the gguf package: pip install gguf") from e

    rng = np.random.default_rng(spec.seed)
    w = gguf.GGUFWriter(str(path), "clip")

    def mat(rows: int, cols: int) -> np.ndarray:
        """A (rows, cols) numpy matrix = a GGUF tensor with ne = [cols, rows] (y = W x)."""
        a = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        return a.astype(np.float16)

    def vec(n: int, scale: float = 0.02, base: float = 0.0) -> np.ndarray:
        return (base + scale * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    e, p = spec.n_embd, spec.patch_size
    w.add_name(f"nbkv synthetic {spec.projector} projector ({spec.kind})")
    w.add_description("fixed-seed random weights generated by nbkv.fixtures; not a real model")
    w.add_string("nbkv.fixture.digest", spec.digest)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_audio_encoder", False)
    w.add_string("clip.projector_type", spec.projector)
    w.add_uint32("clip.vision.embedding_length", e)
    w.add_uint32("clip.vision.attention.head_count", spec.n_head)
    w.add_uint32("clip.vision.feed_forward_length", spec.n_ff)
    w.add_uint32("clip.vision.block_count", spec.n_layer)
    w.add_uint32("clip.vision.projection_dim", spec.text_width)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", spec.image_size)
    w.add_uint32("clip.vision.patch_size", p)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    if spec.projector in _QWEN:
        w.add_uint32("clip.vision.spatial_merge_size", spec.scale_factor)
        if spec.projector == "qwen2.5vl_merger":  # window attention; every 2nd layer full
            w.add_uint32("clip.vision.n_wa_pattern", 2)
            w.add_bool("clip.use_silu", True)
        if spec.projector == "qwen3vl_merger":
            w.add_bool("clip.use_gelu", True)
            # as llama.cpp's converter writes it; clip.cpp counts the v.deepstack.N tensors
            w.add_array("clip.vision.is_deepstack_layers",
                        [i in spec.deepstack_layers for i in range(spec.n_layer)])
    elif spec.projector != "mlp":
        w.add_uint32("clip.vision.projector.scale_factor", spec.scale_factor)
        w.add_bool("clip.use_gelu", True)

    # patch embedding: a p x p x 3 convolution, ne = [p, p, 3, n_embd]
    patch = rng.standard_normal((e, 3, p, p), dtype=np.float32) / np.sqrt(3 * p * p)
    w.add_tensor("v.patch_embd.weight", patch.astype(np.float16))
    if spec.projector in _QWEN:  # a second conv for the temporal pair; M-RoPE
        patch1 = rng.standard_normal((e, 3, p, p), dtype=np.float32) / np.sqrt(3 * p * p)
        w.add_tensor("v.patch_embd.weight.1", patch1.astype(np.float16))
    if spec.projector not in _QWEN2:  # Qwen3-VL also learns positions (resized to the image)
        w.add_tensor("v.patch_embd.bias", vec(e))
        # position embeddings are added to activations: F32, as llama.cpp's converter writes
        # them (an F16 one makes ggml's CPU add abort the process for SigLIP-style graphs)
        w.add_tensor("v.position_embd.weight", mat(spec.n_patches, e).astype(np.float32))
    fused = spec.projector == "qwen3vl_merger"  # one attn_qkv matrix
    for i in range(spec.n_layer):
        blk = f"v.blk.{i}"
        if fused:
            w.add_tensor(f"{blk}.attn_qkv.weight", mat(3 * e, e))
            w.add_tensor(f"{blk}.attn_qkv.bias", vec(3 * e))
        for name in ("attn_out",) if fused else ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{blk}.{name}.weight", mat(e, e))
            w.add_tensor(f"{blk}.{name}.bias", vec(e))
        w.add_tensor(f"{blk}.ffn_up.weight", mat(spec.n_ff, e))
        w.add_tensor(f"{blk}.ffn_up.bias", vec(spec.n_ff))
        w.add_tensor(f"{blk}.ffn_down.weight", mat(e, spec.n_ff))
        w.add_tensor(f"{blk}.ffn_down.bias", vec(e))
        if spec.projector == "qwen2.5vl_merger":  # SwiGLU
            w.add_tensor(f"{blk}.ffn_gate.weight", mat(spec.n_ff, e))
            w.add_tensor(f"{blk}.ffn_gate.bias", vec(spec.n_ff))
        for ln in ("ln1", "ln2"):
            w.add_tensor(f"{blk}.{ln}.weight", vec(e, base=1.0))
            w.add_tensor(f"{blk}.{ln}.bias", vec(e))
    if spec.projector not in ("mlp", "lfm2", *_QWEN2):
        w.add_tensor("v.post_ln.weight", vec(e, base=1.0))
        w.add_tensor("v.post_ln.bias", vec(e))

    out = spec.text_width
    if spec.projector == "mlp":
        w.add_tensor("mm.0.weight", mat(spec.mm_hidden, e))
        w.add_tensor("mm.0.bias", vec(spec.mm_hidden))
        w.add_tensor("mm.2.weight", mat(out, spec.mm_hidden))
        w.add_tensor("mm.2.bias", vec(out))
    elif spec.projector == "gemma3":
        w.add_tensor("mm.soft_emb_norm.weight", vec(e, base=1.0))
        # used transposed by clip.cpp: ne = [text_width, n_embd]
        w.add_tensor("mm.input_projection.weight", mat(out, e).T.copy())
    elif spec.projector in _QWEN:  # 2x2 patches concatenated, mm.0 -> GELU -> mm.2
        n_in = e * spec.scale_factor**2
        w.add_tensor("mm.0.weight", mat(spec.mm_hidden, n_in))
        w.add_tensor("mm.0.bias", vec(spec.mm_hidden))
        w.add_tensor("mm.2.weight", mat(out, spec.mm_hidden))
        w.add_tensor("mm.2.bias", vec(out))
        for i in spec.deepstack_layers:  # norm over the 2x2 merge, fc1 -> GELU -> fc2
            ds = f"v.deepstack.{i}"
            w.add_tensor(f"{ds}.norm.weight", vec(n_in, base=1.0))
            w.add_tensor(f"{ds}.norm.bias", vec(n_in))
            w.add_tensor(f"{ds}.fc1.weight", mat(spec.mm_hidden, n_in))
            w.add_tensor(f"{ds}.fc1.bias", vec(spec.mm_hidden))
            w.add_tensor(f"{ds}.fc2.weight", mat(out, spec.mm_hidden))
            w.add_tensor(f"{ds}.fc2.bias", vec(out))
    elif spec.projector == "lfm2":  # pixel unshuffle, layer norm, mm.1 -> GELU -> mm.2
        n_in = e * spec.scale_factor**2
        w.add_tensor("mm.input_norm.weight", vec(n_in, base=1.0))
        w.add_tensor("mm.input_norm.bias", vec(n_in))
        w.add_tensor("mm.1.weight", mat(spec.mm_hidden, n_in))
        w.add_tensor("mm.1.bias", vec(spec.mm_hidden))
        w.add_tensor("mm.2.weight", mat(out, spec.mm_hidden))
        w.add_tensor("mm.2.bias", vec(out))
    else:  # idefics3: pixel shuffle concatenates scale^2 patches, then one linear layer
        w.add_tensor("mm.model.fc.weight", mat(out, e * spec.scale_factor**2))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------
# Tiny text models of other architectures
# ---------------------------------------------------------------------------------------------

#: Bump when :func:`make_text_model` changes what it writes (invalidates cached files).
TEXT_MODEL_VERSION = 1

#: Architectures :func:`make_text_model` can write, by llama.cpp's memory class:
#: sliding-window attention, hybrid (short convolutions + attention), recurrent (Mamba-2),
#: hybrid (Mamba-2 + attention, Granite 4.0-H).
TEXT_FAMILIES = ("gemma3", "lfm2", "mamba2", "granitehybrid")

#: Also accepted by :func:`make_text_model`, as text halves of vision pairs: plain attention
#: (SmolVLM's text model is a llama), M-RoPE (Qwen2-VL), interleaved M-RoPE + DeepStack
#: (Qwen3-VL).
VISION_TEXT_FAMILIES = ("llama", "qwen2vl", "qwen3vl")

#: DeepStack layers of the ``qwen3vl`` text model: its first layers each add one more slice of
#: an image embedding (``n_embd_inp = n_embd * (1 + QWEN3VL_DEEPSTACK)``). Not in the spec:
#: changing it changes what :func:`make_text_model` writes (bump TEXT_MODEL_VERSION).
QWEN3VL_DEEPSTACK = 2

#: Special tokens a projector type's libmtmd path looks up in the text vocabulary (required
#: ones and delimiters); ``make_text_model(vision=...)`` appends those SmolLM2 lacks.
VISION_TOKENS: dict[str, tuple[str, ...]] = {
    "gemma3": ("<start_of_image>", "<end_of_image>"),
    "idefics3": ("<fake_token_around_image>", "<global-img>"),
    "lfm2": ("<|img_thumbnail|>", "<|image_start|>", "<|image_end|>"),
    "qwen2vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen2.5vl_merger": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3vl_merger": ("<|vision_start|>", "<|vision_end|>"),
}


@dataclass(frozen=True)
class TextModelSpec:
    """Everything that determines a generated text model's content.

    ``n_head_kv`` is per layer; 0 marks a recurrent layer (short convolution in ``lfm2``,
    Mamba-2 mixer in ``granitehybrid``) the way llama.cpp's loaders read it.
    """

    family: str
    seed: int
    tokenizer: str  # the tokenizer's source file: name and size
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int = 0
    n_head: int = 0
    head_dim: int = 0
    n_head_kv: tuple[int, ...] = ()
    n_swa: int = 0  # gemma3: sliding window; every swa_pattern-th layer is global
    swa_pattern: int = 0
    l_cache: int = 0  # lfm2: short-convolution length
    rope_sections: tuple[int, ...] = ()  # qwen2vl: M-RoPE sections (t, h, w, -), sum head_dim/2
    d_inner: int = 0  # mamba2 / granitehybrid mixer
    d_state: int = 0
    n_ssm_head: int = 0
    n_group: int = 0
    d_conv: int = 0
    extra_tokens: tuple[str, ...] = ()  # appended to the tokenizer (user-defined tokens)
    version: int = TEXT_MODEL_VERSION

    @property
    def digest(self) -> str:
        """A short hash of the spec (file names, and a key inside the file)."""
        blob = repr(sorted(asdict(self).items())).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def text_model_spec(family: str, seed: int = 0, vision: str | None = None, width: int = 64
                    ) -> TextModelSpec:
    """The shape :func:`make_text_model` uses for a family (4 layers, 32-wide heads).

    ``width`` 64 (default: 2 heads) or 256 (8 heads, every matrix 256 or 512 columns wide:
    what K-quants need, see :func:`quantized`).
    """
    families = TEXT_FAMILIES + VISION_TEXT_FAMILIES
    if family not in families:
        raise ValueError(f"family must be one of {families}, not {family!r}")
    if vision is not None and vision not in VISION_TOKENS:
        raise ValueError(f"vision must be one of {tuple(VISION_TOKENS)}, not {vision!r}")
    src = _tokenizer_source()
    extra = VISION_TOKENS[vision] if vision else ()
    if width not in (64, 256):
        raise ValueError(f"width must be 64 or 256, not {width!r}")
    common = dict(family=family, seed=seed, tokenizer=f"{src.name}:{src.stat().st_size}",
                  n_vocab=49152 + len(extra), n_embd=width, n_layer=4)
    if extra:
        common["extra_tokens"] = extra
    attn = dict(n_head=width // 32, head_dim=32, n_ff=2 * width)
    ssm = dict(d_inner=2 * width, d_state=16, n_ssm_head=4, n_group=1, d_conv=4)
    if family == "gemma3":  # layers 0-2 slide over 8 tokens, layer 3 sees everything
        return TextModelSpec(**common, **attn, n_head_kv=(1,) * 4, n_swa=8, swa_pattern=4)
    if family == "lfm2":  # conv, attention, conv, attention
        return TextModelSpec(**common, **attn, n_head_kv=(0, 1, 0, 1), l_cache=3)
    if family == "mamba2":
        return TextModelSpec(**common, **ssm)
    if family == "llama":
        return TextModelSpec(**common, **attn, n_head_kv=(1,) * 4)
    if family == "qwen2vl":  # M-RoPE: 16 rotated pairs per head, split time / height / width
        return TextModelSpec(**common, **attn, n_head_kv=(1,) * 4, rope_sections=(4, 6, 6, 0))
    if family == "qwen3vl":  # interleaved M-RoPE, Qwen3-VL's 24/20/20 of 64 pairs scaled to 16
        return TextModelSpec(**common, **attn, n_head_kv=(1,) * 4, rope_sections=(6, 5, 5, 0))
    # granitehybrid: mamba2, mamba2, attention (no RoPE, as in Granite 4.0-H), mamba2
    return TextModelSpec(**common, **attn, **ssm, n_head_kv=(0, 0, 1, 0))


def _tokenizer_source() -> Path:
    from .models import default_model_path

    return default_model_path()


def make_text_model(family: str, *, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                    vision: str | None = None, width: int = 64) -> Path:
    """Return the path of a tiny random-weight GGUF text model of ``family``, writing it if needed.

    ``family`` is one of :data:`TEXT_FAMILIES`: ``"gemma3"`` (sliding-window attention,
    window 8, three SWA layers then one global), ``"lfm2"`` (hybrid: short convolutions and
    attention), ``"mamba2"`` (recurrent) or ``"granitehybrid"`` (hybrid: Mamba-2 and
    attention). Every model is 64 wide with 4 layers, F16 matrices and F32 norms / SSM
    parameters, an untied output matrix, and the tokenizer (vocabulary, merges, special tokens
    and chat template) of the embedded SmolLM2, so prompts tokenize alike across families.
    Weights are fixed-seed random: the same ``seed`` gives the same bytes; what the model says
    is noise, but it depends on the context.

    Files are cached like :func:`make_mmproj`'s (in ``cache_dir``, default :func:`cache_dir`)
    under a name derived from the parameters; a missing, truncated or foreign file is
    regenerated, atomically.

    ``vision`` (a projector type of :data:`VISION_TOKENS`) appends the image special tokens
    that projector's libmtmd path needs (``"<global-img>"`` for ``idefics3``, ...) as
    user-defined tokens, making the text half of a vision pair; ``family`` may then also be
    ``"llama"`` (plain attention, SmolVLM's text architecture), ``"qwen2vl"`` (M-RoPE) or
    ``"qwen3vl"`` (Qwen3 with interleaved M-RoPE and :data:`QWEN3VL_DEEPSTACK` DeepStack
    layers: it takes 192-wide input embeddings).
    """
    spec = text_model_spec(family, seed, vision, width)
    directory = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    tag = (f"-{vision}" if vision else "") + (f"-w{width}" if width != 64 else "")
    target = directory / f"textmodel-{family}{tag}-s{seed}-{spec.digest}.gguf"
    return _cached(target, spec, _write_text_model)


#: weight types :func:`quantized` makes, as llama.cpp names them (``LLAMA_FTYPE_MOSTLY_*``)
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "Q4_0", "Q8_0", "Q4_1", "F16")


def quantized(source: str | os.PathLike, ftype: str) -> Path:
    """``source`` re-quantized to ``ftype`` (one of :data:`QUANT_TYPES`), made once and cached.

    What a user downloads is mostly K-quants (Q4_K_M, Q6_K) and IQ-quants; the embedded
    model is Q4_1. ``llama_model_quantize`` runs on the source's tensors (requantizing
    already quantized ones); the file is cached by the source's fingerprint, atomically.
    """
    import ctypes

    import llama_cpp

    from .backend import check_gguf, init_backend
    from .gguf_header import gguf_fingerprint

    if ftype not in QUANT_TYPES:
        raise ValueError(f"ftype must be one of {QUANT_TYPES}, not {ftype!r}")
    src = check_gguf(source)
    digest = hashlib.sha256(gguf_fingerprint(src).encode()).hexdigest()[:16]
    target = cache_dir() / f"{src.stem}-{ftype}-{digest}.gguf"
    if target.is_file():
        return target
    init_backend()  # llama.cpp's log goes to the nbkv.llama logger, not stdout
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        if llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(),
                                          ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize failed on {src} -> {ftype}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _default_cache_dir() -> Path:
    return cache_dir()


def _copy_tokenizer(w, source: Path, extra: tuple[str, ...] = ()) -> int:
    """Copy every ``tokenizer.*`` key of ``source`` into the writer; return the vocab size.

    ``extra`` tokens are appended as user-defined ones.
    """
    import gguf

    fields, _ = _scan_gguf(source, lambda key: key.startswith("tokenizer."))
    if extra:
        for key, more in (("tokenizer.ggml.tokens", list(extra)),
                          ("tokenizer.ggml.token_type", [4] * len(extra)),  # USER_DEFINED
                          ("tokenizer.ggml.scores", [0.0] * len(extra))):
            if key in fields:
                vtype, sub, value = fields[key]
                fields[key] = (vtype, sub, list(value) + more)
    for key, (vtype, sub, value) in fields.items():  # in the source's order
        w.add_key_value(key, value, gguf.GGUFValueType(vtype),
                        None if sub is None else gguf.GGUFValueType(sub))
    return len(fields.get("tokenizer.ggml.tokens", (0, 0, []))[2])


def _write_text_model(path: Path, spec: TextModelSpec) -> None:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("generating a model needs the gguf package: pip install gguf") from e

    family = spec.family
    rng = np.random.default_rng([spec.seed, (TEXT_FAMILIES + VISION_TEXT_FAMILIES).index(family)])
    w = gguf.GGUFWriter(str(path), family)

    def mat(rows: int, cols: int, std: float | None = None) -> np.ndarray:
        """A (rows, cols) F16 matrix = a GGUF tensor with ne = [cols, rows] (y = W x)."""
        s = 1.0 / np.sqrt(cols) if std is None else std
        return (s * rng.standard_normal((rows, cols), dtype=np.float32)).astype(np.float16)

    def vec(*shape: int, scale: float = 0.02, base: float = 0.0) -> np.ndarray:
        return (base + scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    def norm(*shape: int) -> np.ndarray:
        return vec(*shape, base=1.0)

    e, hd = spec.n_embd, spec.head_dim
    w.add_name(f"nbkv synthetic {family} text model")
    w.add_description("fixed-seed random weights generated by nbkv.fixtures; not a real model")
    w.add_string("nbkv.fixture.digest", spec.digest)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_uint32(f"{family}.vocab_size", spec.n_vocab)
    w.add_uint32(f"{family}.context_length",
                 8192 if family in ("gemma3", "lfm2", *VISION_TEXT_FAMILIES) else 1 << 20)
    w.add_uint32(f"{family}.embedding_length", e)
    w.add_uint32(f"{family}.block_count", spec.n_layer)
    w.add_uint32(f"{family}.feed_forward_length", spec.n_ff)
    w.add_float32(f"{family}.attention.layer_norm_rms_epsilon", 1e-6)
    if spec.n_head:
        w.add_uint32(f"{family}.attention.head_count", spec.n_head)
        if len(set(spec.n_head_kv)) == 1:
            w.add_uint32(f"{family}.attention.head_count_kv", spec.n_head_kv[0])
        else:  # per layer; 0 = a recurrent layer
            w.add_key_value(f"{family}.attention.head_count_kv", list(spec.n_head_kv),
                            gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
        w.add_uint32(f"{family}.attention.key_length", hd)
        w.add_uint32(f"{family}.attention.value_length", hd)
    if family == "gemma3":
        w.add_uint32(f"{family}.attention.sliding_window", spec.n_swa)
        w.add_uint32(f"{family}.attention.sliding_window_pattern", spec.swa_pattern)
        w.add_float32(f"{family}.rope.freq_base", 1_000_000.0)
        w.add_float32(f"{family}.rope.freq_base_swa", 10_000.0)
    if spec.rope_sections:
        w.add_key_value(f"{family}.rope.dimension_sections", list(spec.rope_sections),
                        gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    if family == "qwen3vl":
        w.add_float32(f"{family}.rope.freq_base", 5_000_000.0)
        w.add_uint32(f"{family}.n_deepstack_layers", QWEN3VL_DEEPSTACK)
    if family == "lfm2":
        w.add_uint32(f"{family}.shortconv.l_cache", spec.l_cache)
        w.add_float32(f"{family}.rope.freq_base", 1_000_000.0)
    if spec.d_inner:
        w.add_uint32(f"{family}.ssm.conv_kernel", spec.d_conv)
        w.add_uint32(f"{family}.ssm.inner_size", spec.d_inner)
        w.add_uint32(f"{family}.ssm.state_size", spec.d_state)
        w.add_uint32(f"{family}.ssm.time_step_rank", spec.n_ssm_head)
        w.add_uint32(f"{family}.ssm.group_count", spec.n_group)
    if family == "granitehybrid":
        w.add_bool(f"{family}.rope.scaling.finetuned", False)  # Granite 4.0-H: no RoPE
    n_vocab = _copy_tokenizer(w, _tokenizer_source(), spec.extra_tokens)
    if n_vocab != spec.n_vocab:
        raise ValueError(f"the tokenizer has {n_vocab} tokens, expected {spec.n_vocab}")

    # embeddings small, so that what the layers add (at unit scale) dominates the residual
    # stream: the next token depends on the context, not only on the current token
    w.add_tensor("token_embd.weight", mat(spec.n_vocab, e, std=0.02))
    w.add_tensor("token_embd_norm.weight" if family == "lfm2" else "output_norm.weight", norm(e))
    w.add_tensor("output.weight", mat(spec.n_vocab, e))

    def attention(blk: str, n_kv: int) -> None:
        n_q = spec.n_head * hd
        w.add_tensor(f"{blk}.attn_q.weight", mat(n_q, e))
        w.add_tensor(f"{blk}.attn_k.weight", mat(n_kv * hd, e))
        w.add_tensor(f"{blk}.attn_v.weight", mat(n_kv * hd, e))
        w.add_tensor(f"{blk}.attn_output.weight", mat(e, n_q))
        if family in ("gemma3", "lfm2", "qwen3vl"):
            w.add_tensor(f"{blk}.attn_q_norm.weight", norm(hd))
            w.add_tensor(f"{blk}.attn_k_norm.weight", norm(hd))

    def ffn(blk: str) -> None:
        w.add_tensor(f"{blk}.ffn_norm.weight", norm(e))
        w.add_tensor(f"{blk}.ffn_gate.weight", mat(spec.n_ff, e))
        w.add_tensor(f"{blk}.ffn_up.weight", mat(spec.n_ff, e))
        w.add_tensor(f"{blk}.ffn_down.weight", mat(e, spec.n_ff))

    def mamba2(blk: str) -> None:
        d_in, g, ds, nh = spec.d_inner, spec.n_group, spec.d_state, spec.n_ssm_head
        conv_dim = d_in + 2 * g * ds
        w.add_tensor(f"{blk}.ssm_in.weight", mat(2 * d_in + 2 * g * ds + nh, e))
        w.add_tensor(f"{blk}.ssm_conv1d.weight", vec(conv_dim, spec.d_conv, scale=0.5))
        w.add_tensor(f"{blk}.ssm_conv1d.bias", vec(conv_dim))
        # dt = softplus(x + dt_bias) starts in [1e-3, 1e-1]; A = -exp(A_log) in [-16, -1]
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), nh))
        w.add_tensor(f"{blk}.ssm_dt.bias", (dt + np.log(-np.expm1(-dt))).astype(np.float32))
        a = -np.exp(rng.uniform(0.0, np.log(16.0), (nh, 1)))
        w.add_tensor(f"{blk}.ssm_a", a.astype(np.float32))
        w.add_tensor(f"{blk}.ssm_d", norm(nh, 1))
        w.add_tensor(f"{blk}.ssm_norm.weight", norm(g, d_in // g))
        w.add_tensor(f"{blk}.ssm_out.weight", mat(e, d_in))

    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", norm(e))
        if family in VISION_TEXT_FAMILIES:
            attention(blk, spec.n_head_kv[i])
            if family == "qwen2vl":  # Qwen2: biased q, k, v
                for n, rows in (("q", spec.n_head * hd), ("k", hd), ("v", hd)):
                    w.add_tensor(f"{blk}.attn_{n}.bias", vec(rows * (1 if n == "q" else
                                                                      spec.n_head_kv[i])))
            ffn(blk)
        elif family == "gemma3":
            attention(blk, spec.n_head_kv[i])
            w.add_tensor(f"{blk}.post_attention_norm.weight", norm(e))
            ffn(blk)
            w.add_tensor(f"{blk}.post_ffw_norm.weight", norm(e))
        elif family == "mamba2":
            mamba2(blk)
        elif family == "lfm2":
            if spec.n_head_kv[i]:
                attention(blk, spec.n_head_kv[i])
            else:
                w.add_tensor(f"{blk}.shortconv.conv.weight", vec(e, spec.l_cache, scale=0.5))
                w.add_tensor(f"{blk}.shortconv.in_proj.weight", mat(3 * e, e))
                w.add_tensor(f"{blk}.shortconv.out_proj.weight", mat(e, e))
            ffn(blk)
        else:  # granitehybrid
            if spec.n_head_kv[i]:
                attention(blk, spec.n_head_kv[i])
            else:
                mamba2(blk)
            ffn(blk)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
