"""Other clients, restarts, the server's --cache-ram and timeouts, noticed (issue 38, part 2).

Each against a real llama-server; "another client" is another process, as a second
kernel would be.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest

import nbkv
from nbkv import Engine
from nbkv.core.errors import ServerTimeoutError
from nbkv.remote.server import LlamaServer, binary
from nbkv.ui.figures import summary

if binary() is None:
    if os.environ.get("NBKV_REQUIRE_SERVER"):
        raise RuntimeError("no llama-server binary, and NBKV_REQUIRE_SERVER is set: "
                           "run `make llama-server`")
    pytest.skip("no llama-server binary: run `make llama-server`", allow_module_level=True)

CTX = 1024
SYSTEM = "You are a helpful assistant. Answer briefly."


def _server(**kw) -> LlamaServer:
    kw.setdefault("slots", 2)
    return LlamaServer(ctx=CTX, threads=2, **kw)


def _other_kernel(url: str, content: str) -> None:
    """Another process, as a second kernel: it connects and chats on slot 0."""
    code = textwrap.dedent(f"""
        import nbkv
        e = nbkv.connect({url!r}, slots=1)
        r = e.chat([{{"role": "system", "content": {SYSTEM!r}}},
                    {{"role": "user", "content": {content!r}}}], "other", max_tokens=4)
        assert r.record.slot == 0
        e.close()
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get(
        "PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


@pytest.mark.parametrize("exact", [True, False])
def test_two_processes_on_one_server_without_cache_ram(exact):
    """With --cache-ram 0, a count above nbkv's is another client, never a restore."""
    with _server(slots=1, cache_ram=0) as srv:
        e = nbkv.connect(srv.url, exact=exact)
        try:
            assert e.facts.has_cache is False
            _other_kernel(srv.url, "Tell me about owls.")
            r = e.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Tell me about cats."}], "mine",
                       max_tokens=4)
            rec = r.record
            assert not rec.restored_from and rec.reason != "restored", summary(rec)
            assert not rec.verified and "another client" in rec.note, summary(rec)
            assert "not verified" in summary(rec)
            if exact:  # rebuilt, since what the slot holds is not known: exact again
                assert rec.exact and rec.reused_tokens == 0
            # the next turn here is nbkv's own again
            again = e.chat([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "Tell me about cats."}, r.message,
                            {"role": "user", "content": "And dogs?"}], "mine", max_tokens=4)
            assert again.record.verified and again.record.reused_tokens > 0
        finally:
            e.close()


def test_a_server_restarted_between_turns_is_noticed_and_named(tmp_path):
    with _server(cache_ram=0, slot_save_path=str(tmp_path / "slots")) as srv:
        e = nbkv.connect(srv.url)
        try:
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Name a river."}]
            first = e.chat(msgs, "ann", max_tokens=6)
            assert e.slots()[first.record.slot].n_tokens > 0
            srv.stop()
            srv.start()  # same port: a restart between two turns
            e.poll()
            s = e.slots()[first.record.slot]
            assert s.n_tokens == 0 and "server restarted" in s.note, s
            assert e.save(tmp_path / "save") is not None  # nothing stale to trip over
            r = e.chat([*msgs, first.message, {"role": "user", "content": "How long is it?"}],
                       "ann", max_tokens=6)
            assert r.record.reason == "reloaded", summary(r.record)
            assert "server restarted" in r.record.reason_text
            assert r.record.verified and r.record.exact
        finally:
            e.close()


def test_a_restart_is_noticed_by_the_next_request_without_a_poll(tmp_path):
    with _server(cache_ram=0) as srv:
        e = nbkv.connect(srv.url, exact=False)
        e._poll_every = 3600.0  # no background poll in between
        try:
            msgs = [{"role": "user", "content": "Name a river."}]
            first = e.chat(msgs, "ann", max_tokens=6)
            srv.stop()
            srv.start()
            r = e.chat([*msgs, first.message, {"role": "user", "content": "And a lake?"}],
                       "ann", max_tokens=6)
            # told apart from another client: the request names the restart
            assert r.record.reason == "reloaded", summary(r.record)
            assert "server restarted" in r.record.reason_text
            assert e.slots()[r.record.slot].verified
        finally:
            e.close()


def test_restores_from_the_servers_cache_ram_are_restores_not_thrashing():
    """Three sessions on two slots with --cache-ram: the server parks and restores them.
    %kvcache stats counts restores, not misses; nothing says thrashing, nothing "gone"."""
    names = ("ann", "bob", "cat")
    convs = {n: [{"role": "system", "content": f"You are {n.title()}'s own assistant, "
                                               f"patient and precise. Be brief."}]
             for n in names}
    local = Engine(n_slots=2, n_ctx=CTX)
    try:
        for _ in range(3):
            for n in names:
                convs[n].append({"role": "user", "content": f"Round {len(convs[n])}: go on."})
                convs[n].append(local.chat(convs[n], n, max_tokens=4).message)
        kernel = local.stats()
    finally:
        local.close()
    convs = {n: c[:1] for n, c in convs.items()}
    with _server(cache_ram=64) as srv:
        e = nbkv.connect(srv.url)
        try:
            for _ in range(3):
                for n in names:
                    convs[n].append({"role": "user", "content": f"Round {len(convs[n])}: "
                                                                f"go on."})
                    convs[n].append(e.chat(convs[n], n, max_tokens=4).message)
            st = e.stats()
            recs = e.history
        finally:
            e.close()
    assert not kernel["thrashing"]
    assert not st["thrashing"], st["advice"]
    returning = recs[3:]
    assert all(r.restored_from == "server-ram" for r in returning), [
        summary(r) for r in returning]
    assert all(r.strategy != "miss" for r in returning)
    assert all(r.exact and r.verified for r in recs), [summary(r) for r in recs]
    took = [r for r in recs if r.evicted_session]
    assert took and all("parked" in summary(r) and "gone" not in summary(r) for r in took)
    assert st["reused_tokens"] >= kernel["reused_tokens"] * 0.9


def test_after_a_timeout_the_next_record_says_what_the_server_kept():
    with _server(cache_ram=0) as srv:
        e = nbkv.connect(srv.url, exact=False)
        try:
            msgs = [{"role": "user", "content": "Tell me a story. " * 150}]
            clients = (e.client._http, e.client._streams)  # streams have a client of their own
            for c in clients:
                c.timeout = httpx.Timeout(0.01, connect=5.0)  # no patience at all
            with pytest.raises(ServerTimeoutError):
                e.chat(msgs, "ann", max_tokens=8)
            for c in clients:
                c.timeout = httpx.Timeout(600.0, connect=5.0)
            r = e.chat(msgs, "ann", max_tokens=8)
            rec = r.record
            assert "ServerTimeoutError" in rec.reason_text, rec.reason_text
            assert "nothing of session ann was cached" not in rec.reason_text
            if rec.reused_tokens:  # the server kept what it had read before the cut
                assert f"{rec.reused_tokens} tokens" in rec.reason_text, rec.reason_text
            else:  # the cut came before the server read anything (a loaded machine)
                assert "was read again" in rec.reason_text, rec.reason_text
        finally:
            e.close()
