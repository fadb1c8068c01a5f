"""HTTP to a serving engine (llama-server, vLLM, SGLang): JSON calls and server-sent events.

Every failure becomes a named nbkv error: nothing answering (:class:`ServerUnreachableError`),
no answer in time (:class:`ServerTimeoutError`), an endpoint the server does not have
(:class:`ServerUnsupportedError`), a context overflow the server reports
(:class:`ContextOverflowError`), any other 4xx/5xx with the server's own message
(:class:`ServerError`).
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from nbkv.core.errors import (
    ContextOverflowError,
    EngineClosedError,
    InvalidRequestError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    ServerUnsupportedError,
)

#: seconds: connecting, and waiting for the next bytes of an answer (a prefill may be long)
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 600.0


def _timeout(timeout: float | None) -> dict[str, Any]:
    """The ``timeout`` argument of an httpx call with its own limit (none: the client's)."""
    if timeout is None:
        return {}
    return {"timeout": httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT))}


class ServerClient:
    """One server's base URL, its API key, and a pooled connection."""

    def __init__(self, url: str, api_key: str | None = None, *,
                 read_timeout: float = READ_TIMEOUT) -> None:
        if not isinstance(url, str) or not url.strip():
            raise InvalidRequestError(f"the server's URL must be a non-empty str, not {url!r}")
        url = url.strip().rstrip("/")
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", url)
        if scheme is None:
            url = "http://" + url  # host:port, as llama-server and vLLM print it
        elif scheme.group(1).lower() not in ("http", "https"):
            raise InvalidRequestError(
                f"{url}: a serving engine speaks HTTP; give an http:// or https:// URL, "
                f"not {scheme.group(1)}://")
        self.url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # idle connections are dropped before the server's own keep-alive limit (llama-server:
        # 5 s) closes them under a request
        self._http = httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(
            read_timeout, connect=CONNECT_TIMEOUT), limits=httpx.Limits(keepalive_expiry=2.0))
        # streams: a connection each, never pooled, so that its socket is known from the
        # connect on (an Opening can shut it down before the answer's headers)
        self._streams = httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(
            read_timeout, connect=CONNECT_TIMEOUT), limits=httpx.Limits(
                max_keepalive_connections=0))

    def get(self, path: str, timeout: float | None = None, **params: Any) -> Any:
        """``GET path``: the decoded JSON (or text, for ``/metrics``)."""
        return self._call("GET", path, None, timeout, params)

    def post(self, path: str, body: dict[str, Any], timeout: float | None = None,
             **params: Any) -> Any:
        """``POST path`` with a JSON body (and query ``params``): the decoded JSON answer."""
        return self._call("POST", path, body, timeout, params)

    def head_of(self, path: str, header: str, timeout: float | None = None) -> str | None:
        """``GET path``: the value of one response header (None when absent)."""
        kw = _timeout(timeout)
        return self._checked(path, lambda: self._http.get(path, **kw)).headers.get(header)

    def stream(self, path: str, body: dict[str, Any], opening: Opening | None = None
               ) -> EventStream:
        """``POST path`` and read the answer as server-sent events (``data: {...}``).

        ``opening``: closing it (any thread) ends the request before the answer begins,
        with a :class:`ServerError` saying so.
        """
        http = self._streams
        ext = {"trace": opening.trace} if opening is not None else {}

        def send() -> httpx.Response:
            if opening is not None and opening.closed:  # (not sent again once closed)
                raise httpx.ReadError("closed before the answer began")
            # its own connection, never handed back to the pool: close() may shut its
            # socket down from another thread at any moment
            return http.send(http.build_request("POST", path, json=body, extensions=ext,
                                                headers={"Connection": "close"}), stream=True)

        try:
            resp = self._again(send)
        except httpx.HTTPError as e:
            if opening is not None and opening.closed:
                raise ServerError(f"{self.url}{path}: cancelled before the server began to "
                                  f"answer") from e
            raise self._transport_error(e, path) from e
        if resp.status_code >= 400:
            try:
                resp.read()
            finally:
                resp.close()
            raise self._status_error(resp, path)
        return EventStream(resp, self, path)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
        self._streams.close()

    def _call(self, method: str, path: str, body: Any, timeout: float | None,
              params: dict[str, Any] | None) -> Any:
        kw: dict[str, Any] = {"params": params or None, **_timeout(timeout)}
        if body is not None:
            kw["json"] = body
        resp = self._checked(path, lambda: self._http.request(method, path, **kw))
        if "json" in resp.headers.get("content-type", ""):
            return resp.json()
        return resp.text

    def _checked(self, path: str, send: Any) -> httpx.Response:
        """``send()`` (:meth:`_again`), a transport error or an error status raised named."""
        try:
            resp = self._again(send)
        except httpx.HTTPError as e:
            raise self._transport_error(e, path) from e
        if resp.status_code >= 400:
            raise self._status_error(resp, path)
        return resp

    def _again(self, send: Any) -> httpx.Response:
        """``send()``, once more if the server closed a pooled connection before answering.

        Safe to repeat: the server had not read the request (no response byte came back).
        After :meth:`close` (an engine closed, perhaps while a poll was on its way) it
        raises :class:`EngineClosedError`, not httpx's bare ``RuntimeError``.
        """
        try:
            try:
                return send()
            except httpx.RemoteProtocolError:
                return send()
        except RuntimeError as e:
            if self._http.is_closed:
                raise EngineClosedError(f"{self.url}: this connection was closed") from e
            raise

    def _transport_error(self, e: httpx.HTTPError, path: str) -> ServerError:
        if isinstance(e, httpx.TimeoutException):
            return ServerTimeoutError(f"{self.url}{path}: no answer in time ({e})")
        if isinstance(e, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
            return ServerUnreachableError(
                f"{self.url}: no server answers ({e}); is it running? Start one with "
                f"python -m nbkv.remote.server")
        return ServerError(f"{self.url}{path}: {type(e).__name__}: {e}")

    def _status_error(self, resp: httpx.Response, path: str) -> ServerError | Exception:
        message = resp.text.strip()
        info: dict[str, Any] = {}
        try:
            data = resp.json()
            info = data.get("error", data) if isinstance(data, dict) else {}
            if isinstance(info, dict):
                message = str(info.get("message") or message)
            else:
                message, info = str(info), {}
        except ValueError:
            pass
        code = resp.status_code
        if info.get("type") == "exceed_context_size_error" or "context" in message.lower() and (
                "exceed" in message.lower() or "too long" in message.lower()):
            n = info.get("n_prompt_tokens")
            cap = info.get("n_ctx")
            if not isinstance(n, int) or not isinstance(cap, int):  # vLLM says it in words
                cap_m = re.search(r"maximum context length is (\d+)", message)
                n_m = re.search(r"(?:contains at least|requested) (\d+)", message)
                if cap_m and n_m:
                    n, cap = int(n_m.group(1)), int(cap_m.group(1))
            if isinstance(n, int) and isinstance(cap, int):
                return ContextOverflowError(n, cap)
            return ServerError(f"the server refused a prompt that does not fit its context: "
                               f"{message}", code)
        if code in (404, 405, 501):
            return ServerUnsupportedError(
                f"{self.url}{path}: the server has no such endpoint (HTTP {code}): {message}",
                code)
        if code == 401 or code == 403:
            return ServerError(f"{self.url}{path}: not authorized (HTTP {code}): {message}; "
                               f"pass the key with --api-key-env VAR", code)
        return ServerError(f"{self.url}{path}: HTTP {code}: {message}", code)


def _shut(sock: socket.socket | None) -> None:
    """Shut ``sock`` down (a read blocked in it, in another thread, ends at once)."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by either side
            pass


class Opening:
    """A streamed request until its answer begins: :meth:`close` (any thread) ends it there.

    A server may send an answer's headers only once its first event is ready (llama-server:
    after a prompt's first batch, or its whole prefill), and the request waits for them in
    a socket read. The socket is caught as the connection is made (httpx's ``trace``
    extension), so that a cancel shuts it down at once instead of waiting for the prefill.
    """

    def __init__(self) -> None:
        self.closed = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """The ``trace`` hook httpx calls: note the socket of the connection just made."""
        if event != "connection.connect_tcp.complete":
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._sock = sock
            closed = self.closed
        if closed:
            _shut(sock)

    def close(self) -> None:
        """End the request: its connection is shut down (and none is made after)."""
        with self._lock:
            self.closed = True
            sock = self._sock
        _shut(sock)


class EventStream:
    """The decoded events of a streamed answer; ``close()`` (any thread) stops reading."""

    def __init__(self, resp: httpx.Response, client: ServerClient, path: str) -> None:
        self._resp = resp
        self._client = client
        self._path = path
        self.closed = False
        self.done = False  # the server sent ``data: [DONE]``: the answer is complete

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for line in self._resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    self.done = True
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    err = event["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    raise ServerError(f"{self._client.url}{self._path}: {msg}")
                yield event
        except httpx.HTTPError as e:
            if self.closed:
                return
            raise self._client._transport_error(e, self._path) from e
        except (AttributeError, RuntimeError, ValueError) as e:
            if self.closed:  # closed from another thread while reading
                return
            raise ServerError(f"{self._client.url}{self._path}: broken event stream: {e}"
                              ) from e

    def close(self) -> None:
        """Stop the answer: the server sees the connection close and cancels the task.

        A reader blocked in the socket (the server slow to send its next bytes: a long
        prefill, a loaded machine) ends at once: closing a socket from another thread does
        not wake a read in progress, shutting it down does.
        """
        self.closed = True
        stream = self._resp.extensions.get("network_stream")
        if stream is not None and not self._resp.is_closed:  # (its own: ServerClient.stream)
            _shut(stream.get_extra_info("socket"))
        self._resp.close()
