"""Images in messages: taking them out of OpenAI-style content parts, and putting them in.

- :func:`extract_images` rewrites OpenAI-style messages (content parts) into plain-text
  messages carrying the media marker where each image was, plus the ordered images.
- :func:`contains_images` tells whether messages carry any image.
- :func:`content_with_images` builds a user message's parts from ``%%chat`` text that shows
  images (Markdown ``![alt](path)``); :func:`to_data_url` makes a part what an
  OpenAI-compatible server takes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkv.core.errors import MediaError
from nbkv.core.messages import IMAGE_PART_TYPES
from nbkv.media.images import Image, load_image, png_data_url

#: libmtmd's default media marker (``mtmd_default_marker()``); :mod:`nbkv.media.projector`
#: checks it.
MARKER = "<__media__>"



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


# -- building messages with images ---------------------------------------------------------


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
    source = _part_source(part, where) if isinstance(part, Mapping) else part
    return png_data_url(_load_in(source, where))
