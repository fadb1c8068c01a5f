"""Remote engines facing servers that misbehave or are not LLM servers (issue 32, items 6, 9).

Each fake server is a real HTTP server on 127.0.0.1 in a thread of this process (no model,
no mocks of nbkv), stopped at the end of its test: a stream cut short, a static file server.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from IPython.core.error import UsageError

import nbkv
from conftest import ipython_shell
from nbkv.core.errors import (
    IncompleteReplyError,
    InvalidRequestError,
    ServerError,
    ServerUnsupportedError,
)
from nbkv.notebook.sessions import STORE


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` on 127.0.0.1 at a free port, in a thread; its URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(10)


class CutShort(BaseHTTPRequestHandler):
    """An OpenAI-compatible server whose streamed answer stops after two deltas: no
    ``finish_reason``, no ``[DONE]``, the connection closed (a crash mid-reply)."""

    protocol_version = "HTTP/1.0"  # the answer ends when the connection closes

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "Not Found"}})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in ("Hel", "lo"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece},
                                  "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()


def test_a_stream_that_ends_early_is_a_named_error_keeping_the_partial_text():
    with serving(CutShort) as url:
        e = nbkv.connect(url)
        try:
            assert e.kind == "openai" and e.model_name == "fake"
            with pytest.raises(IncompleteReplyError, match="without its final event") as ei:
                e.chat([{"role": "user", "content": "Hi"}], "ann", max_tokens=8)
            assert isinstance(ei.value, ServerError)  # as the llama-server path names it
            assert ei.value.text == "Hello"  # the partial reply, for the user
            rec = e.history[-1]
            assert rec.finish_reason == "error" and "IncompleteReplyError" in rec.error
            stream = e.chat([{"role": "user", "content": "Hi"}], "ann", stream=True)
            with pytest.raises(IncompleteReplyError):
                for _ in stream:
                    pass
            assert stream.text == "Hello"
        finally:
            e.close()


def test_chat_magic_does_not_store_a_cut_reply_as_the_assistants_turn():
    ip = ipython_shell()
    ip.run_line_magic("load_ext", "nbkv")
    ip.run_line_magic("config", "Nbkv.frontend = 'terminal'")
    STORE.clear()
    try:
        with serving(CutShort) as url:
            assert "OpenAI-compatible" in str(ip.run_line_magic("kvcache", f"connect {url}"))
            with pytest.raises((UsageError, IncompleteReplyError), match="final event"):
                ip.run_cell_magic("chat", "ann --max-tokens 8", "Hello!")
            assert nbkv.session("ann").messages == []  # no truncated "Hello" as a reply
            ip.run_line_magic("kvcache", "unload")
    finally:
        ip.run_line_magic("unload_ext", "nbkv")
        ip.config.pop("Nbkv", None)
        STORE.clear()


@pytest.mark.parametrize("url", ["ftp://x", "file:///tmp/x", "ws://127.0.0.1:1"])
def test_connect_to_a_url_that_is_not_http_is_refused_by_name(url):
    with pytest.raises(InvalidRequestError, match="http:// or https://") as ei:
        nbkv.connect(url)
    assert "http://ftp" not in str(ei.value) and "http://file" not in str(ei.value)


def test_connect_refuses_a_server_that_is_not_openai_compatible(tmp_path):
    (tmp_path / "index.html").write_text("<h1>files</h1>")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    with serving(handler) as url:  # type: ignore[arg-type]
        for kind in (None, "openai"):
            with pytest.raises(ServerUnsupportedError,
                               match="not an OpenAI-compatible server.*/v1/models"):
                nbkv.connect(url, kind=kind)
        (tmp_path / "v1").mkdir()
        (tmp_path / "v1" / "models").write_text("<html>a page, not a model list</html>")
        with pytest.raises(ServerUnsupportedError, match="not a model list"):
            nbkv.connect(url)


def test_a_closed_connection_is_a_named_error_and_a_quiet_poll(caplog):
    """An engine closed while its poller's ``/slots`` read was on its way: the read is an
    EngineClosedError (not httpx's bare RuntimeError), and the poller ends without a word."""
    import logging
    import weakref

    from nbkv.core.errors import EngineClosedError
    from nbkv.remote.http_client import ServerClient
    from nbkv.remote.llama_server import _poll_loop

    client = ServerClient("http://127.0.0.1:9")
    client.close()
    with pytest.raises(EngineClosedError):
        client.get("/slots")

    class ClosingMidPoll:
        closed, _poll_every, _last_poll = False, 0.01, 0.0

        def poll(self) -> bool:
            self.closed = True  # close() ran on another thread meanwhile
            return client.get("/slots")

    eng = ClosingMidPoll()
    caplog.set_level(logging.DEBUG, logger="nbkv")
    _poll_loop(weakref.ref(eng))  # returns: the engine is closed
    assert not [r for r in caplog.records if r.exc_info], caplog.text


class SlowToAnswer(CutShort):
    """An OpenAI-compatible server that sends no headers until the test lets it (a long
    prefill before the first event); ``asked`` is set when a completion came in."""

    asked = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        SlowToAnswer.asked.set()
        SlowToAnswer.release.wait(60)
        try:
            super().do_POST()
        except OSError:  # the client has gone
            pass


def test_a_stream_closed_before_the_server_answers_ends_at_once():
    """``close()`` on a stream whose server has not sent its headers yet (a long prefill)
    ends the request then, not when the server begins to answer."""
    SlowToAnswer.asked.clear()
    SlowToAnswer.release.clear()
    with serving(SlowToAnswer) as url:
        e = nbkv.connect(url)
        try:
            stream = e.chat([{"role": "user", "content": "Hi"}], "ann", stream=True,
                            max_tokens=8)
            assert SlowToAnswer.asked.wait(30)
            closer = threading.Thread(target=stream.close, daemon=True)
            closer.start()
            closer.join(20)  # a bound: the server holds its answer until released below
            assert not closer.is_alive(), "close() waited for the server's answer"
            assert stream.record is not None and stream.record.finish_reason == "cancelled"
            assert not stream.record.exact
        finally:
            SlowToAnswer.release.set()
            e.close()


def test_a_cut_short_llama_server_reply_is_never_exact(monkeypatch):
    """A reply cancelled before the server's last event has no ``timings.cache_n``: even
    with every steered row proven, it is not said exact (it was never compared)."""
    from types import SimpleNamespace as NS

    from nbkv.kv.invariance import PrefillRule
    from nbkv.remote import exchange, steering

    monkeypatch.setattr(steering, "observed", lambda *a, **kw: (5, True))
    eng = NS(rule=PrefillRule(8, 4), proven=lambda *a: None, facts=NS(plan_ubatch=256))
    for final, exact in (({"timings": {"cache_n": 3}}, True), ({}, False)):
        ex = exchange.Exchange(eng, NS(), NS(tokens=[1, 2, 3, 4, 5]), NS(failed=""))
        ex.out.planned, ex.out.told, ex.out.final = object(), 3, final
        ex.judge([1, 2, 3], 3)
        assert ex.out.exact is exact, ex.out.exact_note
    assert "cut short" in ex.out.exact_note


def test_a_cancel_that_closes_the_stream_under_its_reader_is_a_cancel_not_an_error():
    """ChatStream.close shuts the HTTP stream from another thread; the reader's read then
    fails ("incomplete chunked read"). That is the cancel taking effect, not a server fault."""
    from nbkv.core.streams import SamplingParams
    from nbkv.remote.base import RemoteBase, RemoteJob
    from nbkv.remote.http_client import ServerUnreachableError

    job = RemoteJob("ann", SamplingParams(), 5.0)

    class Cut:
        closed = False
        cancels = True

        def __iter__(self):
            yield {"content": "Once"}
            if Cut.cancels:
                job.cancel.set()  # closed by the user's thread meanwhile
            raise ServerUnreachableError("peer closed connection (incomplete chunked read)")

        def close(self):
            self.closed = True

    class Client:
        url = "http://fake"

        def stream(self, path, body, opening):
            return Cut()

    engine = RemoteBase.__new__(RemoteBase)
    engine.client = Client()
    assert [ev["content"] for ev in engine._events(job, "/completion", {})] == ["Once"]
    assert job.stream.closed
    job.cancel.clear()  # a read that fails with no cancel is still the server's error
    Cut.cancels = False
    with pytest.raises(ServerUnreachableError):
        list(engine._events(job, "/completion", {}))
