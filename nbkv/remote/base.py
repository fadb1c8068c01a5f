"""What both remote engine kinds share: requests on threads, events, history, close."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from nbkv.core.api import ChatAPI
from nbkv.core.errors import (
    EngineClosedError,
    InvalidRequestError,
    ServerError,
)
from nbkv.core.events import (
    EventBus,
    RequestFinished,
    RequestRecord,
    SlotsChanged,
)
from nbkv.core.streams import ChatStream, Request, SamplingParams
from nbkv.kv import admission
from nbkv.remote.http_client import EventStream, Opening, ServerClient

log = logging.getLogger("nbkv.remote.connect")

#: a KV position whose token the server did not send (decoded after an interrupt)
UNKNOWN = -1
#: seconds between two ``/slots`` polls (slot cards, "not verified" detection)
POLL_INTERVAL = 1.0
#: a conversation used to check the kernel's template rendering against the server's
PROBE = ({"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Name a colour."})


class RemoteJob(Request):
    """A request in flight on a server: its reply text and the HTTP stream."""

    def __init__(self, session: str | None, params: SamplingParams, timeout: float) -> None:
        super().__init__(session, params, timeout)
        self.stream: EventStream | None = None
        self.opening: Opening | None = None  # the stream until its answer begins
        self.text = ""


class RemoteBase(ChatAPI):
    """Requests on threads, events, history, close: what both remote kinds share."""

    kind = "remote"

    def __init__(self, client: ServerClient) -> None:
        self.client = client
        self.url = client.url
        self.events = EventBus()
        self._cv = threading.Condition()
        self._jobs: set[RemoteJob] = set()
        self.closed = False
        self.wait_timeout = 600.0
        self.last_save: Any = None  # reports of %kvcache save / restore (llama-server)
        self.last_restore: Any = None

    def _submit(self, messages: Sequence[Mapping[str, Any]], session: str | None,
                overflow: str | None, timeout: float | None, **sampling: Any) -> ChatStream:
        """Send one request to the server, on a thread of its own: its stream."""
        if self.closed:
            raise EngineClosedError("the remote engine was closed; connect again")
        t0 = time.perf_counter()
        params = SamplingParams.from_kwargs(**sampling)
        prepared = self._prepare(messages, overflow or "error", params.max_tokens)
        job = RemoteJob(session, params, self.wait_timeout if timeout is None else timeout)
        job.t_submit = t0
        with self._cv:
            self._jobs.add(job)
        threading.Thread(target=self._run, args=(job, prepared), name="nbkv-remote",
                         daemon=True).start()
        return ChatStream(self, job)

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str,
                 max_tokens: int) -> Any:
        raise NotImplementedError

    def _serve(self, job: RemoteJob, prepared: Any) -> RequestRecord:
        """Run the request; return its final record, or raise (the record set on ``job``)."""
        raise NotImplementedError

    def _run(self, job: RemoteJob, prepared: Any) -> None:
        """The request's thread: serve it, then hand the record (or the error) to the stream."""
        error: BaseException | None = None
        try:
            self._serve(job, prepared)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's stream
            error = e
            log.debug("request %d failed: %s", job.id, e)
        finally:
            with self._cv:
                self._jobs.discard(job)
                self._cv.notify_all()
        if job.record is not None:
            self.events.publish(RequestFinished(job.record))
        job.out.put(("error", error) if error is not None else ("done", job.record))
        job.done.set()

    def _events(self, job: RemoteJob, path: str, body: dict[str, Any]
                 ) -> Iterator[dict[str, Any]]:
        """The answer's events until the request is cancelled; the stream is closed after.

        Raises what reading raised (a named server error, or ``KeyboardInterrupt``).
        """
        try:
            job.opening = Opening()
            if job.cancel.is_set():
                return
            try:
                job.stream = self.client.stream(path, body, job.opening)
            except ServerError:
                if job.cancel.is_set():  # closed while the server had not begun to answer
                    return
                raise
            try:
                for ev in job.stream:
                    if job.cancel.is_set():
                        return
                    yield ev
            except ServerError:
                if job.cancel.is_set():  # the cancel closed the stream under the reader
                    return
                raise
        finally:
            if job.stream is not None:
                job.stream.close()

    def wake(self) -> None:
        """Close the HTTP streams of cancelled requests (called by ``ChatStream.close``)."""
        with self._cv:
            jobs = list(self._jobs)
        for j in jobs:
            if j.cancel.is_set() and j.opening is not None and not j.opening.closed:
                j.opening.close()  # a request whose answer had not begun (a long prefill)
            if j.cancel.is_set() and j.stream is not None and not j.stream.closed:
                j.stream.close()

    def _delta(self, job: RemoteJob, text: str) -> None:
        if text:
            if not job.t_first:
                job.t_first = time.perf_counter()
            job.text += text
            job.out.put(("delta", text))

    def close(self) -> None:
        """Cancel requests in flight and close the connection (the server keeps running)."""
        with self._cv:
            if self.closed:
                return
            self.closed = True
            jobs = list(self._jobs)
        for j in jobs:
            j.cancel.set()
        self.wake()
        for j in jobs:
            j.done.wait(10.0)
        self.client.close()
        self.events.publish(SlotsChanged("closed"))

    def __enter__(self) -> RemoteBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def save(self, path: str | None = None, sessions: Any = None) -> Any:
        """Not for this kind of server: it keeps its cache to itself."""
        from nbkv.store.persist import unsupported

        raise unsupported(self, "save")  # no state API

    def restore(self, path: str | None = None, sessions: Any = None, *,
                trust: bool = False) -> Any:
        """Not for this kind of server: it keeps its cache to itself."""
        from nbkv.store.persist import unsupported

        raise unsupported(self, "restore")  # no state API


    def explain(self, request: int | None = None) -> admission.Explanation:
        """Why request ``request`` reused what it did (see :meth:`nbkv.Engine.explain`)."""
        raise InvalidRequestError(f"explain needs nbkv's own slot table: not available for a "
                                  f"{self.kind} engine")
