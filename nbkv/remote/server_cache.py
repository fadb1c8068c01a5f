"""What an OpenAI-compatible server says of its own prefix cache, and nbkv's picture of it.

- :func:`read_metrics`: the server's Prometheus ``/metrics`` text as ``{name: [(labels,
  value), ...]}`` (prometheus_client's parser); :func:`cache_facts` picks vLLM's block size,
  cache capacity and prefix-cache counters out of it.
- :func:`block_segments`: a request's KV map split at the server's block boundaries. vLLM
  caches whole blocks only (128 tokens on its CPU build, 16 on GPUs by default): a prompt's
  tail past its last full block is computed again by every request, and the map shows why.
- :class:`BlockMirror`: the blocks the server holds, kept from its KV cache events
  (``BlockStored``, with its tokens, when a block fills; ``BlockRemoved``;
  ``AllBlocksCleared``), and how many leading tokens of a conversation they cover now.
- :class:`KVEventListener`: vLLM's events, live. Started with ``--kv-events-config
  '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'``, vLLM
  publishes them on a ZeroMQ PUB socket (multipart: topic, 8-byte sequence number, msgpack
  payload ``[timestamp, [event, ...], dp_rank]``) named at ``/kv_event_sources``; the
  listener subscribes on a thread of its own and keeps a mirror. Blocks stored before it
  subscribed send no event again: with a ``"replay_endpoint"`` it first asks for the
  batches the server still buffers (``buffer_steps``) from number 0, so the mirror starts
  complete; otherwise ``since_start`` says it knows only what it saw. The publisher binds
  only a wildcard (``tcp://*:PORT``) or ``ipc://`` endpoint; a plain ``tcp://HOST:PORT``
  makes vLLM *connect* to a subscriber there, which nbkv does not offer.

All but the listener is pure logic, tested without a server.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from nbkv.core.events import Segment

log = logging.getLogger("nbkv.remote.kv_events")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")

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


def subscribe_endpoint(endpoint: str, server_url: str) -> tuple[str | None, str]:
    """Where to subscribe to a publisher configured with ``endpoint``, or None and why.

    The server's own address stands in for a wildcard host.
    """
    host = urlsplit(server_url).hostname or "127.0.0.1"
    if endpoint.startswith("ipc://"):
        if host in LOCAL_HOSTS:
            return endpoint, ""
        return None, f"the events go to {endpoint}, a socket on the server's machine"
    m = re.match(r"^tcp://(\*|0\.0\.0\.0|\[::\]|::):(\d+)$", endpoint)
    if m:
        return f"tcp://{'[' + host + ']' if ':' in host else host}:{m.group(2)}", ""
    return None, (f"vLLM connects out to {endpoint} instead of publishing there; start it "
                  f"with \"endpoint\": \"tcp://*:PORT\" so that nbkv can subscribe")


def replay_endpoint(cfg: Mapping[str, Any], server_url: str) -> str | None:
    """Where to ask for past batches (the config's ``replay_endpoint``), if reachable."""
    endpoint = cfg.get("replay_endpoint")
    return subscribe_endpoint(str(endpoint), server_url)[0] if endpoint else None


def event_source(sources: Any) -> Mapping[str, Any] | None:
    """The first enabled ZeroMQ publisher in ``/kv_event_sources``'s answer, if any."""
    if not isinstance(sources, Mapping):
        return None
    for cfg in sources.values():
        if (isinstance(cfg, Mapping) and cfg.get("enable_kv_cache_events")
                and cfg.get("publisher", "zmq") == "zmq" and cfg.get("endpoint")):
            return cfg
    return None


def batch_events(payload: Any) -> list[Mapping[str, Any]]:
    """The events of one decoded batch (``[ts, events, dp_rank]``, or a map)."""
    if isinstance(payload, Mapping):
        events = payload.get("events")
    elif isinstance(payload, (list, tuple)) and len(payload) >= 2:
        events = payload[1]
    else:
        events = None
    return [e for e in events or () if isinstance(e, Mapping)]


class KVEventListener:
    """Subscribes to a vLLM publisher on a daemon thread, feeding a :class:`BlockMirror`.

    ``on_change()`` is called (on that thread) after a batch changed the mirror. Needs
    ``pyzmq`` and ``msgpack`` (``pip install 'nbkv[remote]'``).
    """

    def __init__(self, endpoint: str, topic: str = "",
                 on_change: Callable[[], None] | None = None, replay: str | None = None,
                 replay_timeout: float = 5.0) -> None:
        import msgpack
        import zmq

        self._msgpack = msgpack
        self.endpoint = endpoint
        self.replay = replay
        self.replay_timeout = replay_timeout
        self.replayed = 0  # batches the replay brought
        self.mirror = BlockMirror()
        self.mirror.since_start = False  # until batch 0 is seen (replayed or live)
        self.on_change = on_change
        self.last_seq: int | None = None
        self.last_ts = 0.0
        self.restarts = 0  # times the numbering started again (the server restarted)
        self.ready = threading.Event()  # set once the replay (if any) is done
        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)  # the thread checks for close() this often
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbkv-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        try:
            if self.replay:
                self._replay()
            self.ready.set()
            while not self._stop.is_set():
                try:
                    parts = self._sock.recv_multipart()
                except zmq.Again:
                    continue
                except zmq.ZMQError:
                    return
                self._handle(parts)
        finally:
            self._sock.close(0)

    def _replay(self) -> None:
        """Ask for every batch the server still buffers, from number 0, and apply them."""
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.replay_timeout * 1000))
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while not self._stop.is_set():
                frames = sock.recv_multipart()[1:]  # after the empty delimiter
                if len(frames) < 3 or int.from_bytes(frames[1], "big", signed=True) < 0:
                    if not self.replayed:  # nothing buffered: nothing was stored yet
                        self.mirror.since_start = True
                    return  # the end marker
                self.replayed += 1
                self._handle(frames)
        except zmq.ZMQError as e:  # no answer in time: go on with what comes live
            log.debug("KV event replay from %s failed: %s", self.replay, e)
        finally:
            sock.close(0)

    def _handle(self, parts: list[bytes]) -> None:
        try:
            payload = self._msgpack.unpackb(parts[-1], raw=False, strict_map_key=False)
        except Exception as e:  # noqa: BLE001 - a foreign message must not kill the thread
            log.debug("undecodable KV event batch: %s", e)
            return
        ts = payload[0] if isinstance(payload, (list, tuple)) and payload and isinstance(
            payload[0], (int, float)) else 0.0
        if len(parts) >= 3:
            seq = int.from_bytes(parts[1], "big", signed=True)
            if self.last_seq is not None and seq <= self.last_seq:
                if ts <= self.last_ts:
                    return  # already applied (the replay and the live feed overlap)
                # numbering started again: a new server process, with an empty cache
                self.restarts += 1
                self.mirror.apply([{"type": "AllBlocksCleared"}])
                self.mirror.since_start = seq == 0
            elif self.last_seq is None:
                self.mirror.since_start = seq == 0
            elif seq > self.last_seq + 1:
                self.mirror.since_start = False
            self.last_seq = seq
        self.last_ts = max(self.last_ts, float(ts))
        if self.mirror.apply(batch_events(payload)) and self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 - a view's failure is not the listener's
                log.debug("KV event callback failed", exc_info=True)

    @property
    def alive(self) -> bool:
        """True while the thread listens."""
        return self._thread.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """Stop listening (bounded wait for the thread)."""
        self._stop.set()
        self._thread.join(timeout)
