"""What an OpenAI-compatible server says of its own prefix cache, and nbkv's picture of it.

Pure logic, tested without a server:

- :func:`read_metrics`: the server's Prometheus ``/metrics`` text as ``{name: [(labels,
  value), ...]}`` (prometheus_client's parser); :func:`cache_facts` picks vLLM's block size,
  cache capacity and prefix-cache counters out of it.
- :func:`block_segments`: a request's KV map split at the server's block boundaries. vLLM
  caches whole blocks only (128 tokens on its CPU build, 16 on GPUs by default): a prompt's
  tail past its last full block is computed again by every request, and the map shows why.
- :class:`BlockMirror`: the blocks the server holds, kept from its KV cache events
  (``--kv-events-config``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), and how
  many leading tokens of a conversation they cover now.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbkv.core.events import Segment

Samples = dict[str, list[tuple[dict[str, str], float]]]


def read_metrics(text: str) -> Samples:
    """Prometheus exposition text: every sample by name (``vllm:prefix_cache_hits_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except ValueError:  # not Prometheus text (a server without /metrics answering HTML)
        return {}
    return out


def _total(samples: Samples, *names: str) -> float | None:
    for name in names:
        if name in samples:
            return sum(v for _, v in samples[name])
    return None


@dataclass(frozen=True)
class CacheFacts:
    """What ``/metrics`` says of the server's prefix cache (None: not said)."""

    block_size: int | None = None
    capacity_tokens: int | None = None
    prefix_caching: bool | None = None
    queries: float | None = None  # prompt tokens looked up in the prefix cache
    hits: float | None = None  # prompt tokens found in the prefix cache
    usage: float | None = None  # fraction of the KV cache in use

    def stats(self) -> dict[str, Any]:
        """The counters as ``%kvcache stats`` rows (only those the server reports)."""
        out: dict[str, Any] = {}
        if self.queries is not None:
            out["server prefix-cache queries (tokens)"] = int(self.queries)
        if self.hits is not None:
            out["server prefix-cache hits (tokens)"] = int(self.hits)
        if self.queries and self.hits is not None:
            out["server prefix-cache hit rate (%)"] = 100.0 * self.hits / self.queries
        if self.block_size:
            out["server block size (tokens)"] = self.block_size
        if self.usage is not None:
            out["server KV cache in use (%)"] = 100.0 * self.usage
        return out


def cache_facts(samples: Samples) -> CacheFacts:
    """The cache facts in vLLM's metrics (``vllm:cache_config_info`` and the counters)."""
    info = (samples.get("vllm:cache_config_info") or [({}, 0.0)])[0][0]

    def num(key: str) -> int | None:
        v = info.get(key)
        return int(v) if v is not None and v.isdigit() else None

    pc = info.get("enable_prefix_caching")
    return CacheFacts(
        block_size=num("block_size"), capacity_tokens=num("kv_cache_size_tokens"),
        prefix_caching=None if pc is None else pc == "True",
        queries=_total(samples, "vllm:prefix_cache_queries_total",
                       "vllm:gpu_prefix_cache_queries_total"),
        hits=_total(samples, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        usage=_total(samples, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))


def block_segments(segments: Sequence[Segment], block_size: int | None) -> tuple[Segment, ...]:
    """``segments`` cut at every multiple of ``block_size``: one piece per block per message.

    The KV map then draws each of the server's blocks as its own bar, so the reused span
    ending on a block boundary, and the partial block after it, are visible.
    """
    if not block_size:
        return tuple(segments)
    out = []
    for seg in segments:
        lo = seg.start
        while lo < seg.end:
            hi = min(seg.end, (lo // block_size + 1) * block_size)
            out.append(replace(seg, start=lo, end=hi))
            lo = hi
    return tuple(out)


def cacheable(n_tokens: int, block_size: int | None) -> int:
    """How many leading tokens of ``n_tokens`` a block cache can keep: whole blocks only."""
    return n_tokens if not block_size else n_tokens // block_size * block_size


class BlockMirror:
    """The server's cached blocks, as its KV cache events told them (thread-safe).

    A block is known by its hash, its parent's hash and its tokens; a conversation's
    cached prefix is the chain of blocks whose tokens are its consecutive chunks. Blocks
    the server stored before nbkv subscribed, and did not replay, are not known
    (:attr:`since_start` is then False).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[Any, tuple[Any, tuple[int, ...]]] = {}  # hash -> (parent, tokens)
        self._by_key: dict[tuple[Any, tuple[int, ...]], Any] = {}  # (parent, tokens) -> hash
        self.block_size: int | None = None
        self.stored = 0  # blocks stored, removed and clears seen
        self.removed = 0
        self.cleared = 0
        self.batches = 0
        #: every batch since the server started was applied (none missed, none before)
        self.since_start = True

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def apply(self, events: Iterable[Mapping[str, Any]]) -> bool:
        """Apply one batch of decoded events; True when the set of blocks changed."""
        changed = False
        with self._lock:
            self.batches += 1
            for ev in events:
                kind = ev.get("type")
                if kind == "BlockStored":
                    changed |= self._stored(ev)
                elif kind == "BlockRemoved":
                    for h in ev.get("block_hashes") or ():
                        entry = self._blocks.pop(h, None)
                        if entry is not None:
                            self._by_key.pop(entry, None)
                            self.removed += 1
                            changed = True
                elif kind == "AllBlocksCleared":
                    changed |= bool(self._blocks)
                    self._blocks.clear()
                    self._by_key.clear()
                    self.cleared += 1
        return changed

    def _stored(self, ev: Mapping[str, Any]) -> bool:
        hashes = list(ev.get("block_hashes") or ())
        tokens = list(ev.get("token_ids") or ())
        if ev.get("extra_keys") and any(ev["extra_keys"]):
            return False  # images, LoRA or a cache salt in the hash: not a text prefix
        size = int(ev.get("block_size") or 0) or (len(tokens) // len(hashes) if hashes else 0)
        if not size or len(tokens) < size * len(hashes):
            return False
        self.block_size = size
        parent = ev.get("parent_block_hash")
        for i, h in enumerate(hashes):
            chunk = tuple(tokens[i * size:(i + 1) * size])
            self._blocks[h] = (parent, chunk)
            self._by_key[(parent, chunk)] = h
            self.stored += 1
            parent = h
        return bool(hashes)

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` whose blocks the server holds now (a block multiple)."""
        with self._lock:
            size = self.block_size
            if not size:
                return 0
            parent, n = None, 0
            while n + size <= len(tokens):
                h = self._by_key.get((parent, tuple(tokens[n:n + size])))
                if h is None:
                    break
                parent, n = h, n + size
            return n
