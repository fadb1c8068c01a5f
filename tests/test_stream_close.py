"""A stream closed from another thread never hangs its reader, on either engine (issue 38).

A watchdog (``threading.Timer(t, stream.close)``) closes a stream while another thread
iterates it, at many delays: before the first token, in the prefill, mid-reply, after the
end. Every reader must end, with the partial text and the record, or with a named error.
"""

from __future__ import annotations

import os
import threading

import pytest

import nbkv
from nbkv import Engine
from nbkv.core.errors import NbkvError
from nbkv.remote.server import LlamaServer, binary

#: seconds after the request was sent; 0 closes it before the reader's first wait
DELAYS = (0.0, 0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.3, 0.5,
          0.8, 1.2)
MSGS = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
JOIN = 30.0  # seconds a reader may take to end once closed (it takes milliseconds)


def _engines():
    yield "kernel"
    yield pytest.param("llama-server", marks=pytest.mark.skipif(
        binary() is None and not os.environ.get("NBKV_REQUIRE_SERVER"),
        reason="no llama-server binary: run `make llama-server`"))


@pytest.fixture(scope="module", params=list(_engines()))
def engine(request):
    if request.param == "kernel":
        e = Engine(n_slots=2, n_ctx=512)
        yield e
        e.close()
        return
    with LlamaServer(slots=2, ctx=512, threads=2, batch=256, ubatch=256,
                     flash_attn="off") as srv:
        e = nbkv.connect(srv.url)
        yield e
        e.close()


def _read_while_closed(engine, delay: float, session: str) -> dict:
    """Iterate a stream in a thread while a timer closes it after ``delay`` s."""
    stream = engine.chat(MSGS, session, stream=True, max_tokens=48)
    out: dict = {"deltas": []}

    def reader():
        try:
            for d in stream:
                out["deltas"].append(d)
            out["end"] = "done"
        except NbkvError as e:
            out["end"] = e
        except BaseException as e:  # noqa: BLE001 - anything unnamed fails the test
            out["end"] = e

    t = threading.Thread(target=reader, daemon=True)
    timer = threading.Timer(delay, stream.close)
    t.start()
    timer.start()
    t.join(JOIN)
    timer.join(JOIN)
    out["hung"] = t.is_alive()
    out["stream"] = stream
    return out


def test_a_stream_closed_from_another_thread_always_ends_its_reader(engine):
    ended = {"done": 0, "error": 0}
    for i, delay in enumerate(DELAYS * 2):
        out = _read_while_closed(engine, delay, f"s{i % 2}")
        s = out["stream"]
        assert not out["hung"], f"delay {delay}: the reader never returned"
        end = out["end"]
        if end == "done":
            ended["done"] += 1
            assert s.record is not None, f"delay {delay}: ended without a record"
            assert s.finish_reason in ("cancelled", "stop", "length")
            # the reader saw a prefix of the partial text the stream keeps, no more
            seen = "".join(out["deltas"])
            assert s.text.startswith(seen), (seen, s.text)
        else:
            ended["error"] += 1
            assert isinstance(end, NbkvError), f"delay {delay}: unnamed error {end!r}"
        # the engine still serves: the slots are free again
        assert not any(x.pending for x in engine.slots())
    assert ended["done"], ended
    r = engine.chat(MSGS, "after", max_tokens=4)
    assert r.text and r.record.finish_reason in ("stop", "length")


def test_closing_an_answer_the_server_is_slow_to_send_ends_its_reader():
    """A reader blocked on a server that sends nothing more ends when another thread closes.

    The server sends its headers and one event, then nothing for a minute (a long prefill on
    a loaded machine); closing the stream must not wait for the server's next bytes.
    """
    import http.server
    import socketserver
    import time

    from nbkv.remote.http_client import ServerClient

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server hook
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"content": "a"}\n\n')
            self.wfile.flush()
            time.sleep(60)

        def log_message(self, *args):
            pass

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    srv = Server(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    client = ServerClient(f"http://127.0.0.1:{srv.server_address[1]}")
    try:
        events = client.stream("/completion", {"prompt": "x"})
        seen: list = []
        t = threading.Thread(target=lambda: seen.extend(events), daemon=True)
        t.start()
        time.sleep(0.3)  # the reader has its event and waits in the socket for the next
        t0 = time.monotonic()
        events.close()
        t.join(10.0)
        assert not t.is_alive(), "the reader still waits for the server after close()"
        assert seen == [{"content": "a"}] and time.monotonic() - t0 < 10.0
    finally:
        client.close()
        srv.shutdown()
        srv.server_close()
