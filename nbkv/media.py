"""The old import path of the media layer, which now lives in four modules by job.

- :mod:`nbkv.images`: loading and decoding pictures, their content hash.
- :mod:`nbkv.media_messages`: images in OpenAI-style messages, the media marker.
- :mod:`nbkv.media_units`: images as runs of KV positions, for prompt comparisons.
- :mod:`nbkv.embeddings`: image embeddings, their cache and the service that hands them out.

Import from those; this module only re-exports their names (``nbkv.engine`` still uses it
until its split lands; then it can go).
"""

from __future__ import annotations

from .embeddings import CacheStats, EmbeddingCache, MediaStats
from .images import MAX_PIXELS, Image, image_hash, load_image
from .media_messages import (
    IMAGE_PART_TYPES,
    MARKER,
    MediaMessages,
    contains_images,
    content_with_images,
    extract_images,
    to_data_url,
)
from .media_units import (
    ChunkKey,
    MediaKey,
    MediaSpan,
    MediaUnit,
    position_units,
    snap_to_media_boundary,
    spans,
)

__all__ = [
    "MAX_PIXELS", "IMAGE_PART_TYPES", "MARKER", "CacheStats", "ChunkKey", "EmbeddingCache",
    "Image", "MediaKey", "MediaMessages", "MediaSpan", "MediaStats", "MediaUnit",
    "contains_images", "content_with_images", "extract_images", "image_hash", "load_image",
    "position_units", "snap_to_media_boundary", "spans", "to_data_url",
]
