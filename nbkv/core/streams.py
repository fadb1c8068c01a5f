"""What a caller holds while a reply is generated: a stream of text deltas, then a result.

:class:`ChatStream` (threads) and :class:`AsyncChatStream` (asyncio) read what the engine's
scheduler thread puts in the request's queue; closing one early cancels the request.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from nbkv.core.events import RequestRecord
from nbkv.core.requests import Request


class Waker(Protocol):
    """What a stream needs of its engine: a nudge when it cancels its request."""

    def wake(self) -> None:
        """Let the engine look at its requests now."""


@dataclass(frozen=True)
class ChatResult:
    """A finished reply: its text, why it ended, and the request's record."""

    text: str
    finish_reason: str
    record: RequestRecord

    def __str__(self) -> str:
        return self.text

    @property
    def message(self) -> dict[str, str]:
        """The reply as a message to append to the conversation."""
        return {"role": "assistant", "content": self.text}


class ChatStream:
    """Iterator over the text deltas of a reply as they are generated.

    After it is exhausted, :attr:`text`, :attr:`finish_reason` and :attr:`record` are set.
    Closing it early (``close()``, ``break`` with ``with``, garbage collection, or a
    ``KeyboardInterrupt`` while waiting) cancels the request; the slot keeps what was
    decoded and stays consistent.

    Safe to close from another thread than the one reading it (a watchdog timer, a worker of
    ``chat_many``): one lock makes taking an item from the request's queue and adding it to
    :attr:`text` one step, so the reader and ``close()`` never lose an item between them,
    and a reader waiting for the next delta ends with the partial text and the record (or
    the request's named error) as soon as the stream is closed.
    """

    def __init__(self, engine: Waker, job: Request) -> None:
        self._engine = engine
        self._job = job
        self.request_id = job.id  # the ``id`` of this request's events and record
        self.text = ""
        self.finish_reason: str | None = None
        self.record: RequestRecord | None = None
        self._error: BaseException | None = None  # how the request failed, if it did
        self._lock = threading.Lock()  # one consumer of the queue at a time
        self._raised = False  # the error was raised to a reader once

    def __iter__(self) -> Iterator[str]:
        return self

    def _take(self, timeout: float | None) -> str | None:
        """One item from the queue, applied (lock held); the delta's text, else None.

        ``timeout=None``: do not wait. Sets :attr:`record` (and the error) on the final
        item.
        """
        try:
            if timeout is None:
                kind, value = self._job.out.get_nowait()
            else:
                kind, value = self._job.out.get(timeout=timeout)
        except queue.Empty:
            if self.record is None and self._job.done.is_set() and self._job.out.empty():
                # the engine let the request go without a final item: end with its record
                self._finish(self._job.record, None)
            return None
        if kind == "delta":
            delta: str = value
            self.text += delta
            return delta
        if kind == "error":
            self._finish(self._job.record, value)
        else:
            self._finish(value, None)
        return None

    def _finish(self, record: RequestRecord | None, error: BaseException | None) -> None:
        if self.record is not None or self._error is not None:
            return
        self._error = error
        self.record = record
        if record is not None:
            self.finish_reason = record.finish_reason
        elif error is not None:
            self.finish_reason = "error"
        else:
            self.finish_reason = "cancelled"

    def _ended(self) -> bool:
        return self.record is not None or self._error is not None

    def __next__(self) -> str:
        try:
            while True:  # a timed wait stays responsive to KeyboardInterrupt and to close()
                with self._lock:
                    if self._ended():
                        break
                    delta = self._take(0.1)
                if delta is not None:
                    return delta
        except BaseException:
            self.close()
            raise
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error
        raise StopIteration

    def close(self) -> None:
        """Cancel the request if still running and wait until the engine let it go.

        Keeps the text generated before the cancel; a reader in another thread then ends.
        """
        if self._ended():
            return
        self._job.cancel.set()
        self._engine.wake()
        while not self._job.done.wait(0.05):
            pass
        with self._lock:  # a reader's wait ends within its 0.1 s timeout
            while not self._ended():
                self._take(None)

    def result(self) -> ChatResult:
        """Consume the rest of the stream and return the whole reply."""
        for _ in self:
            pass
        if self.record is None:
            raise self._error if self._error is not None else RuntimeError(
                "the request ended without a record")
        return ChatResult(self.text, self.record.finish_reason, self.record)

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self.record is None and not self._job.done.is_set():
                self._job.cancel.set()
                self._engine.wake()
        except Exception:
            pass


class AsyncChatStream:
    """Async iterator over a reply's text deltas (from :meth:`Engine.achat` with ``stream=True``).

    A pump thread moves deltas from the engine into the event loop, so any number of
    streams can be awaited at once. Cancelling the awaiting task cancels the request.
    """

    def __init__(self, stream: ChatStream, loop: asyncio.AbstractEventLoop) -> None:
        self.stream = stream
        self._q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._loop = loop
        threading.Thread(target=self._pump, name="nbkv-astream", daemon=True).start()

    def _pump(self) -> None:
        try:
            for delta in self.stream:
                self._loop.call_soon_threadsafe(self._q.put_nowait, ("delta", delta))
            item: tuple[str, Any] = ("done", None)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            item = ("error", e)
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)
        except RuntimeError:  # the loop is gone; nobody is listening
            pass

    def __aiter__(self) -> AsyncChatStream:
        return self

    async def __anext__(self) -> str:
        try:
            kind, value = await self._q.get()
        except asyncio.CancelledError:
            self.stream._job.cancel.set()
            self.stream._engine.wake()
            raise
        if kind == "delta":
            delta: str = value
            return delta
        if kind == "error":
            raise value
        raise StopAsyncIteration

    @property
    def text(self) -> str:
        """Text received so far."""
        return self.stream.text

    @property
    def record(self) -> RequestRecord | None:
        """The request's record, once finished."""
        return self.stream.record

    async def result(self) -> ChatResult:
        """Await the whole reply."""
        async for _ in self:
            pass
        assert self.stream.record is not None
        return ChatResult(self.stream.text, self.stream.record.finish_reason, self.stream.record)
