"""Image embeddings: the encoder's output and its RAM cache.

- :class:`ImageEmbedding` is the vision encoder's output for one picture.
- :class:`EmbeddingCache` keeps encoder outputs in RAM, LRU, bounded by bytes, keyed by
  (projector identity, image hash): an evicted slot rebuilt later, or the same picture in
  another session, skips the vision encoder.
- :class:`MediaStats` counts what a projector tokenized, encoded, took from the cache, decoded.

Pure Python.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
    an ``nbytes`` attribute (:class:`ImageEmbedding`). One cache can be shared by several
    projectors and engines: the projector identity in the key keeps entries apart.
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

