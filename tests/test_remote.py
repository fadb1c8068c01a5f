"""Remote engines against a real llama-server on 127.0.0.1 (issue 15): no mocks of the server.

The server is the one ``make llama-server`` builds from the llama.cpp sources inside the
installed llama-cpp-python, running the embedded SmolLM2 with 2 slots. Every process a test
starts is stopped by its PID, with bounded waits.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from IPython.core.error import UsageError

import nbkv
import nbkv.core.protocol
from conftest import ipython_shell
from nbkv import Engine
from nbkv.core.errors import (
    ContextOverflowError,
    InvalidRequestError,
    RestoreError,
    ServerUnreachableError,
    ServerUnsupportedError,
)
from nbkv.notebook.sessions import STORE, SessionStore
from nbkv.remote.server import LlamaServer, binary, free_port
from nbkv.ui.figures import actions, summary

if binary() is None:
    if os.environ.get("NBKV_REQUIRE_SERVER"):
        raise RuntimeError("no llama-server binary, and NBKV_REQUIRE_SERVER is set: "
                           "run `make llama-server`")
    pytest.skip("no llama-server binary: run `make llama-server`", allow_module_level=True)

CTX = 1024
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = {"ann": ["What is a CPU?", "And memory?", "Why is a cache fast?"],
             "bob": ["Name a fruit.", "What colour is it?", "Is it sweet?"],
             "cat": ["Hi!", "What can you do?", "Tell me a joke."]}
#: what makes llama-server compute like the in-kernel engine (see nbkv.remote.server.LlamaServer)
SAME_ARITHMETIC = dict(threads=2, batch=256, ubatch=256, flash_attn="off")


def server(tmp_path_factory, **kw) -> LlamaServer:
    save = tmp_path_factory.mktemp("slot-saves")
    return LlamaServer(slots=2, ctx=CTX, slot_save_path=str(save), **SAME_ARITHMETIC, **kw)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with server(tmp_path_factory) as s:
        yield s


@pytest.fixture()
def remote(srv):
    e = nbkv.connect(srv.url)
    e.clear()
    yield e
    e.close()


@pytest.fixture(scope="module")
def local():
    e = Engine(n_slots=2, n_ctx=CTX)
    yield e
    e.close()


def conversation(engine, names=("ann", "bob"), turns=3, max_tokens=16, own_system=False):
    """Sessions taking turns; returns the replies and records in order."""
    conv = {k: [{"role": "system", "content": f"You are {k.title()}'s own assistant. Be brief."
                 if own_system else SYSTEM}] for k in names}
    out = []
    for t in range(turns):
        for k in names:
            conv[k].append({"role": "user", "content": QUESTIONS[k][t]})
            r = engine.chat(conv[k], k, max_tokens=max_tokens)
            conv[k].append(r.message)
            out.append(r)
    return out


def test_connect_detects_llama_server_and_checks_the_template(remote, srv):
    assert remote.kind == "llama-server"
    assert remote.n_slots == 2 and remote.n_ctx == CTX
    assert remote.total_slots == 2
    assert isinstance(remote, nbkv.core.protocol.EngineLike)
    # the kernel's rendering equals the server's /apply-template (checked at connect)
    msgs = [{"role": "user", "content": "Hi"}]
    theirs = httpx.post(srv.url + "/apply-template", json={"messages": msgs}).json()["prompt"]
    assert remote.render(msgs) == theirs


def test_replies_equal_the_in_kernel_engine_and_reuse_grows(remote, local):
    local.clear()
    mine, theirs = conversation(local), conversation(remote)
    assert [r.text for r in theirs] == [r.text for r in mine]
    for r in theirs:
        assert r.record.verified, r.record.note
    by = {}
    for r in theirs:
        prev = by.get(r.record.session)
        if prev is not None:  # the server reused the previous turn, its reply included
            assert r.record.reused_tokens >= prev.record.prompt_tokens
            assert r.record.reason == "continued"
        by[r.record.session] = r
    # nbkv's slot table agrees with the server's own count, once nbkv's own rewrite of the
    # last reply has run (while it runs the server's slot holds the reply's rows cut off)
    remote.settle()
    remote.poll()
    for s in remote.slots():
        server_n = next(x["n_prompt_tokens"] for x in remote.server_slots if x["id"] == s.index)
        assert server_n == s.n_tokens and s.verified


def test_three_sessions_on_two_slots_evict_by_lru(remote):
    recs = [r.record for r in conversation(remote, ("ann", "bob", "cat"), turns=2,
                                           max_tokens=4)]
    evicting = [r for r in recs if r.evicted_session is not None]
    assert evicting, [summary(r) for r in recs]
    assert {r.slot for r in recs} == {0, 1}
    returning = [r for r in recs[3:]]
    assert all(r.reason == "evicted" for r in returning)
    assert all(r.verified for r in recs)
    # the server reused only what nbkv expected: the shared system prompt of the slot taken
    for r in returning:
        assert r.reused_tokens < r.prompt_tokens // 2
    for r in recs:  # the KV map draws the server's figures
        by = {}
        for seg in r.segments:
            by[seg.state] = by.get(seg.state, 0) + seg.length
        assert by.get("reused", 0) == r.reused_tokens
        assert by.get("prefilled", 0) == r.prompt_tokens - r.reused_tokens


def test_another_client_on_a_pinned_slot_is_flagged_not_verified(remote, srv):
    first = remote.chat([{"role": "user", "content": "Count to three."}], "ann", max_tokens=4)
    slot = first.record.slot
    remote.settle()  # nbkv's own rewrite of the reply has run: the next task is the other's
    other = remote.tokenize_prompt([{"role": "user", "content": "Something else entirely."}])
    httpx.post(srv.url + "/completion", json={"prompt": other, "id_slot": slot, "n_predict": 2,
                                              "cache_prompt": True}, timeout=60).raise_for_status()
    remote.poll()  # /slots shows what nbkv did not put there (or the poller thread saw it)
    s = remote.slots()[slot]
    assert not s.verified and "nbkv expects" in s.note
    again = remote.chat([{"role": "user", "content": "Count to three."}, first.message,
                         {"role": "user", "content": "Again."}], "ann", max_tokens=4)
    rec = again.record
    assert not rec.verified and "nbkv expects" in rec.note and "another client" in rec.note
    assert "not verified" in summary(rec)
    assert rec.reused_tokens < first.record.prompt_tokens  # nothing was silently assumed
    assert rec.exact  # what the slot held was not known: rebuilt, so the reply is exact


def test_slot_cards_and_kv_map_follow_the_server(remote, srv):
    pytest.importorskip("ipywidgets")
    from nbkv.ui.widgets import CacheDashboard

    dash = CacheDashboard(remote, live=False)
    try:
        remote.chat([{"role": "user", "content": "Hello there."}], "ann", max_tokens=4)
        dash.feed.flush()
        cards = " ".join(c.value for c in dash.slots.cards)
        assert "ann" in cards and "server" in cards
        assert dash.kvmap.segments > 0
        slot = remote.history[-1].slot
        remote.settle()  # nbkv's own idle-time rewrite first: it must not follow the other task
        other = remote.tokenize_prompt([{"role": "user", "content": "Not nbkv's."}])
        httpx.post(srv.url + "/completion", json={"prompt": other, "id_slot": slot,
                                                  "n_predict": 1}, timeout=60)
        remote.poll()
        dash.feed.flush()
        assert "not verified" in dash.slots.cards[slot].value
        assert "not verified" in dash.kvmap.note.value
    finally:
        dash.close()


def test_interrupt_mid_stream_keeps_the_partial_reply_and_the_slot_exact(remote, local):
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Tell me a long story about a cat."}]
    stream = remote.chat(msgs, "ann", stream=True, max_tokens=200)
    got = [next(stream) for _ in range(4)]
    stream.close()
    assert stream.record is not None and stream.record.finish_reason == "cancelled"
    assert stream.text.startswith("".join(got))
    s = remote.slots()[stream.record.slot]
    assert s.verified and s.n_tokens >= stream.record.prompt_tokens
    # the next turn continues from the partial reply and still equals the in-kernel engine
    follow = msgs + [{"role": "assistant", "content": stream.text},
                     {"role": "user", "content": "Go on."}]
    r = remote.chat(follow, "ann", max_tokens=8)
    assert r.record.verified, r.record.note
    assert r.record.reused_tokens >= stream.record.prompt_tokens
    local.clear()
    assert r.text == local.chat(follow, "ann", max_tokens=8).text


def test_server_killed_mid_request_then_restarted(tmp_path_factory):
    with server(tmp_path_factory) as s:
        e = nbkv.connect(s.url)
        try:
            msgs = [{"role": "user", "content": "Tell me a long story."}]
            stream = e.chat(msgs, "ann", stream=True, max_tokens=400)
            next(stream)
            s.kill()
            with pytest.raises(ServerUnreachableError, match="no server answers"):
                for _ in stream:
                    pass
            assert stream.record is not None and stream.record.finish_reason == "error"
            assert not e.slots()[stream.record.slot].verified  # content unknown now
            with pytest.raises(ServerUnreachableError):
                e.chat(msgs, "ann", max_tokens=2)
            s.start()
            r = e.chat(msgs, "ann", max_tokens=4)
            assert r.text and r.record.finish_reason in ("stop", "length")
            assert r.record.verified and e.slots()[r.record.slot].verified
        finally:
            e.close()
    assert s.pid is None


def test_named_errors(srv):
    with pytest.raises(ServerUnreachableError, match="python -m nbkv.remote.server"):
        nbkv.connect(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ServerUnsupportedError, match="-np 3"):
        nbkv.connect(srv.url, slots=3)
    e = nbkv.connect(srv.url)
    try:
        before = e.slots()
        with pytest.raises(ContextOverflowError, match="does not fit"):
            e.chat([{"role": "user", "content": "word " * 1200}], max_tokens=2)
        # checked as the in-kernel engine checks them (nbkv.core.api)
        with pytest.raises(InvalidRequestError, match="session must be a non-empty str"):
            e.chat([{"role": "user", "content": "hi"}], session=5)
        with pytest.raises(InvalidRequestError, match="timeout must be a number of seconds"):
            e.chat([{"role": "user", "content": "hi"}], timeout=0)
        assert e.slots() == before and not e.history  # refused before anything was sent
    finally:
        e.close()


def test_openai_compatible_path_reports_cached_tokens(srv):
    e = nbkv.connect(srv.url, kind="openai")
    try:
        assert e.kind == "openai" and e.n_slots == 0 and e.slots() == ()
        recs = [r.record for r in conversation(e, ("ann",), turns=2, max_tokens=8)]
        assert recs[0].prompt_tokens > 0
        assert recs[1].reused_tokens >= recs[0].prompt_tokens  # the server's prefix cache
        assert all(r.verified for r in recs)
        with pytest.raises(ContextOverflowError):  # reported by the server, named here
            e.chat([{"role": "user", "content": "word " * 1200}], max_tokens=2)
        with pytest.raises(InvalidRequestError, match="manages its own cache"):
            e.clear()
    finally:
        e.close()


def test_concurrent_sessions_on_both_slots(remote):
    results, errors = {}, []

    def run(name):
        try:
            results[name] = remote.chat([{"role": "user", "content": QUESTIONS[name][0]}],
                                        name, max_tokens=6)
        except BaseException as e:  # noqa: BLE001 - reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("ann", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # bounded: a hung request fails the test instead of hanging it
    assert not [t for t in threads if t.is_alive()], "a request did not finish"
    assert not errors and set(results) == {"ann", "bob"}
    assert {r.record.slot for r in results.values()} == {0, 1}
    assert all(r.record.verified for r in results.values())


def test_unified_kv_with_idle_slot_caching_clears_pinned_slots(tmp_path_factory):
    """Why nbkv asks for --no-kv-unified: with one KV buffer for all slots and idle-slot
    caching (llama-server's defaults when -np is not given), starting a task on one slot
    saves the idle slots to the host-memory prompt cache and clears them
    (server-context.cpp, TAG_IDLE_SLOT_CLEAR). nbkv notices and says so."""
    with server(tmp_path_factory, extra=("--kv-unified", "--cache-ram", "64",
                                         "--cache-idle-slots")) as s:
        e = nbkv.connect(s.url)
        try:
            a = e.chat([{"role": "user", "content": "Hello, I am Ann."}], "ann", max_tokens=4)
            assert e.slots()[a.record.slot].verified
            e.chat([{"role": "user", "content": "Hello, I am Bob."}], "bob", max_tokens=4)
            e.poll()
            cleared = e.slots()[a.record.slot]
            assert not cleared.verified and "server holds 0 tokens" in cleared.note
        finally:
            e.close()


def test_a_restore_from_the_servers_cache_ram_is_told_from_a_plain_hit(tmp_path_factory,
                                                                        local):
    """With --cache-ram a session coming back to a slot another took is loaded from the
    server's RAM: more than the pinned slot held, verified, said as a restore, exact."""
    local.clear()
    # (own system prompts: llama-server parks a slot's prompt only when a request would
    # keep less than half of it)
    mine = conversation(local, ("ann", "bob", "cat"), turns=2, max_tokens=4, own_system=True)
    with server(tmp_path_factory, cache_ram=64) as s:
        assert s.argv[s.argv.index("--cache-ram") + 1] == "64"
        e = nbkv.connect(s.url)
        try:
            theirs = conversation(e, ("ann", "bob", "cat"), turns=2, max_tokens=4,
                                  own_system=True)
        finally:
            e.close()
    assert [r.text for r in theirs] == [r.text for r in mine]
    recs = [r.record for r in theirs]
    assert all(r.verified for r in recs) and not any(r.restored_from for r in recs[:3])
    for r, first in zip(recs[3:], recs):  # each comes back to a slot another session took
        assert r.evicted_session not in (None, r.session)
        assert r.restored_from == "server-ram" and r.reason == "restored", summary(r)
        assert r.reused_tokens == r.restored_tokens >= first.prompt_tokens
        assert "--cache-ram" in r.reason_text and r.restored_session == r.session
        assert r.exact, summary(r)  # asked for at its canonical end, proven by the ledger
        assert f"restored {r.session}'s {r.reused_tokens} tokens from the server's RAM" in \
            " ".join(t for t, _ in actions(r))


def test_a_new_connection_does_not_trust_what_the_server_already_holds(remote, srv):
    r = remote.chat([{"role": "user", "content": "Remember the number 7."}], "ann",
                    max_tokens=4)
    e = nbkv.connect(srv.url)
    try:
        s = e.slots()[r.record.slot]
        assert not s.verified and "before nbkv connected" in s.note
        again = e.chat([{"role": "user", "content": "Remember the number 7."}, r.message,
                        {"role": "user", "content": "Which number?"}], "ann", max_tokens=4)
        assert again.record.verified and "unknown" in again.record.note
        assert e.slots()[again.record.slot].verified
    finally:
        e.close()


def test_magics_connect_chat_and_switch_back(srv, tmp_path):
    ip = ipython_shell()
    ip.run_line_magic("load_ext", "nbkv")
    ip.run_line_magic("config", "Nbkv.frontend = 'terminal'")
    STORE.clear()
    try:
        out = ip.run_line_magic("kvcache", f"connect {srv.url} --slots 2")
        assert "llama-server" in str(out) and "pinned by nbkv" in str(out)
        ip.run_cell_magic("chat", "ann --max-tokens 4", "Hello!")
        ip.run_cell_magic("chat", "ann --max-tokens 4", "And again?")
        recs = nbkv.session("ann").records
        assert len(recs) == 2 and recs[1].reused_tokens >= recs[0].prompt_tokens
        for cmd in ("status", "slots", "stats", "history", "explain"):
            assert str(ip.run_line_magic("kvcache", cmd))
        assert "ann" in str(ip.run_line_magic("kvcache", "slots"))
        os.environ.pop("NBKV_TEST_NO_KEY", None)
        with pytest.raises(UsageError, match="NBKV_TEST_NO_KEY"):
            ip.run_line_magic("kvcache", f"connect {srv.url} --api-key-env NBKV_TEST_NO_KEY")
        with pytest.raises(UsageError, match="does not take --mmproj"):
            ip.run_line_magic("kvcache", f"connect {srv.url} --mmproj x.gguf")
        save_dir = tmp_path / "save"
        assert "saved 1 slot(s)" in str(ip.run_line_magic("kvcache", f"save {save_dir}"))
        assert "restored" in str(ip.run_line_magic("kvcache", f"restore {save_dir}"))
        assert "last save" in str(ip.run_line_magic("kvcache", "status"))
        ip.run_line_magic("kvcache", "load --slots 1 --ctx 512")  # back in the kernel
        assert isinstance(STORE.engine, Engine)
    finally:
        ip.run_line_magic("kvcache", "unload")
        ip.run_line_magic("unload_ext", "nbkv")
        ip.config.pop("Nbkv", None)
        STORE.clear()


def test_save_restore_survives_a_kernel_and_a_server_restart(tmp_path):
    """Save, restart the server (same --slot-save-path) and the client, restore, continue:
    the next turn reuses the whole conversation and replies as the uninterrupted run."""
    srv = LlamaServer(slots=2, ctx=CTX, slot_save_path=str(tmp_path / "server"),
                      **SAME_ARITHMETIC)
    with srv:
        e = nbkv.connect(srv.url)
        store = SessionStore()
        try:
            for name in ("ann", "bob"):
                store.get(name).system = SYSTEM
                store.get(name).chat(QUESTIONS[name][0], engine=e, max_tokens=8)
            rep = e.save(tmp_path / "kernel", store)
            assert len(rep.slots) == 2 and set(rep.sessions) == {"ann", "bob"}
            follow = store.get("ann").messages + [{"role": "user", "content": "Go on."}]
            want = e.chat(follow, "ann", max_tokens=8)
        finally:
            e.close()
        srv.stop()  # a server restart: its slots are empty again
        srv.start()
        e = nbkv.connect(srv.url)
        fresh = SessionStore()
        try:
            with pytest.raises(RestoreError, match="no remote-engine save"):
                e.restore(tmp_path / "nowhere", fresh)
            rep = e.restore(tmp_path / "kernel", fresh)
            assert {s.session for s in rep.slots} == {"ann", "bob"}
            assert all(s.verified for s in e.slots())
            assert fresh.get("ann").messages == store.get("ann").messages[:3]
            got = e.chat(fresh.get("ann").messages + [{"role": "user", "content": "Go on."}],
                         "ann", max_tokens=8)
            assert got.text == want.text
            assert got.record.verified and got.record.reason == "continued"
            assert got.record.reused_tokens == want.record.reused_tokens
        finally:
            e.close()


def test_achat_on_the_server(remote):
    import asyncio

    async def both():
        return await asyncio.gather(
            remote.achat([{"role": "user", "content": "Hi!"}], "ann", max_tokens=4),
            remote.achat([{"role": "user", "content": "Name a fruit."}], "bob", max_tokens=4))

    a, b = asyncio.run(both())
    assert a.text and b.text and {a.record.slot, b.record.slot} == {0, 1}


def test_python_m_nbkv_server_runs_until_ctrl_c():
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nbkv.remote.server", "--port", str(port),
                             "--slots", "1", "--ctx", "512", "--threads", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "ready" in line or not line:
                break
        assert f"%kvcache connect http://127.0.0.1:{port}" in "".join(lines), lines
        argv = lines[0].split()  # --cache-ram sized from the in-kernel parking budget
        assert 0 < int(argv[argv.index("--cache-ram") + 1]) <= 4096
        e = nbkv.connect(f"http://127.0.0.1:{port}")
        assert e.n_slots == 1 and e.n_ctx == 512
        e.close()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with pytest.raises(ServerUnreachableError):
        nbkv.connect(f"http://127.0.0.1:{port}")
