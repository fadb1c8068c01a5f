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
  per image, ``gemma3`` (4x4 average pooling) 64.

Projector heads: ``mlp`` (LLaVA-1.5: ``mm.0`` -> GELU -> ``mm.2``), ``gemma3`` (pooling,
RMS norm, ``mm.input_projection``) and ``idefics3`` (SmolVLM's pixel shuffle + ``mm.model.fc``;
it needs image special tokens that SmolLM2 lacks, which is what makes it a useful *wrong*
projector in tests). llama.cpp's ``tools/mtmd/clip.cpp`` is the authority on keys and shapes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

#: Bump when the generator changes what it writes (invalidates cached files).
FIXTURE_VERSION = 2

PROJECTORS = ("mlp", "gemma3", "idefics3")
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
    scale_factor: int  # gemma3 pooling kernel / idefics3 pixel-shuffle factor (per side)
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
                    patch_size=16, mm_hidden=text_width, scale_factor=4)
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
    """
    spec = fixture_spec(kind, projector, seed, text_width)
    if path is None:
        name = f"mmproj-{kind}-{projector}-w{text_width}-s{seed}-{spec.digest}.gguf"
        target = cache_dir() / name
    else:
        target = Path(path).expanduser()
    if _is_valid(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        _write(Path(tmp), spec)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _is_valid(path: Path, spec: FixtureSpec) -> bool:
    if not path.is_file():
        return False
    try:
        import gguf

        reader = gguf.GGUFReader(path)
        field = reader.get_field("nbkv.fixture.digest")
        if field is None or field.contents() != spec.digest:
            return False
        size = path.stat().st_size
        return all(t.data_offset + t.n_bytes <= size for t in reader.tensors)
    except Exception:  # truncated, not a GGUF, unreadable: regenerate
        return False


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
    if spec.projector != "mlp":
        w.add_uint32("clip.vision.projector.scale_factor", spec.scale_factor)
        w.add_bool("clip.use_gelu", True)

    # patch embedding: a p x p x 3 convolution, ne = [p, p, 3, n_embd]
    patch = rng.standard_normal((e, 3, p, p), dtype=np.float32) / np.sqrt(3 * p * p)
    w.add_tensor("v.patch_embd.weight", patch.astype(np.float16))
    w.add_tensor("v.patch_embd.bias", vec(e))
    # position embeddings are added to activations: F32, as llama.cpp's converter writes them
    # (an F16 one makes ggml's CPU add abort the process for SigLIP-style graphs)
    w.add_tensor("v.position_embd.weight", mat(spec.n_patches, e).astype(np.float32))
    for i in range(spec.n_layer):
        blk = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{blk}.{name}.weight", mat(e, e))
            w.add_tensor(f"{blk}.{name}.bias", vec(e))
        w.add_tensor(f"{blk}.ffn_up.weight", mat(spec.n_ff, e))
        w.add_tensor(f"{blk}.ffn_up.bias", vec(spec.n_ff))
        w.add_tensor(f"{blk}.ffn_down.weight", mat(e, spec.n_ff))
        w.add_tensor(f"{blk}.ffn_down.bias", vec(e))
        for ln in ("ln1", "ln2"):
            w.add_tensor(f"{blk}.{ln}.weight", vec(e, base=1.0))
            w.add_tensor(f"{blk}.{ln}.bias", vec(e))
    if spec.projector != "mlp":
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
    else:  # idefics3: pixel shuffle concatenates scale^2 patches, then one linear layer
        w.add_tensor("mm.model.fc.weight", mat(out, e * spec.scale_factor**2))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
