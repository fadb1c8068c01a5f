"""A request as every engine sees it, and what its caller holds while the reply is generated.

A :class:`Request` carries its :class:`SamplingParams`, output queue and record.
:class:`ChatStream` (threads) and :class:`AsyncChatStream` (asyncio) read what the engine's
scheduler thread puts in the request's queue: text deltas, then a result; closing one early
cancels the request. The deltas are a :class:`TextStream`'s: generated token bytes turned
into text, UTF-8 sequences and stop strings held until they are whole.
"""

from __future__ import annotations

import asyncio
import codecs
import itertools
import math
import numbers
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from nbkv.core.errors import InvalidRequestError
from nbkv.core.events import RequestRecord


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature=0`` is greedy (deterministic)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: random
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "stop":
                stop = (v,) if isinstance(v, str) else v
                if not isinstance(stop, (list, tuple)) or not all(
                        isinstance(x, str) for x in stop):
                    raise InvalidRequestError(
                        f"stop must be a string or a list of strings, not {v!r}")
                object.__setattr__(self, "stop", tuple(stop))
                continue
            want = float if f.type in ("float", float) else int
            ok = isinstance(v, numbers.Real if want is float else numbers.Integral)
            if not ok or isinstance(v, bool):
                raise InvalidRequestError(
                    f"{f.name} must be {'a number' if want is float else 'an integer'}, "
                    f"not {v!r}")
            if want is float and not math.isfinite(v):  # inf passes ">= 0"; nan fails all
                raise InvalidRequestError(f"{f.name} must be a finite number, not {v!r}")
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0 (1 disables it)"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequestError(msg)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> SamplingParams:
        """Build from keyword arguments, rejecting unknown names with a clear error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling argument(s) {unknown}; known: {sorted(names)}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


class Request:
    """What every engine's request has: its id, deadline, output queue and record.

    ``out`` carries ``("delta", text)``, then ``("done", record)`` or ``("error", exc)``.
    """

    _ids = itertools.count(1)

    def __init__(self, session: str | None, params: SamplingParams, timeout: float) -> None:
        self.id = next(self._ids)
        self.session = session
        self.params = params
        self.deadline = time.monotonic() + timeout
        self.out: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.record: RequestRecord | None = None
        self.t_submit = time.perf_counter()
        self.t_first = 0.0
        self.generated: list[int] = []


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


class TextStream:
    """Accumulates token pieces (bytes) and releases text that is safe to show.

    A multi-byte character split across tokens is held until complete. Text that could be
    the start of a stop string is held until it is clear that it is not one; when a stop
    string appears, the text before it is released and :attr:`stopped` becomes true.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""
        self.text = ""  # everything released so far
        self.stopped: str | None = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the newly releasable text (maybe empty)."""
        if self.stopped is not None:
            return ""
        if not self._stop:  # nothing to hold back but a split character (the decoder's)
            out = self._decoder.decode(piece)
            self.text += out
            return out
        self._held += self._decoder.decode(piece)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: release whatever is held (incomplete UTF-8 becomes U+FFFD)."""
        if self.stopped is None:
            self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        cut = len(held)
        for s in self._stop:
            i = held.find(s)
            if i != -1 and i < cut:
                cut = i
                self.stopped = s
        if self.stopped is not None:
            out, self._held = held[:cut], ""
        elif final:
            out, self._held = held, ""
        else:
            keep = 0  # longest tail of `held` that is a proper prefix of some stop string
            for s in self._stop:
                for n in range(min(len(s) - 1, len(held)), keep, -1):
                    if held.endswith(s[:n]):
                        keep = n
                        break
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += out
        return out
