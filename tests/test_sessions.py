"""The in-kernel session store, on the real engine (the embedded SmolLM2-135M).

Turns run real requests (greedy, at most 8 tokens). Interrupts are injected around a real
:class:`~nbkv.ChatStream` exactly as the stream itself reacts to a ``KeyboardInterrupt``
while it waits (it cancels the request, then re-raises). One case cannot be produced on
demand by a real engine, a request interrupted before its first token, so it uses a scripted
stream whose public interface is checked against the real class.
"""

from __future__ import annotations

import inspect
import threading
import time

import pytest

import nbkv
from conftest import assert_consistent
from nbkv import Engine
from nbkv.core.errors import ContextOverflowError, SlotTimeoutError
from nbkv.core.events import RequestRecord, RequestStarted
from nbkv.core.streams import ChatStream
from nbkv.notebook.sessions import STORE, Reply, SessionStore

MAX = 8


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=1024) as e:
        yield e


class InterruptAt:
    """A real stream that gets a ``KeyboardInterrupt`` while waiting for delta ``at``.

    Does what :meth:`ChatStream.__next__` does then: cancel the request (``close``) and
    re-raise. Everything else is the real stream's.
    """

    def __init__(self, stream, at):
        self.stream, self.at, self.seen, self.interrupted = stream, at, [], False

    def __iter__(self):
        return self

    def __next__(self):
        if len(self.seen) == self.at:
            self.interrupted = True
            self.stream.close()
            raise KeyboardInterrupt
        d = next(self.stream)
        self.seen.append(d)
        return d

    def __getattr__(self, name):  # text, record, finish_reason, close, request_id
        return getattr(self.stream, name)


class Interrupting:
    """An engine whose streams are interrupted at delta ``at``."""

    def __init__(self, engine, at):
        self.engine, self.at, self.streams = engine, at, []

    def chat(self, *a, **kw):
        s = InterruptAt(self.engine.chat(*a, **kw), self.at)
        self.streams.append(s)
        return s


def test_turns_commit_user_and_reply_together(engine):
    s = SessionStore().get("alice")
    s.system = "Be brief."
    reply = s.chat("Hi", engine=engine, max_tokens=4, temperature=0)
    assert isinstance(reply, Reply) and type(reply.text) is str
    assert s.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": reply.text},
    ]
    rec = reply.record
    assert rec.session == "alice" and rec.finish_reason == reply.finish_reason
    # the sampling keywords reached the engine: the same request gives the same reply
    assert reply.text == engine.chat(s.messages[:2], max_tokens=4, temperature=0).text
    assert 1 <= rec.generated_tokens <= 4
    second = s.chat("How are you?", engine=engine, max_tokens=4, temperature=0)
    assert s.messages[3] == {"role": "user", "content": "How are you?"}
    assert s.messages[4] == {"role": "assistant", "content": second.text}
    # the whole conversation was sent, and continued in the session's cached slot
    assert second.record.prompt_tokens == len(engine.tokenize_prompt(s.messages[:4]))
    assert second.record.strategy == "hash-extend" and second.record.slot == rec.slot
    assert len(s.turns) == 2 and s.records == [rec, second.record]
    assert_consistent(engine)


def test_interrupt_inside_the_stream_keeps_the_partial_reply(engine):
    s = SessionStore().get("count")
    via = Interrupting(engine, at=2)
    turn = s.start(via, "Count from one to ten, separated by commas.", max_tokens=MAX,
                   temperature=0)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for d in turn:
            got.append(d)
    (stream,) = via.streams
    assert stream.interrupted and len(got) == 2
    # what was generated before the cancel is kept: at least the two deltas seen
    assert stream.text.startswith("".join(got)) and stream.text
    assert s.messages == [{"role": "user", "content": "Count from one to ten, separated by "
                                                      "commas."},
                          {"role": "assistant", "content": stream.text}]
    assert s.records == [stream.record] and stream.record.error is None
    assert stream.record.finish_reason in ("cancelled", "length", "stop")
    assert_consistent(engine)
    # the next turn continues the conversation from the slot
    nxt = s.chat("Go on.", engine=engine, max_tokens=4, temperature=0)
    assert nxt.record.strategy == "hash-extend" and len(s.messages) == 4


def test_interrupt_in_the_consumer_still_commits_and_closes_the_stream(engine):
    s = SessionStore().get("c")
    got = []
    with pytest.raises(KeyboardInterrupt):
        with s.start(engine, "Name three colours.", max_tokens=MAX, temperature=0) as turn:
            for d in turn:
                got.append(d)
                raise KeyboardInterrupt
    assert len(got) == 1
    assert turn.stream.record is not None  # closed: the request no longer runs
    assert turn.stream.text.startswith(got[0])
    assert s.messages[-1] == {"role": "assistant", "content": turn.stream.text}
    assert s.records == [turn.stream.record]
    assert_consistent(engine)


def test_a_refused_turn_leaves_history_unchanged(engine):
    s = SessionStore().get("f")
    s.system = "Be brief."
    before = list(s.messages)
    with pytest.raises(ContextOverflowError, match="does not fit the slot's context budget"):
        s.chat("word " * 3000, engine=engine, max_tokens=4)
    assert s.messages == before and s.records == []


def test_a_turn_failing_in_the_stream_leaves_history_unchanged(engine):
    """Both slots busy, the turn's request gives up waiting: the error arrives through the
    stream (``SlotTimeoutError``), after the turn started."""
    engine.clear()
    started, queued, submitted = [], threading.Event(), threading.Event()
    both_busy = threading.Event()

    def hold(ev):
        if isinstance(ev, RequestStarted) and ev.record.session in ("busy0", "busy1"):
            started.append(ev.record.session)
            if len(started) == 1:  # the first can't finish before the second is queued
                queued.wait(60)
            else:  # both slots now serve an 8-token reply, at most one token done
                both_busy.set()
                submitted.wait(60)
                time.sleep(0.2)  # past the turn's 0.05 s wait limit, slots still busy

    unsub = engine.subscribe(hold)
    s = SessionStore().get("late")
    try:
        busy = engine.chat_many([[{"role": "user", "content": f"Tell me about CPUs, {i}."}]
                                 for i in range(2)], ["busy0", "busy1"], stream=True,
                                max_tokens=MAX, temperature=0)
        queued.set()
        assert both_busy.wait(60)
        turn = s.start(engine, "Hello?", max_tokens=4, temperature=0, timeout=0.05)
        submitted.set()
        with pytest.raises(SlotTimeoutError, match="no slot became free"):
            for _ in turn:
                pass
    finally:
        queued.set()
        submitted.set()
        unsub()
    for b in busy:
        b.result()
    assert s.messages == [] and s.records == []
    assert all(b.finish_reason in ("stop", "length") for b in busy)
    assert_consistent(engine)


# -- the one scripted stream ----------------------------------------------------------------


class ScriptedStream:
    """A stream interrupted before its first delta: nothing generated, request cancelled."""

    def __init__(self):
        self.request_id = 0
        self.text = ""
        self.finish_reason = None
        self.record = None

    def __iter__(self):
        return self

    def __next__(self):
        self.close()  # as ChatStream does when interrupted while waiting
        raise KeyboardInterrupt

    def close(self):
        if self.record is None:
            self.record = RequestRecord(id=0, session="x", strategy="miss", slot=0,
                                        prompt_tokens=10, reused_tokens=0,
                                        prefilled_tokens=0, trimmed_tokens=0,
                                        finish_reason="cancelled")
            self.finish_reason = "cancelled"

    def result(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def public_interface(obj):
    names = {n for n in dir(obj) if not n.startswith("_")}
    names |= {n for n in ("__iter__", "__next__", "__enter__", "__exit__") if hasattr(obj, n)}
    return names


def test_the_scripted_stream_has_the_real_streams_interface(engine):
    real = engine.chat([{"role": "user", "content": "Hi"}], stream=True, max_tokens=2,
                       temperature=0)
    fake = ScriptedStream()
    assert public_interface(fake) == public_interface(real)
    for name in public_interface(ChatStream):
        if callable(getattr(ChatStream, name)):
            assert (inspect.signature(getattr(ScriptedStream, name)).parameters.keys()
                    == inspect.signature(getattr(ChatStream, name)).parameters.keys()), name
    # the part of the contract a turn relies on, for both: once closed, the stream has a
    # finish reason, and its record (None if the request was cancelled before it got a
    # slot) agrees with it
    for s in (real, fake):
        s.close()
        assert s.finish_reason is not None
        assert s.record is None or (isinstance(s.record, RequestRecord)
                                    and s.finish_reason == s.record.finish_reason)
        state = (s.text, s.finish_reason, s.record)
        s.close()  # closing again changes nothing
        assert (s.text, s.finish_reason, s.record) == state


def test_interrupted_before_the_first_token_leaves_history_unchanged():
    class Engine1:
        def chat(self, messages, session=None, stream=False, **kw):
            return ScriptedStream()

    s = SessionStore().get("early")
    s.messages += [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    turn = s.start(Engine1(), "again")
    with pytest.raises(KeyboardInterrupt):
        list(turn)
    assert turn.stream.finish_reason == "cancelled" and turn.stream.text == ""
    assert s.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert s.records == []


# -- no engine needed -----------------------------------------------------------------------


def test_system_prompt_edit_and_reset():
    s = SessionStore().get("x")
    assert s.system is None
    s.system = "one"
    s.messages += [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    s.system = "two"
    assert s.messages[0] == {"role": "system", "content": "two"} and len(s.messages) == 3
    s.reset()
    assert s.messages == [{"role": "system", "content": "two"}]
    s.reset("three")
    assert s.system == "three"
    s.system = None
    assert s.messages == []


def test_store_and_package_level_accessors():
    assert nbkv.session("pkg-test") is STORE.get("pkg-test")
    assert "pkg-test" in STORE
    STORE.drop("pkg-test")
    assert "pkg-test" not in STORE
    store = SessionStore()
    with pytest.raises(RuntimeError, match="%kvcache load"):
        store.get("n").chat("hi")
    assert nbkv.current_engine() is STORE.engine


def test_reply_is_a_str_with_its_record():
    r = Reply("hi", None, "stop")
    assert r.upper() == "HI" and r.text == "hi" and type(r.text) is str
    assert r.finish_reason == "stop"
