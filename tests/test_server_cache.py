"""A server's own prefix cache as nbkv pictures it (issue 33), with no server: vLLM's
/metrics text, block cuts, the block mirror, and its KV-event wire format over a real
ZeroMQ socket in this process (a publisher that speaks as vLLM's does)."""

from __future__ import annotations

import time

import pytest

from nbkv.core.events import GENERATED, PREFILLED, REUSED, Segment
from nbkv.remote.server_cache import (
    BlockMirror,
    batch_events,
    block_segments,
    cache_facts,
    cacheable,
    event_source,
    read_metrics,
    replay_endpoint,
    subscribe_endpoint,
)

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/m m"} 1741.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/m m"} 896.0
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/m m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",\
kv_cache_size_tokens="8192",num_gpu_blocks="64"} 1.0
"""


def test_vllm_metrics_give_block_size_capacity_and_counters():
    facts = cache_facts(read_metrics(METRICS))
    assert (facts.block_size, facts.capacity_tokens, facts.prefix_caching) == (128, 8192, True)
    assert (facts.queries, facts.hits, facts.usage) == (1741, 896, 0.25)
    stats = facts.stats()
    assert stats["server prefix-cache hit rate (%)"] == pytest.approx(100 * 896 / 1741)
    assert stats["server block size (tokens)"] == 128
    # a server without vLLM's metrics (or an HTML page) says nothing, and fails nothing
    assert cache_facts(read_metrics("<html>no</html>")).stats() == {}
    assert cache_facts(read_metrics("")).block_size is None


def test_block_segments_cut_every_span_at_block_boundaries():
    segs = (Segment(0, 200, 0, "system", REUSED), Segment(200, 300, 1, "user", PREFILLED),
            Segment(300, 310, 2, "assistant", GENERATED))
    cut = block_segments(segs, 128)
    assert [(s.start, s.end, s.message) for s in cut] == [
        (0, 128, 0), (128, 200, 0), (200, 256, 1), (256, 300, 1), (300, 310, 2)]
    assert block_segments(segs, None) == segs
    assert (cacheable(255, 128), cacheable(256, 128), cacheable(7, None)) == (128, 256, 7)


def stored(hashes, parent, tokens, size=4):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": size}


def test_the_mirror_follows_stores_evictions_and_clears():
    m = BlockMirror()
    conv = list(range(100, 111))  # 11 tokens: 2 whole blocks of 4, then a partial one
    assert m.cached_prefix(conv) == 0
    assert m.apply([stored([1, 2], None, conv[:8])])
    assert m.cached_prefix(conv) == 8 and m.block_size == 4 and len(m) == 2
    # another conversation that shares the first block but not the second
    other = conv[:4] + [9, 9, 9, 9]
    m.apply([stored([3], 1, other[4:])])
    assert m.cached_prefix(other) == 8 and m.cached_prefix(conv) == 8
    # the same tokens at another place in the chain are another block
    assert m.cached_prefix(conv[4:8] + conv[:4]) == 0
    m.apply([{"type": "BlockRemoved", "block_hashes": [2]}])
    assert m.cached_prefix(conv) == 4 and m.removed == 1
    m.apply([{"type": "BlockRemoved", "block_hashes": [1]}])  # the parent goes: the chain too
    assert m.cached_prefix(other) == 0
    m.apply([{"type": "AllBlocksCleared"}])
    assert len(m) == 0 and m.cleared == 1
    # images or a cache salt in a block's hash: not a text prefix, not mirrored
    assert not m.apply([{**stored([7], None, conv[:4]), "extra_keys": [["salt"]]}])


def test_where_to_subscribe():
    url = "http://10.0.0.5:8000"
    assert subscribe_endpoint("tcp://*:5557", url) == ("tcp://10.0.0.5:5557", "")
    assert subscribe_endpoint("tcp://0.0.0.0:5557", url)[0] == "tcp://10.0.0.5:5557"
    endpoint, why = subscribe_endpoint("tcp://10.0.0.9:5557", url)
    assert endpoint is None and "tcp://*:PORT" in why  # vLLM would connect out
    assert subscribe_endpoint("ipc:///tmp/kv", "http://127.0.0.1:8000")[0] == "ipc:///tmp/kv"
    assert subscribe_endpoint("ipc:///tmp/kv", url)[0] is None  # a socket on another machine
    cfg = event_source({"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}})
    assert cfg is not None and replay_endpoint(cfg, url) == "tcp://10.0.0.5:5558"
    assert event_source({}) is None and event_source({"0": {"enable_kv_cache_events": False,
                                                            "endpoint": "tcp://*:1"}}) is None
    assert batch_events([1.0, [{"type": "AllBlocksCleared"}], None]) == [
        {"type": "AllBlocksCleared"}]


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_listener_replays_then_follows_and_notices_a_restart(tmp_path):
    """A publisher speaking vLLM's wire format (PUB + replay ROUTER) in this process."""
    msgpack = pytest.importorskip("msgpack")
    zmq = pytest.importorskip("zmq")
    from nbkv.remote.server_cache import KVEventListener

    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_ep, replay_ep = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    pub.bind(pub_ep)
    router.bind(replay_ep)
    sent: list[tuple[int, bytes]] = []
    clock = [1000.0]

    def publish(seq, events):
        clock[0] += 1
        payload = msgpack.packb([clock[0], events, None])
        sent.append((seq, payload))
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    conv = list(range(12))
    publish(0, [stored([1], None, conv[:4])])  # before anyone listens: only in the replay
    listener = None
    try:
        listener = KVEventListener(pub_ep, "kv", replay=replay_ep, replay_timeout=5.0)
        client, _, start = router.recv_multipart()  # serve the replay as vLLM does
        assert int.from_bytes(start, "big") == 0
        for seq, payload in sent:
            router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        assert listener.ready.wait(5) and listener.replayed == 1
        assert listener.mirror.cached_prefix(conv) == 4 and listener.mirror.since_start
        time.sleep(0.3)  # the subscription reaches the publisher
        publish(1, [stored([2], 1, conv[4:8])])
        assert wait_for(lambda: listener.mirror.cached_prefix(conv) == 8)
        publish(2, [{"type": "BlockRemoved", "block_hashes": [2]}])
        assert wait_for(lambda: listener.mirror.cached_prefix(conv) == 4)
        publish(0, [stored([5], None, conv[4:8])])  # numbering starts again: a new server
        assert wait_for(lambda: listener.restarts == 1)
        assert listener.mirror.cached_prefix(conv) == 0 and len(listener.mirror) == 1
    finally:
        if listener is not None:
            listener.close()
            assert not listener.alive
        pub.close(0)
        router.close(0)


FAKE_VLLM = r'''#!/bin/sh
# speaks as vLLM's start-up does: its log lines, then /health on --port
while [ "$1" != "--port" ]; do shift; done
port=$2
for line in "(EngineCore pid=1) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0)" \
            "(Worker pid=2) INFO [cpu_model_runner.py:68] Starting to load model /m..." \
            "(Worker pid=2) INFO [default_loader.py:501] Loading weights took 0.03 seconds" \
            "(EngineCore pid=1) INFO [core.py:402] init engine (profile, ...) took 0.01 s"; do
  sleep 0.6; echo "$line"
done
exec "$NBKV_TEST_PYTHON" -c "
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', $port), H).serve_forever()"
'''


def test_a_vllm_start_shows_each_stage_its_log_tells(tmp_path, monkeypatch):
    """vLLM takes 20 s to minutes to start on a CPU: the wait shows where it is."""
    import sys

    from nbkv.remote.vllm_server import STAGES, VLLMServer, start_stage

    assert start_stage("") == (0, "importing torch and vLLM")
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM)
    fake.chmod(0o755)
    monkeypatch.setenv("NBKV_TEST_PYTHON", sys.executable)
    steps = []
    srv = VLLMServer(tmp_path, python=fake, kv_events=False)
    try:
        srv.start(timeout=30, progress=steps.append)
    finally:
        srv.stop(timeout=5)
    assert srv.pid is None
    whats = [s.what for s in steps if not s.final]
    stages = [w.split(": ", 1)[1] for w in dict.fromkeys(whats)]
    every = [stage for _, stage in STAGES]
    assert stages[0] == "importing torch and vLLM" and stages[-1] == every[-1]
    assert stages[1:] == [s for s in every if s in stages]  # in order (a quick one may pass
    # between two looks at the log)
    assert steps[-1].final and max(s.done for s in steps) == len(STAGES)
    assert f"port {srv.port}" in whats[0] and "its log: " in steps[0].why
