"""Chat messages: validation and the cumulative prefix hashes the cache matches on."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from nbkv.core.errors import InvalidRequestError

Message = dict[str, Any]

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

#: Content-part types that carry an image (:mod:`nbkv.media.messages` takes them out).
IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})


def normalize(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Validate ``messages`` and return plain-dict copies (callers' objects are never mutated).

    A str in a message that is not valid Unicode (a lone surrogate) is refused here, naming
    the message, before it can fail in a tokenizer or a hash.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise InvalidRequestError("messages is empty: a request needs at least one message")
    out: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}] is {type(m).__name__}, expected a dict")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}] has role {role!r}; expected one of {sorted(ROLES)}"
            )
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            what = "has no 'content'" if "content" not in m else "has content None"
            raise InvalidRequestError(
                f"messages[{i}] ({role}) {what}: expected a string or a list of content parts"
            )
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise InvalidRequestError(
                f"messages[{i}] ({role}) content is {type(content).__name__}: expected a "
                "string or a list of content parts"
            )
        if isinstance(content, (list, tuple)) and not content:
            raise InvalidRequestError(
                f"messages[{i}] ({role}) content is an empty list: give a string, or at "
                "least one content part"
            )
        for key, value in m.items():
            unicode_text(f"messages[{i}] ({role}) {key}", value)
        out.append(dict(m))
    return out


def for_template(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """``messages`` as a chat template takes them: a list of text parts becomes its text.

    Every part is checked first: a text part needs a str ``text``, and a part of another
    type than text or image raises :class:`InvalidRequestError` naming it (a template would
    fail on it with a ``TypeError`` of its own). A list that holds an image is left as it
    is. Text parts are joined as :func:`nbkv.media.messages.extract_images` joins them.
    """
    out: list[Message] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            texts: list[str] = []
            image = False
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, Mapping) else None
                if isinstance(part, str):
                    texts.append(part)
                elif kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise InvalidRequestError(f"{where}: a text part needs a str 'text', "
                                                  f"not {part.get('text')!r}")
                    texts.append(part["text"])
                elif kind in IMAGE_PART_TYPES or not isinstance(part, Mapping):
                    image = True  # a raw picture (PIL, array, bytes) counts as one
                else:
                    raise InvalidRequestError(
                        f"{where}: unknown content part type {kind!r} (expected 'text', or "
                        f"an image: {', '.join(repr(t) for t in sorted(IMAGE_PART_TYPES))})")
            if not image:
                m = {**m, "content": "".join(texts)}
        out.append(dict(m))
    return out


_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=repr)  # made once


def _canonical(message: Mapping[str, Any]) -> bytes:
    return _CANONICAL.encode(message).encode()


def prefix_hashes(messages: Sequence[Mapping[str, Any]], start: Sequence[str] = ()) -> list[str]:
    """Return ``h`` with ``h[k]`` the hash of ``messages[:k + 1]`` (role and content included).

    Each hash chains the previous one, so two conversations share ``h[k]`` exactly when
    their first ``k + 1`` messages are equal. ``start`` continues an existing chain.
    """
    out = list(start)
    prev = out[-1] if out else ""
    for m in messages[len(out) :]:
        prev = hashlib.sha256(prev.encode() + b"\0" + _canonical(m)).hexdigest()[:32]
        out.append(prev)
    return out


def preview(message: Mapping[str, Any], width: int = 60) -> str:
    """A one-line text preview of a message's content."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, Mapping) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            else:
                parts.append("[" + str(p.get("type", "?") if isinstance(p, Mapping) else "?") + "]")
        content = " ".join(parts)
    text = str(content or "")
    n = 4 * width  # a long message: only its start is read (whitespace collapsed, a prefix
    while n < len(text):  # of the whole preview), until it is longer than the preview
        head = " ".join(text[:n].split())
        if len(head) > width:
            return head[: width - 1] + "…"
        n *= 4
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


_SURROGATE = re.compile("[\ud800-\udfff]")


def unicode_text(name: str, value: Any) -> Any:
    """``value`` unless a str in it (or in its lists and dicts) holds a lone surrogate.

    Such a str (as ``bytes.decode(errors="surrogateescape")`` makes of bytes that are not UTF-8)
    is not text: it cannot be encoded, so it would fail later, unnamed, in a tokenizer or hash.
    """
    if isinstance(value, str):
        bad = _SURROGATE.search(value)
        if bad is not None:
            raise InvalidRequestError(
                f"{name} holds a lone surrogate (U+{ord(bad.group()):04X}) at character "
                f"{bad.start()}, which is not valid Unicode text: decode bytes with "
                "errors='replace', or remove it")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            unicode_text(f"{name}[{k!r}]", v)
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            unicode_text(f"{name}[{j}]", v)
    return value
