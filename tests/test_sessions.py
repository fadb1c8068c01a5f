"""The in-kernel session store, with a scripted engine (no model)."""

from __future__ import annotations

import pytest

import nbkv
from nbkv.events import RequestRecord
from nbkv.sessions import STORE, Reply, SessionStore


class FakeStream:
    """Yields scripted deltas; ``interrupt_at`` raises KeyboardInterrupt before that delta."""

    def __init__(self, deltas, interrupt_at=None, error=None):
        self.deltas = list(deltas)
        self.interrupt_at = interrupt_at
        self.error = error
        self.text = ""
        self.record = None
        self.finish_reason = None
        self.closed = False
        self._i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.record is not None:
            raise StopIteration
        if self._i == self.interrupt_at:
            self.close()
            raise KeyboardInterrupt
        if self._i >= len(self.deltas):
            if self.error is not None:
                self._end("error", self.error)
                raise RuntimeError(self.error)
            self._end("stop")
            raise StopIteration
        d = self.deltas[self._i]
        self._i += 1
        self.text += d
        return d

    def _end(self, reason, error=None):
        self.finish_reason = reason
        self.record = RequestRecord(id=1, session="s", strategy="miss", slot=0, prompt_tokens=10,
                                    reused_tokens=0, prefilled_tokens=10, trimmed_tokens=0,
                                    finish_reason=reason, error=error)

    def close(self):
        self.closed = True
        if self.record is None:
            self._end("cancelled")


class FakeEngine:
    def __init__(self, *streams):
        self.streams = list(streams)
        self.calls = []

    def chat(self, messages, session=None, stream=False, **kw):
        self.calls.append((list(messages), session, kw))
        return self.streams.pop(0)


def test_turns_commit_user_and_reply_together():
    store = SessionStore()
    s = store.get("alice")
    s.system = "Be brief."
    eng = FakeEngine(FakeStream(["Hel", "lo"]), FakeStream(["Fine."]))
    reply = s.chat("Hi", engine=eng, max_tokens=4)
    assert isinstance(reply, Reply) and reply == "Hello" and reply.record.finish_reason == "stop"
    assert s.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    s.chat("How are you?", engine=eng)
    assert eng.calls[1][0][-1] == {"role": "user", "content": "How are you?"}
    assert len(eng.calls[1][0]) == 4 and eng.calls[1][1] == "alice"
    assert eng.calls[0][2] == {"max_tokens": 4}
    assert s.turns == 2 and len(s.records) == 2


def test_interrupted_turn_keeps_partial_reply_only_if_any():
    store = SessionStore()
    s = store.get()
    assert s.name == "default"
    turn = s.start(FakeEngine(FakeStream(["a", "b", "c"], interrupt_at=2)), "go")
    got = []
    with pytest.raises(KeyboardInterrupt):
        for d in turn:
            got.append(d)
    assert got == ["a", "b"]
    assert s.messages[-1] == {"role": "assistant", "content": "ab"}
    assert s.records[-1].finish_reason == "cancelled"
    # interrupted before the first token: history unchanged
    turn = s.start(FakeEngine(FakeStream(["x"], interrupt_at=0)), "again")
    with pytest.raises(KeyboardInterrupt):
        list(turn)
    assert len(s.messages) == 2


def test_interrupt_in_the_consumer_still_commits_and_closes_the_stream():
    s = SessionStore().get("c")
    stream = FakeStream(["a", "b", "c"])
    with pytest.raises(KeyboardInterrupt):
        with s.start(FakeEngine(stream), "go") as turn:
            for _ in turn:
                raise KeyboardInterrupt
    assert stream.closed and s.messages[-1]["content"] == "a"


def test_failed_turn_leaves_history_unchanged():
    s = SessionStore().get("f")
    with pytest.raises(RuntimeError):
        s.chat("go", engine=FakeEngine(FakeStream(["a"], error="boom")))
    assert s.messages == []


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
