"""Pictures: loading and decoding them to RGB, and their content hash.

:func:`load_image` turns a file path, a ``data:`` URI, raw encoded bytes, a PIL image or an
``HxWx3`` ``uint8`` array into an :class:`Image`: RGB pixels plus a content hash that
identifies the picture wherever it came from (the same pixels from a PNG file and from a
numpy array are the same image). ``http(s)`` URLs are refused: nbkv never fetches. Pure
Python (numpy, and Pillow to decode image files).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nbkv.core.errors import MediaError

#: Largest image accepted, in pixels (a decompression bomb guard; mtmd downsizes anyway).
MAX_PIXELS = 64 * 1024 * 1024

@dataclass(frozen=True, eq=False, repr=False)
class Image:
    """An RGB picture and its content hash. Equal images are the same pixels, same size.

    ``data`` is ``width * height * 3`` bytes, row-major RGBRGB... (what ``mtmd_bitmap_init``
    takes). ``hash`` is the SHA-256 of the size and the pixels: it identifies the image in
    caches and in prompt comparisons, whatever file or object it was loaded from.
    """

    width: int
    height: int
    data: bytes
    hash: str
    source: str = ""

    @classmethod
    def from_rgb(cls, rgb: np.ndarray, source: str = "") -> Image:
        """An image from an ``(height, width, 3)`` ``uint8`` array (copied)."""
        a = np.ascontiguousarray(rgb, dtype=np.uint8)
        if a.ndim != 3 or a.shape[2] != 3:
            raise MediaError(f"expected an (height, width, 3) array, got shape {a.shape}")
        h, w = int(a.shape[0]), int(a.shape[1])
        _check_size(w, h, source)
        data = a.tobytes()
        return cls(w, h, data, image_hash(w, h, data), source)

    def array(self) -> np.ndarray:
        """The pixels as a read-only ``(height, width, 3)`` ``uint8`` array (no copy)."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.height, self.width, 3)

    @property
    def nbytes(self) -> int:
        """Size of the pixel data."""
        return len(self.data)

    @property
    def short_hash(self) -> str:
        """The first 12 hex digits of :attr:`hash` (for display)."""
        return self.hash[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Image) and other.hash == self.hash

    def __hash__(self) -> int:
        return hash(self.hash)

    def __repr__(self) -> str:
        src = f", source={self.source!r}" if self.source else ""
        return f"Image({self.width}x{self.height}, hash={self.short_hash}{src})"


def image_hash(width: int, height: int, rgb: bytes) -> str:
    """SHA-256 hex of an RGB image's size and pixels (the identity of :class:`Image`)."""
    h = hashlib.sha256(b"nbkv-rgb8\0%d\0%d\0" % (width, height))
    h.update(rgb)
    return h.hexdigest()


def _check_size(w: int, h: int, source: str) -> None:
    if w < 1 or h < 1:
        raise MediaError(f"image {source} is empty ({w}x{h} pixels)")
    if w * h > MAX_PIXELS:
        raise MediaError(
            f"image {source} is too large: {w}x{h} = {w * h} pixels (limit {MAX_PIXELS}); "
            "downscale it first"
        )


def _pil():
    try:
        import PIL.Image
        import PIL.ImageOps
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MediaError(
            "decoding image files needs Pillow: pip install pillow (or nbkv[vision])"
        ) from e
    return PIL


def _describe(obj: Any) -> str:
    if isinstance(obj, str):
        return obj if len(obj) <= 60 else obj[:57] + "..."
    return type(obj).__name__


def load_image(source: Any) -> Image:
    """Load and normalize an image to RGB; raise :class:`MediaError` if that is impossible.

    Accepted: an :class:`Image` (returned as is); a file path (``str`` or path-like, or a
    ``file://`` URL); a ``data:`` URI (base64 or percent-encoded); raw encoded bytes (PNG,
    JPEG, GIF, WebP, ... anything Pillow reads; the first frame of an animation); a PIL image;
    a numpy ``uint8`` array ``HxWx3`` (``HxW`` gray and ``HxWx4`` RGBA, alpha dropped, are
    accepted too). EXIF orientation is applied, so the model sees what a viewer shows.
    ``http://`` and ``https://`` URLs are refused: nbkv does not fetch from the network.
    """
    if isinstance(source, Image):
        return source
    if isinstance(source, np.ndarray):
        return _from_array(source, "array")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), f"{len(source)} bytes")
    if isinstance(source, os.PathLike):
        return _from_path(Path(source))
    if isinstance(source, str):
        return _from_string(source)
    PIL = _pil()
    if isinstance(source, PIL.Image.Image):
        return _from_pil(source, "PIL image")
    raise MediaError(
        f"cannot use a {type(source).__name__} as an image: pass a file path, a data: URI, "
        "encoded bytes, a PIL image or an HxWx3 uint8 numpy array"
    )


def _from_string(s: str) -> Image:
    text = s.strip()
    low = text[:16].lower()
    if low.startswith("data:"):
        return _from_data_uri(text)
    if low.startswith(("http://", "https://")):
        raise MediaError(
            f"image URL {_describe(text)} refused: nbkv does not fetch anything from the "
            "network; download the image and pass its path, its bytes or a data: URI"
        )
    if low.startswith("file:"):
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"file URL {_describe(text)} names a remote host; refused")
        return _from_path(Path(urllib.request.url2pathname(parsed.path)))
    scheme = urllib.parse.urlparse(text).scheme
    if len(scheme) > 1 and "://" in text:  # one letter is a Windows drive
        raise MediaError(f"unsupported image URL scheme {scheme!r} in {_describe(text)}")
    return _from_path(Path(text))


def _from_data_uri(uri: str) -> Image:
    head, sep, payload = uri.partition(",")
    if not sep:
        raise MediaError("malformed data: URI (no comma before the data)")
    params = head[5:].split(";")
    mime = params[0].strip().lower()
    if mime and not mime.startswith("image/"):
        raise MediaError(f"data: URI has media type {mime!r}, not an image")
    if "base64" in (p.strip().lower() for p in params[1:]):
        try:
            raw = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"data: URI is not valid base64: {e}") from e
    else:
        raw = urllib.parse.unquote_to_bytes(payload)
    return _decode(raw, f"data: URI ({mime or 'no type'}, {len(raw)} bytes)")


def _from_path(path: Path) -> Image:
    p = path.expanduser()
    if not p.is_file():
        raise MediaError(f"no image file at {p}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise MediaError(f"cannot read image file {p}: {e}") from e
    return _decode(raw, str(p))


def _decode(raw: bytes, source: str) -> Image:
    if not raw:
        raise MediaError(f"image {source} is empty (0 bytes)")
    PIL = _pil()
    try:
        with PIL.Image.open(io.BytesIO(raw)) as im:
            im.load()
            return _from_pil(im, source)
    except MediaError:
        raise
    except PIL.Image.DecompressionBombError as e:
        raise MediaError(f"image {source} is too large to decode safely: {e}") from e
    except Exception as e:  # UnidentifiedImageError, truncated data, codec errors...
        raise MediaError(
            f"cannot decode image {source}: {type(e).__name__}: {e} "
            "(corrupt, truncated, or not an image format Pillow reads)"
        ) from e


def _from_pil(im: Any, source: str) -> Image:
    PIL = _pil()
    try:
        im = PIL.ImageOps.exif_transpose(im)
        w, h = im.size
        _check_size(w, h, source)
        rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except MediaError:
        raise
    except Exception as e:
        raise MediaError(f"cannot convert image {source} to RGB: {type(e).__name__}: {e}") from e
    return Image.from_rgb(rgb, source)


def _from_array(a: np.ndarray, source: str) -> Image:
    if a.dtype != np.uint8:
        raise MediaError(
            f"image arrays must be uint8 (0-255), got {a.dtype}; convert with "
            "(np.clip(a, 0, 1) * 255).astype(np.uint8) or similar"
        )
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    elif a.ndim == 3 and a.shape[2] == 4:
        a = a[:, :, :3]
    elif not (a.ndim == 3 and a.shape[2] == 3):
        raise MediaError(
            f"image arrays must be HxWx3 (RGB), HxWx4 (RGBA) or HxW (gray); got shape {a.shape}"
        )
    return Image.from_rgb(a, source)


def png_data_url(image: Image) -> str:
    """``image`` as a ``data:image/png;base64,...`` URL (what OpenAI-compatible servers take)."""
    buf = io.BytesIO()
    _pil().Image.fromarray(image.array()).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
