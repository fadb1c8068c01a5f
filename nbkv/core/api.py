"""What every engine offers on top of its own ``chat``: many at once, asyncio, events, totals.

:class:`ChatAPI` is shared by the in-kernel :class:`~nbkv.Engine` and the remote
engines (:mod:`nbkv.remote.connect`); a subclass provides ``chat(messages, session, stream=...)``
returning a :class:`~nbkv.core.streams.ChatStream` when streaming, and an ``events`` bus.

Checks at the door (:func:`whole`, :func:`seconds`, :func:`session_name`, ...): arguments of
the wrong type or range raise :class:`~nbkv.core.errors.InvalidRequestError` saying what was
expected and what was given, before anything is loaded, queued or sent. ``True`` is not a
number here, though Python lets it stand for 1.
"""

from __future__ import annotations

import asyncio
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from nbkv.core.errors import InvalidRequestError
from nbkv.core.events import FIRST, MISS, EventBus, RequestRecord, Subscriber
from nbkv.core.streams import AsyncChatStream, ChatResult, ChatStream


class ChatAPI:
    """``chat_many``, ``achat``, ``subscribe``, ``history`` and request totals, from ``chat``."""

    events: EventBus

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: Literal[False] = False, overflow: str | None = None,
             timeout: float | None = None, **sampling: Any) -> ChatResult: ...

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: Literal[True], overflow: str | None = None,
             timeout: float | None = None, **sampling: Any) -> ChatStream: ...

    def chat(self, messages: Sequence[Mapping[str, Any]], session: str | None = None, *,
             stream: bool = False, overflow: str | None = None, timeout: float | None = None,
             **sampling: Any) -> ChatResult | ChatStream:
        """Reply to ``messages`` (the whole conversation so far, ending with the user's turn).

        ``session`` names the conversation for slot ownership and the event records.
        Sampling keywords: ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``min_p``,
        ``repeat_penalty``, ``repeat_last_n``, ``seed``, ``max_tokens``, ``stop``.
        With ``stream=True`` returns a :class:`ChatStream` of text deltas, else a
        :class:`ChatResult`. ``overflow`` overrides the engine's policy for this prompt,
        ``timeout`` its wait for a slot. ``replay=True`` (engines whose ``replays`` is
        true): if this prompt was answered before with the same deterministic settings and
        the slot still holds that reply, give it again from the cache, decoding nothing
        (:mod:`nbkv.engine.decoder`; exact engines only).
        """
        self._check_request(session, timeout)
        s = self._submit(messages, session, overflow, timeout, **sampling)
        return s if stream else s.result()

    def _submit(self, messages: Sequence[Mapping[str, Any]], session: str | None,
                overflow: str | None, timeout: float | None, **sampling: Any) -> ChatStream:
        """Queue one checked request (each engine's own): its stream."""
        raise NotImplementedError

    @staticmethod
    def _check_request(session: Any, timeout: Any) -> None:
        """Refuse a ``session`` that is not a name, a ``timeout`` that is not seconds > 0.

        Every engine's ``chat`` starts here, before anything is queued or sent.
        """
        session_name(session)
        seconds("timeout", timeout, optional=True)

    def chat_many(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        sessions: Sequence[str | None] | None = None,
        *,
        stream: bool = False,
        **sampling: Any,
    ) -> list[ChatResult] | list[ChatStream]:
        """Reply to several conversations at once (their work overlaps).

        Returns results in order, or with ``stream=True`` one :class:`ChatStream` per
        conversation (each may be consumed from its own thread).
        """
        sessions = list(sessions) if sessions is not None else [None] * len(conversations)
        if len(sessions) != len(conversations):
            raise InvalidRequestError("sessions must have one entry per conversation")
        for sess in sessions:  # all of them before any request is sent
            self._check_request(sess, sampling.get("timeout"))
        streams: list[ChatStream] = []
        try:
            for conv, sess in zip(conversations, sessions):
                streams.append(self.chat(conv, sess, stream=True, **sampling))
            if stream:
                return streams
            return [s.result() for s in streams]
        except BaseException:
            for s in streams:
                s.close()
            raise

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        session: str | None = None,
        *,
        stream: bool = False,
        **sampling: Any,
    ) -> ChatResult | AsyncChatStream:
        """:meth:`chat` for asyncio: await a :class:`ChatResult`, or ``async for`` the deltas.

        Many ``achat`` calls in flight at once are served together, like :meth:`chat_many`.
        """
        loop = asyncio.get_running_loop()
        s = self.chat(messages, session, stream=True, **sampling)
        astream = AsyncChatStream(s, loop)
        return astream if stream else await astream.result()

    def carry_over(self, sessions: Iterable[str]) -> None:
        """Sessions another engine cached before this one replaced it (``%kvcache load``).

        Their next request here says the engine was reloaded, not that the conversation is
        new. Engines that keep no slot table ignore it.
        """
        table = getattr(self, "table", None)
        if table is not None:
            table.carry_over(sessions)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Receive every event (see :mod:`nbkv.core.events`); returns an unsubscribe function."""
        return self.events.subscribe(callback)

    @property
    def history(self) -> list[RequestRecord]:
        """Records of the most recent requests, oldest first."""
        return list(self.events.history)


class TemplatedAPI:
    """``render`` and ``tokenize_prompt``, for engines that render the template themselves.

    A subclass has a ``template`` (:class:`~nbkv.prompt.templates.ChatTemplate`) and a
    ``_prepare(messages, overflow, max_tokens)`` returning a :class:`~nbkv.prompt.builder.Prompt`.
    """

    template: Any

    def _prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str,
                 max_tokens: int) -> Any:
        raise NotImplementedError

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
               ) -> str:
        """The prompt text the template makes of ``messages``."""
        from nbkv.core.messages import normalize

        return str(self.template.render(normalize(messages), add_generation_prompt))

    def tokenize_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The exact prompt tokens a request with ``messages`` feeds the model."""
        return list(self._prepare(messages, "error", 1).tokens)


def request_totals(history: Sequence[RequestRecord]) -> dict[str, Any]:
    """Totals over records: requests by strategy and event, tokens, restores of parked ones.

    ``events`` counts requests by reason code (:mod:`nbkv.core.events`), most frequent first.
    """
    prompt = sum(r.prompt_tokens for r in history)
    reused = sum(r.reused_tokens for r in history)
    by: dict[str, int] = {}
    events: dict[str, int] = {}
    for r in history:
        by[r.strategy] = by.get(r.strategy, 0) + 1
        events[r.reason or FIRST] = events.get(r.reason or FIRST, 0) + 1
    ttfts = [r.ttft_s for r in history if r.ttft_s > 0]
    return {
        "requests": len(history),
        "strategies": by,
        "events": dict(sorted(events.items(), key=lambda kv: -kv[1])),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "prefilled_tokens": sum(r.prefilled_tokens for r in history),
        "generated_tokens": sum(r.generated_tokens for r in history),
        "salvage_pct": 100.0 * reused / prompt if prompt else 0.0,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "restored_requests": sum(1 for r in history if r.restored_from),
        "restored_tokens": sum(r.restored_tokens for r in history),
    }


def thrashing(history: Sequence[RequestRecord], n_slots: int, window: int = 24
              ) -> dict[str, Any]:
    """Detect cache thrashing: sessions that keep coming back to find their slot evicted.

    Looks at the last ``window`` requests: a *returning miss* is a request of a session whose
    conversation an earlier request evicted, and that then had to rebuild (strategy ``miss``).
    """
    recent = list(history)[-window:]
    evicted: set[str] = set()
    returning = 0
    for r in recent:
        if r.session is not None and r.session in evicted and r.strategy == MISS:
            returning += 1
        if r.session is not None:
            evicted.discard(r.session)
        if r.evicted_session is not None:
            evicted.add(r.evicted_session)
    active = len({r.session for r in recent if r.session is not None})
    flagged = returning >= 3 and returning >= 0.25 * len(recent)
    return {
        "returning_misses": returning,
        "active_sessions": active,
        "thrashing": flagged,
        "advice": (
            f"cache thrashing: {active} sessions take turns on {n_slots} slots, so each "
            f"returning session finds its conversation evicted and rebuilds it from scratch; "
            f"load the engine with at least {active} slots"
        ) if flagged else "",
    }


def whole(name: str, value: Any, least: int, optional: bool = False, hint: str = "") -> Any:
    """``value`` if it is an integer ``>= least`` (or None when ``optional``), else an error."""
    if value is None and optional:
        return value
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < least):
        none = " or None" if optional else ""
        raise InvalidRequestError(f"{name} must be an integer >= {least}{none}, not {value!r}"
                                  + (f" ({hint})" if hint else ""))
    return value


def seconds(name: str, value: Any, optional: bool = False) -> Any:
    """``value`` if it is a number of seconds ``> 0`` (or None when ``optional``), else an error."""
    if value is None and optional:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        none = " or None" if optional else ""
        raise InvalidRequestError(f"{name} must be a number of seconds > 0{none}, not "
                                  f"{value!r}")
    return value


def session_name(value: Any) -> Any:
    """``value`` if it names a session (a non-empty str) or is None, else an error.

    A name must be text that can be written (UTF-8): a lone surrogate (what a file name
    undecodable in the locale, or an escape such as ``U+DCFF`` leaves) is refused.
    """
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidRequestError(f"session must be a non-empty str or None, not {value!r}")
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"session must be valid text: {value!r} holds a lone surrogate "
                f"({value[e.start:e.end]!r} at {e.start})") from None
    return value


def path(name: str, value: Any, optional: bool = True) -> Any:
    """``value`` if it is a non-empty path (``str`` or ``os.PathLike``), or None when optional.

    ``""`` is refused: it would quietly mean the current directory.
    """
    if value is None and optional:
        return value
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes) \
            or not os.fspath(value):
        none = ", or None" if optional else ""
        raise InvalidRequestError(f"{name} must be a non-empty path (str or os.PathLike)"
                                  f"{none}, not {value!r}")
    return value


def directory(name: str, value: Any, optional: bool = True) -> Any:
    """``value`` if it names a directory that exists or can be made and written, else an error.

    Refused: a path that is a file, one under a file, one whose nearest existing directory
    this process may not write.
    """
    if path(name, value, optional) is None:
        return value
    target = Path(value).expanduser()
    try:
        probe = target
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
        if not probe.is_dir():
            where = "is a file" if probe == target else f"lies under the file {probe}"
            raise InvalidRequestError(f"{name} {str(value)!r} {where}: give a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            what = "is" if probe == target else f"would be made in {probe}, which is"
            raise InvalidRequestError(f"{name} {str(value)!r} {what} not writable")
    except OSError as e:
        raise InvalidRequestError(f"{name} {str(value)!r} cannot be used: {e}") from e
    return value


def token(name: str, value: Any, n_vocab: int) -> int:
    """``value`` if it is a token id of a vocabulary of ``n_vocab`` tokens, else an error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not 0 <= int(value) < n_vocab:
        raise InvalidRequestError(f"{name} must be a token id in 0..{n_vocab - 1}, not "
                                  f"{value!r}")
    return int(value)
