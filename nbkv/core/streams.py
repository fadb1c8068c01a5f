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
    """

    def __init__(self, engine: Waker, job: Request) -> None:
        self._engine = engine
        self._job = job
        self.request_id = job.id  # the ``id`` of this request's events and record
        self.text = ""
        self.finish_reason: str | None = None
        self.record: RequestRecord | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.record is not None:
            raise StopIteration
        try:
            while True:  # a timed wait stays responsive to KeyboardInterrupt
                try:
                    kind, value = self._job.out.get(timeout=0.1)
                    break
                except queue.Empty:
                    continue
        except BaseException:
            self.close()
            raise
        if kind == "delta":
            self.text += value
            return value
        if kind == "error":
            self.record = self._job.record
            raise value
        self.record = value
        self.finish_reason = value.finish_reason
        raise StopIteration

    def close(self) -> None:
        """Cancel the request if still running and wait until the scheduler let it go."""
        if self.record is not None:
            return
        self._job.cancel.set()
        self._engine.wake()
        while not self._job.done.wait(0.05):
            pass
        self.record = self._job.record
        self.finish_reason = self.record.finish_reason if self.record else "cancelled"
        while True:  # keep the text that was generated before the cancel
            try:
                kind, value = self._job.out.get_nowait()
            except queue.Empty:
                break
            if kind == "delta":
                self.text += value

    def result(self) -> ChatResult:
        """Consume the rest of the stream and return the whole reply."""
        for _ in self:
            pass
        assert self.record is not None
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
        self._q: asyncio.Queue = asyncio.Queue()
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
            return value
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
