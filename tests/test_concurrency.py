"""Concurrent sessions on the real model: batched decoding, threads, asyncio, stress."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

from conftest import SYSTEM, assert_consistent, fresh_probe
from nbkv import Engine
from nbkv.core.errors import SlotTimeoutError
from nbkv.core.events import Progress, RequestFinished, RequestStarted
from nbkv.core.streams import ChatStream

MAX = 10


def conv(i, turns=1):
    msgs = [{"role": "system", "content": f"You are agent number {i}. " + SYSTEM}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Agent {i}, step {t}: name one thing about CPUs."})
    return msgs


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=4, n_ctx=1024) as e:
        yield e


def sequential(engine, convs):
    out = []
    for i, c in enumerate(convs):
        out.append(engine.chat(c, session=f"s{i}", max_tokens=MAX, temperature=0).text)
    return out


def test_batched_replies_equal_one_at_a_time(engine):
    convs = [conv(i) for i in range(4)]
    engine.clear()
    alone = sequential(engine, convs)
    engine.clear()
    starts = []
    unsub = engine.subscribe(lambda ev: isinstance(ev, RequestStarted) and starts.append(ev))
    together = [r.text for r in engine.chat_many(convs, [f"s{i}" for i in range(4)],
                                                  max_tokens=MAX, temperature=0)]
    unsub()
    assert together == alone
    assert len({ev.record.slot for ev in starts}) == 4  # four slots busy at once
    assert_consistent(engine)
    # second turn, all four extend their own cached conversation concurrently
    follow = [c + [{"role": "assistant", "content": t}, {"role": "user", "content": "Why?"}]
              for c, t in zip(convs, together)]
    res = engine.chat_many(follow, [f"s{i}" for i in range(4)], max_tokens=MAX, temperature=0)
    assert all(r.record.strategy == "hash-extend" for r in res)
    engine.clear()
    assert [r.text for r in res] == sequential(engine, follow)


def test_threads_and_asyncio(engine):
    convs = [conv(i + 10) for i in range(4)]
    engine.clear()
    alone = sequential(engine, convs)
    engine.clear()
    results = [None] * 4

    def worker(i):
        results[i] = engine.chat(convs[i], session=f"s{i}", max_tokens=MAX, temperature=0).text

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == alone

    async def main():
        engine.clear()
        coros = [engine.achat(c, f"s{i}", max_tokens=MAX, temperature=0)
                 for i, c in enumerate(convs)]
        done = await asyncio.gather(*coros)
        stream = await engine.achat(convs[0], "s0", stream=True, max_tokens=MAX, temperature=0)
        parts = [d async for d in stream]
        return [r.text for r in done], "".join(parts)

    texts, streamed = asyncio.run(main())
    assert texts == alone and streamed == alone[0]


def test_more_sessions_than_slots_never_evicts_a_busy_slot(model_path):
    with Engine(model_path, n_slots=2, n_ctx=1024) as e:
        order = []
        e.subscribe(lambda ev: order.append(ev))
        res = e.chat_many([conv(i) for i in range(3)], ["a", "b", "c"], max_tokens=MAX,
                          temperature=0)
        third = next(r for r in res if r.record.evicted_session is not None)
        victim = third.record.evicted_session
        finished_at = next(i for i, ev in enumerate(order) if isinstance(ev, RequestFinished)
                           and ev.record.session == victim)
        started_at = next(i for i, ev in enumerate(order) if isinstance(ev, RequestStarted)
                          and ev.record.id == third.record.id)
        assert finished_at < started_at  # waited for the victim to finish, never cut it off
        assert_consistent(e)


def test_waiting_for_a_slot_times_out_clearly(model_path):
    with Engine(model_path, n_slots=1, n_ctx=512) as e:
        waiting = {}

        def on_event(ev):
            if isinstance(ev, RequestStarted) and not waiting:
                # the only slot is now busy: a second request can only wait
                waiting["s"] = e.chat(conv(2), session="late", stream=True, timeout=0.1,
                                      max_tokens=2)
                time.sleep(0.5)  # hold the scheduler past the second request's deadline

        e.subscribe(on_event)
        e.chat(conv(1), session="first", max_tokens=2)
        with pytest.raises(SlotTimeoutError, match="no slot became free"):
            waiting["s"].result()
        assert_consistent(e)
        assert e.chat(conv(3), max_tokens=2).finish_reason in ("stop", "length")


def test_thrashing_is_detected(model_path):
    with Engine(model_path, n_slots=2, n_ctx=512, park_ram=0) as e:  # no parking: thrash
        hist = {n: conv(i) for i, n in enumerate("abc")}
        for _ in range(3):
            for n, msgs in hist.items():
                r = e.chat(msgs, session=n, max_tokens=2, temperature=0)
                msgs.extend([r.message, {"role": "user", "content": "More."}])
        stats = e.stats()
        assert stats["thrashing"] and stats["active_sessions"] == 3
        assert "at least 3 slots" in stats["advice"]


@pytest.mark.slow
def test_stress_threads_random_cancels(model_path):
    """8 threads x 20 requests over 4 slots, random sessions, random cancels mid-stream."""
    with Engine(model_path, n_slots=4, n_ctx=1024) as e:
        rng = random.Random(1234)
        plans = [[(rng.randrange(6), rng.random() < 0.3, rng.randrange(1, 5)) for _ in range(20)]
                 for _ in range(8)]
        errors, histories, lock = [], {s: conv(s) for s in range(6)}, threading.Lock()

        def worker(plan):
            try:
                for sess, cancel, after in plan:
                    with lock:
                        msgs = [dict(m) for m in histories[sess]]
                    stream = e.chat(msgs, session=f"s{sess}", stream=True, max_tokens=6,
                                    temperature=0)
                    with stream:
                        for k, _ in enumerate(stream):
                            if cancel and k + 1 >= after:
                                break
                    with lock:
                        histories[sess] = msgs + [
                            {"role": "assistant", "content": stream.text},
                            {"role": "user", "content": f"Continue {len(msgs)}."}]
            except Exception as ex:  # noqa: BLE001
                errors.append(ex)

        threads = [threading.Thread(target=worker, args=(p,)) for p in plans]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 900
        for t in threads:
            t.join(timeout=max(deadline - time.monotonic(), 1))
        assert not any(t.is_alive() for t in threads), "deadlock: workers still running"
        assert not errors, errors
        assert_consistent(e)
        assert sum(1 for r in e.history if r.finish_reason == "cancelled") > 0
        # every slot's KV really holds its recorded tokens: probe logits against a fresh decode
        for s in e.slots():
            if not s.empty:
                cached = np.array(e.probe(s.index, 13))
                assert np.array_equal(fresh_probe(e.model, s.tokens, 13), cached), s.index


def test_probe_matches_a_fresh_decode(engine):
    engine.clear()
    engine.chat(conv(5, turns=2), session="p", max_tokens=MAX, temperature=0)
    s = next(s for s in engine.slots() if s.session == "p")
    cached = np.array(engine.probe(s.index, 42))
    assert np.array_equal(cached, fresh_probe(engine.model, s.tokens, 42))
    assert_consistent(engine)


def test_a_short_turn_does_not_wait_behind_a_long_prefill(engine):
    """Shortest remaining prompt first: a chat turn arriving while a long document is being
    prefilled gets its first token before the document's prefill ends.

    Told by the order of the engine's events, not by clocks: the scheduler is held after the
    document's first chunk until the short turn is queued; from then on the document still
    has several chunks to prefill, and the short turn's first token (``max_tokens=1``: its
    ``RequestFinished``) must come before the document's remaining chunks and its own first
    token.
    """
    engine.clear()
    doc = " ".join(f"Line {i}: the cache keeps what the model has already read." for i in range(60))
    long_msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": doc}]
    assert len(engine.tokenize_prompt(long_msgs)) > 3 * engine.ctx.n_batch
    events, ids = [], {}
    held, queued = threading.Event(), threading.Event()

    def on_event(ev):
        events.append(ev)
        if isinstance(ev, RequestStarted):
            ids[ev.record.session] = ev.record.id
        elif (isinstance(ev, Progress) and ev.request_id == ids.get("doc")
              and not held.is_set()):
            held.set()  # the document's first chunk is decoded: hold the scheduler here
            queued.wait(60)

    unsub = engine.subscribe(on_event)
    try:
        stream = engine.chat(long_msgs, session="doc", stream=True, max_tokens=1,
                             temperature=0)
        assert held.wait(60), "the document's prefill reported no progress"
        short = engine.chat(conv(7), session="short", stream=True, max_tokens=1,
                            temperature=0)
        queued.set()
        short_reply, long_reply = short.result(), stream.result()
    finally:
        queued.set()
        unsub()

    def finished(session):
        return next(i for i, ev in enumerate(events)
                    if isinstance(ev, RequestFinished) and ev.record.session == session)

    chunks_after = [ev for ev in events[finished("short"):]
                    if isinstance(ev, Progress) and ev.request_id == ids["doc"]]
    assert finished("short") < finished("doc")
    assert len(chunks_after) >= 1  # the document was still being prefilled
    assert short_reply.record.generated_tokens == long_reply.record.generated_tokens == 1
    assert long_reply.record.prefilled_tokens > 3 * engine.ctx.n_batch
    assert_consistent(engine)


def test_chat_many_streams_from_threads_equal_sequential_replies(engine):
    convs = [conv(i + 20) for i in range(3)]
    sessions = [f"m{i}" for i in range(3)]
    engine.clear()
    alone = sequential(engine, convs)
    engine.clear()
    together = [r.text for r in engine.chat_many(convs, sessions, max_tokens=MAX,
                                                  temperature=0)]
    engine.clear()
    streams = engine.chat_many(convs, sessions, stream=True, max_tokens=MAX, temperature=0)
    assert [type(s) for s in streams] == [ChatStream] * 3
    deltas = [[] for _ in streams]
    readers = [threading.Thread(target=deltas[i].extend, args=(s,))
               for i, s in enumerate(streams)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in readers)
    streamed = ["".join(d) for d in deltas]
    assert streamed == [s.text for s in streams]
    assert streamed == together == alone
    assert all(s.finish_reason in ("stop", "length") for s in streams)
    assert [s.record.session for s in streams] == sessions
    assert len({s.record.slot for s in streams}) == 3  # each conversation in its own slot
    assert_consistent(engine)
