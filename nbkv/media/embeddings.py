"""Image embeddings: the encoder's output, its RAM cache, and the service that hands it out.

- :class:`ImageEmbedding` is the vision encoder's output for one picture.
- :class:`EmbeddingCache` keeps encoder outputs in RAM, LRU, bounded by bytes, keyed by
  (projector identity, image hash): an evicted slot rebuilt later, or the same picture in
  another session, skips the vision encoder.
- :class:`EmbeddingService` is where embeddings come from: in one call it answers from the
  cache (a hit, counted once) or encodes, now or on its background thread (a run, counted
  once). :class:`nbkv.media.projector.Projector` makes one and the engine asks it.

Pure Python: the encoder itself is a function the service is given.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from nbkv.core.errors import MediaError
from nbkv.media.images import Image, load_image


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

    Keys are hashable (:meth:`EmbeddingService.key`); values are anything with an ``nbytes``
    attribute (:class:`ImageEmbedding`). One cache can be shared by several projectors and
    engines: the projector identity in the key keeps entries apart.
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


class Tally(Protocol):
    """Per-request counters the service adds to (the engine's request has them)."""

    encoder_runs: int  # pictures this request sent through the encoder
    embedding_hits: int  # pictures it took from the cache (or already held)


#: Encodes one picture: ``encode(image, context)``; ``context`` is whatever the caller gave
#: :meth:`EmbeddingService.fetch` (the projector takes the tokenized prompt, to reuse its
#: chunks).
Encoder = Callable[[Image, Any], ImageEmbedding]


class EmbeddingService:
    """Where image embeddings come from: the cache, else the encoder, in one call.

    Args:
        identity: the projector's identity; with the image hash it makes the cache key.
        encode: the encoder function (:data:`Encoder`).
        cache: the :class:`EmbeddingCache` (may be shared by several services and engines);
            default a private 256 MiB one.
        stats: the counters to add to (the projector's :class:`MediaStats`); default new ones.

    :meth:`fetch` is the one question asked on the image path, and the one place hits and
    encoder runs are counted. Background encodes run on one thread (``nbkv-encoder``),
    started on first use; :meth:`close` stops it.
    """

    def __init__(
        self,
        identity: str,
        encode: Encoder,
        *,
        cache: EmbeddingCache | None = None,
        stats: MediaStats | None = None,
    ) -> None:
        self.identity = identity
        self.cache = cache if cache is not None else EmbeddingCache()
        self.stats = stats if stats is not None else MediaStats()
        self.encode = encode  #: the encoder function (:data:`Encoder`)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def key(self, image_hash: str) -> tuple[str, str]:
        """An image's key in the cache (the one place it is built).

        Projector identity and image hash: projectors sharing a cache keep entries apart.
        """
        return (self.identity, image_hash)

    def cached(self, image: Image) -> bool:
        """True when ``image``'s embeddings are cached; counts nothing, keeps LRU order.

        A hint for whoever prepares pixels (the tokenizer skips them), not a fetch.
        """
        return self.cache.peek(self.key(image.hash)) is not None

    def fetch(
        self,
        image: Any,
        context: Any = None,
        *,
        use_cache: bool = True,
        held: Mapping[str, ImageEmbedding] | None = None,
        tally: Tally | None = None,
        wait: bool = True,
    ) -> Future[ImageEmbedding]:
        """One picture's embeddings: held or cached (a hit), else encoded (a run).

        ``image`` is an :class:`~nbkv.media.images.Image` or anything
        :func:`~nbkv.media.images.load_image` takes; ``context`` goes to the encoder. ``held``: what
        the request already has, by image hash (the same picture again is a hit, without
        asking the cache). ``use_cache=False`` always encodes (the result still replaces the
        cached one). A hit or a run is counted here, once: in :attr:`stats`, and in
        ``tally`` (the request's counters) if given.

        Returns a future: done at once for a hit, and for a run with ``wait`` (the encoder
        ran in this thread; its errors raise here); else the encode is queued on the
        service's thread and the future completes there.
        """
        img = load_image(image)
        emb = held.get(img.hash) if held is not None else None
        if emb is None and use_cache:
            emb = self.cache.get(self.key(img.hash))
            self.stats.add(**{"cache_hits" if emb is not None else "cache_misses": 1})
        if emb is not None:
            if tally is not None:
                tally.embedding_hits += 1
            done: Future[ImageEmbedding] = Future()
            done.set_result(emb)
            return done
        pool = None if wait else self._thread()  # (raises if closed, before counting)
        if tally is not None:
            tally.encoder_runs += 1
        self.stats.add(images_encoded=1)
        if pool is not None:
            return pool.submit(self._run, img, context)
        done = Future()
        done.set_result(self._run(img, context))
        return done

    def get(self, image: Any, context: Any = None, *, use_cache: bool = True) -> ImageEmbedding:
        """:meth:`fetch` in this thread: the embeddings, cached or freshly encoded."""
        return self.fetch(image, context, use_cache=use_cache).result()

    def _run(self, img: Image, context: Any) -> ImageEmbedding:
        emb = self.encode(img, context)
        self.cache.put(self.key(img.hash), emb)
        return emb

    def _thread(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise MediaError("the embedding service was closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="nbkv-encoder")
            return self._pool

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Stop the background thread, after the encodes already queued (idempotent)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return f"EmbeddingService({self.identity[:24]}, {self.cache!r}{state})"
