"""Images in conversations: loading, identity, extraction from messages, and caches.

This module is pure Python (numpy, and Pillow to decode image files); the native side
(projector, chunks, encoder, decoding embeddings into a sequence) is :mod:`nbkv.projector`.

- :func:`load_image` turns a file path, a ``data:`` URI, raw encoded bytes, a PIL image or
  an ``HxWx3`` ``uint8`` array into an :class:`Image`: RGB pixels plus a content hash that
  identifies the picture wherever it came from (the same pixels from a PNG file and from a
  numpy array are the same image). ``http(s)`` URLs are refused: nbkv never fetches.
- :func:`extract_images` rewrites OpenAI-style messages (content parts) into plain-text
  messages carrying the media marker where each image was, plus the ordered images.
- :class:`EmbeddingCache` keeps encoder outputs in RAM, LRU, bounded by bytes, keyed by
  (projector identity, image hash): an evicted slot rebuilt later, or the same picture in
  another session, skips the vision encoder.
- :func:`position_units` lets prefix comparisons handle prompts made of text tokens and
  images for prefix salvage, each image an opaque run identified by its hash.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import threading
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .errors import MediaError

#: libmtmd's default media marker (``mtmd_default_marker()``); :mod:`nbkv.projector` checks it.
MARKER = "<__media__>"

#: Largest image accepted, in pixels (a decompression bomb guard; mtmd downsizes anyway).
MAX_PIXELS = 64 * 1024 * 1024

#: Content-part types that carry an image.
IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})


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


# -- messages -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaMessages:
    """Messages with their images taken out (see :func:`extract_images`).

    ``messages``: copies whose ``content`` is a string, with :data:`MARKER` (or the marker
    given) where each image was; render them with the chat template as usual.
    ``images``: every image in prompt order (message order, then part order).
    ``image_hashes``: for each message, the hashes of its images, in order.
    """

    messages: list[dict[str, Any]]
    images: list[Image]
    image_hashes: list[tuple[str, ...]]

    def for_hashing(self) -> list[dict[str, Any]]:
        """Messages whose content names each image by hash, to feed to message-prefix hashes.

        Two conversations that differ only in a picture then hash differently, and the hash
        no longer depends on how the picture was passed (path, bytes, data: URI...).
        """
        out = []
        for m, hashes in zip(self.messages, self.image_hashes):
            if hashes:
                m = dict(m)
                m["images"] = list(hashes)
            out.append(m)
        return out


def _is_image_part(part: Any) -> bool:
    if isinstance(part, Mapping):
        return part.get("type") in IMAGE_PART_TYPES
    return not isinstance(part, str)  # a raw PIL image / array / bytes / Image in the list


def contains_images(messages: Iterable[Mapping[str, Any]]) -> bool:
    """True if any message carries an image content part (or a raw image object)."""
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, (list, tuple)) and any(_is_image_part(p) for p in content):
            return True
    return False


def _part_source(part: Mapping[str, Any], where: str) -> Any:
    kind = part.get("type")
    if kind == "image":
        for key in ("image", "image_url", "url", "path", "data"):
            if part.get(key) is not None:
                value = part[key]
                break
        else:
            raise MediaError(f"{where}: an 'image' part needs an 'image' field")
    else:  # image_url / input_image
        value = part.get("image_url")
        if value is None:
            raise MediaError(f"{where}: an {kind!r} part needs an 'image_url' field")
    if isinstance(value, Mapping):
        if "url" not in value:
            raise MediaError(f"{where}: 'image_url' must be a string or {{'url': ...}}")
        value = value["url"]
    return value


def extract_images(
    messages: Sequence[Mapping[str, Any]], marker: str = MARKER
) -> MediaMessages:
    """Take the images out of OpenAI-style messages, leaving ``marker`` in their place.

    A message's ``content`` may be a string (kept as is) or a list of parts, concatenated in
    order: ``{"type": "text", "text": ...}``; ``{"type": "image_url", "image_url": {"url":
    ...}}`` (or ``"image_url": "..."``) where the URL is a file path, ``file://`` or
    ``data:`` URI (``http(s)`` is refused); ``{"type": "image", "image": obj}`` and raw
    objects (PIL image, numpy array, bytes, :class:`Image`) from Python. Every image is loaded
    (and validated) here, so a bad one fails the request before anything touches a slot.
    Text that already contains ``marker`` is refused: it would be taken for an image.
    """
    out: list[dict[str, Any]] = []
    images: list[Image] = []
    hashes: list[tuple[str, ...]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        own: list[str] = []
        if isinstance(content, (list, tuple)):
            pieces: list[str] = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if isinstance(part, str):
                    pieces.append(_text(part, marker, where))
                elif isinstance(part, Mapping):
                    kind = part.get("type")
                    if kind == "text":
                        pieces.append(_text(part.get("text", ""), marker, where))
                    elif kind in IMAGE_PART_TYPES:
                        img = _load_in(_part_source(part, where), where)
                        images.append(img)
                        own.append(img.hash)
                        pieces.append(marker)
                    else:
                        raise MediaError(
                            f"{where}: unsupported content part type {kind!r} (expected "
                            "'text', 'image_url' or 'image')"
                        )
                else:
                    img = _load_in(part, where)
                    images.append(img)
                    own.append(img.hash)
                    pieces.append(marker)
            m = dict(m)
            m["content"] = "".join(pieces)
        else:
            if isinstance(content, str):
                _text(content, marker, f"messages[{i}].content")
            m = dict(m)
        out.append(m)
        hashes.append(tuple(own))
    return MediaMessages(out, images, hashes)


def _text(value: Any, marker: str, where: str) -> str:
    s = value if isinstance(value, str) else str(value)
    if marker in s:
        raise MediaError(
            f"{where}: the text contains {marker!r}, which is reserved to mark where images go"
        )
    return s


def _load_in(source: Any, where: str) -> Image:
    try:
        return load_image(source)
    except MediaError as e:
        raise MediaError(f"{where}: {e}") from e


# -- embedding cache ------------------------------------------------------------------------


@dataclass
class CacheStats:
    """Counters of an :class:`EmbeddingCache`."""

    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    rejected: int = 0  # entries larger than the whole budget, never stored


class EmbeddingCache:
    """An in-RAM LRU of encoder outputs, bounded by bytes; thread-safe.

    Keys are hashable (:meth:`nbkv.projector.Projector.cache_key`); values are anything with
    an ``nbytes`` attribute (:class:`nbkv.media_prompt.ImageEmbedding`). One cache can be
    shared by several projectors and engines: the projector identity keeps entries apart.
    """

    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: Hashable) -> Any | None:
        """The value for ``key`` (now the most recently used), or None; counts hit/miss."""
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return value

    def peek(self, key: Hashable) -> Any | None:
        """Like :meth:`get` without touching recency or counters."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: Hashable, value: Any) -> bool:
        """Store ``value``, evicting the least recently used entries to stay in budget.

        Returns False (and stores nothing) when ``value`` alone exceeds the budget.
        """
        size = int(value.nbytes)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._nbytes -= int(old.nbytes)
            if size > self.max_bytes:
                self.stats.rejected += 1
                return False
            self._items[key] = value
            self._nbytes += size
            self.stats.insertions += 1
            while self._nbytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._nbytes -= int(evicted.nbytes)
                self.stats.evictions += 1
            return True

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if present."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._nbytes -= int(old.nbytes)

    def clear(self) -> None:
        """Forget everything (the counters are kept)."""
        with self._lock:
            self._items.clear()
            self._nbytes = 0

    def keys(self) -> list[Hashable]:
        """Keys, least recently used first."""
        with self._lock:
            return list(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self._nbytes

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return (
            f"EmbeddingCache({len(self)} entries, {self._nbytes / 2**20:.1f}/"
            f"{self.max_bytes / 2**20:.0f} MiB, hits={self.stats.hits}, "
            f"misses={self.stats.misses})"
        )


# -- prompt comparison (prefix salvage with media) -------------------------------------------


class MediaKey(NamedTuple):
    """An image chunk as prompt comparisons see it: an opaque run of KV positions.

    ``image_hash`` is the picture's :attr:`Image.hash`; ``sub_index`` numbers the image chunks
    one picture becomes (tiling projectors cut one picture into several); ``n_tokens`` and
    ``n_pos`` are the chunk's embeddings and KV positions.
    """

    image_hash: str
    sub_index: int
    n_tokens: int
    n_pos: int


class MediaUnit(NamedTuple):
    """One KV position of an image run (see :func:`position_units`)."""

    key: MediaKey
    offset: int  # 0 .. key.n_pos - 1


ChunkKey = tuple[int, ...] | MediaKey  # a text chunk's tokens, or an image chunk


def position_units(keys: Iterable[ChunkKey]) -> list[int | MediaUnit]:
    """One entry per KV position: a text token id, or a :class:`MediaUnit` of an image run.

    This is the drop-in for a slot's token list when prompts carry images: plain equality
    between two such lists (what the text-only prefix matching already does) compares
    tokens as tokens and images by content hash, position by position.
    """
    out: list[int | MediaUnit] = []
    for k in keys:
        if isinstance(k, MediaKey):
            out.extend(MediaUnit(k, i) for i in range(k.n_pos))
        else:
            out.extend(k)
    return out


def snap_to_media_boundary(units: Sequence[int | MediaUnit], n: int) -> int:
    """The largest ``m <= n`` that does not cut an image run of ``units`` in the middle.

    KV positions of an image only make sense together (its embeddings attend to each other,
    some projectors even non-causally), so a salvaged prefix keeps or drops an image whole.
    """
    n = min(n, len(units))
    if n <= 0 or n >= len(units):
        return max(n, 0)
    u = units[n]  # first position NOT kept
    if isinstance(u, MediaUnit) and u.offset > 0:
        return n - u.offset
    return n


@dataclass(frozen=True)
class MediaSpan:
    """Where a prompt's chunk lies in KV: ``[start, end)`` positions, for records and maps."""

    kind: str  # "text" or "image"
    start: int
    end: int
    n_tokens: int
    image_hash: str | None = None
    sub_index: int = 0


def spans(units: Sequence[int | MediaUnit], start: int = 0) -> list[MediaSpan]:
    """The text and image runs of :func:`position_units`, as KV spans from ``start``.

    The one place image runs are found: records, KV maps and chunk listings all use it.
    """
    out: list[MediaSpan] = []
    i, n = 0, len(units)
    while i < n:
        u = units[i]
        if isinstance(u, MediaUnit):
            k = u.key
            end = min(i + k.n_pos - u.offset, n)  # a run cut by the list's end is clipped
            out.append(MediaSpan("image", start + i, start + end, k.n_tokens, k.image_hash,
                                 k.sub_index))
        else:
            end = i + 1
            while end < n and not isinstance(units[end], MediaUnit):
                end += 1
            out.append(MediaSpan("text", start + i, start + end, end - i))
        i = end
    return out


@dataclass
class MediaStats:
    """Counters of a projector: what was tokenized, encoded, served from cache, decoded."""

    images_tokenized: int = 0      # images passed to tokenize
    image_chunks: int = 0          # image chunks produced by tokenize
    image_tokens: int = 0          # embeddings in those chunks
    image_positions: int = 0       # KV positions they span
    placeholders: int = 0          # images tokenized without pixels (embeddings were cached)
    encoder_runs: int = 0          # mtmd_encode_chunk calls
    images_encoded: int = 0        # pictures that went through the encoder
    encode_seconds: float = 0.0
    cache_hits: int = 0            # pictures whose embeddings came from the cache
    cache_misses: int = 0
    chunks_decoded: int = 0        # image chunks decoded into a sequence
    embeddings_decoded: int = 0    # embeddings decoded into a sequence
    positions_decoded: int = 0     # KV positions they now occupy
    decode_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Increment counters atomically."""
        with self._lock:
            for name, d in deltas.items():
                setattr(self, name, getattr(self, name) + d)

    def snapshot(self) -> dict[str, float]:
        """A plain dict copy of the counters."""
        with self._lock:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


_MD_IMAGE = re.compile(r"!\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _image_part(where: str) -> dict[str, Any]:
    if where.lower().startswith(("http://", "https://")):
        raise MediaError(f"{where}: images are not fetched from the network; save the file "
                         "and give its local path")
    path = Path(where).expanduser()
    if not path.is_file():
        raise MediaError(f"no image file at {where}")
    return {"type": "image_url", "image_url": {"url": str(path.resolve())}}


def content_with_images(text: str, paths: Sequence[str] = ()) -> str | list[dict[str, Any]]:
    """A user message's content from text that may show images: plain text, or parts.

    ``paths`` (image files) come first, then ``text`` with each Markdown image
    ``![alt](path)`` in its place (what a ``%%chat`` cell may contain).
    """
    parts: list[dict[str, Any]] = [_image_part(p) for p in paths]
    at = 0
    for m in _MD_IMAGE.finditer(text):
        if text[at : m.start()].strip():
            parts.append({"type": "text", "text": text[at : m.start()]})
        parts.append(_image_part(m.group(2)))
        at = m.end()
    if not parts:
        return text
    if text[at:].strip():
        parts.append({"type": "text", "text": text[at:]})
    return parts


def to_data_url(part: Any, where: str = "image") -> str:
    """An image content part (or raw image object) as a ``data:image/png;base64,...`` URL.

    What an OpenAI-compatible server takes; the pixels are read and checked here first.
    """
    import base64
    import io

    image = _load_in(_part_source(part, where) if isinstance(part, Mapping) else part, where)
    buf = io.BytesIO()
    _pil().Image.fromarray(image.array()).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
