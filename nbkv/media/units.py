"""Images as prompt comparisons see them: opaque runs of KV positions.

:func:`position_units` lets prefix comparisons handle prompts made of text tokens and
images for prefix salvage, each image an opaque run identified by its hash;
:func:`snap_to_media_boundary` keeps a salvaged prefix from cutting an image, and
:func:`spans` finds the text and image runs for records and KV maps. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class MediaKey(NamedTuple):
    """An image chunk as prompt comparisons see it: an opaque run of KV positions.

    ``image_hash`` is the picture's :attr:`~nbkv.media.images.Image.hash`; ``sub_index`` numbers
    the image chunks one picture becomes (tiling projectors cut one picture into several);
    ``n_tokens`` and ``n_pos`` are the chunk's embeddings and KV positions.
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
