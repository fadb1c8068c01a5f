"""vLLM's KV cache events, live: the blocks the server stores and evicts, as they happen.

A vLLM server started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'`` publishes every block it stores or
evicts on a ZeroMQ PUB socket (multipart: topic, 8-byte sequence number, msgpack payload
``[timestamp, [event, ...], dp_rank]``; each event a map with ``type``) and names the
endpoint at ``/kv_event_sources``. :class:`KVEventListener` subscribes on a thread of its
own and keeps a :class:`~nbkv.remote.server_cache.BlockMirror` of them; the remote KV map
draws from it which blocks of each conversation the server holds now.

Blocks stored before nbkv subscribed (a shared system prompt, an earlier kernel's
conversations) send no event again. With a ``"replay_endpoint"`` as well, the listener
first asks the server for the batches it still buffers (``buffer_steps``, 10,000 engine
steps by default) from number 0, so the mirror starts complete; without one, or when the
buffer no longer reaches back to 0, the mirror knows only what it saw (``complete`` says).

A ``BlockStored`` comes when a block fills (prompt or reply), with its tokens. The publisher
binds only a wildcard (``tcp://*:PORT``) or ``ipc://`` endpoint; a plain ``tcp://HOST:PORT``
makes vLLM *connect* to a subscriber there, which nbkv does not offer.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from nbkv.remote.server_cache import BlockMirror

log = logging.getLogger("nbkv.remote.kv_events")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


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
        self.gaps = 0  # batches missed (sequence numbers skipped)
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
                self.gaps += seq - self.last_seq - 1
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
