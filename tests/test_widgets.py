"""Widgets at the model level: traits, figure data and comm messages follow engine events."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import comm
import pytest

from nbkv.engine import SlotInfo
from nbkv.events import (
    EventBus,
    Progress,
    RequestFinished,
    RequestRecord,
    RequestStarted,
    Segment,
    SlotsChanged,
)
from nbkv.media_units import MediaKey, MediaUnit
from nbkv.palette import COLORS
from nbkv.widgets import CacheDashboard, Conversations, Feed, KVMap, SlotCards, Timeline


class RecordingComm:
    """Stands in for a kernel comm and records what the widgets send."""

    def __init__(self, sent, **kw):
        self.comm_id = kw.get("comm_id") or f"c{len(sent)}-{id(self)}"
        self.kernel = "fake"
        self.sent = sent

    def open(self, *a, **kw):
        pass

    def on_msg(self, *a, **kw):
        pass

    def on_close(self, *a, **kw):
        pass

    def send(self, data=None, metadata=None, buffers=None):
        self.sent.append((threading.current_thread().name, data))

    def close(self, *a, **kw):
        pass


@pytest.fixture
def sent(monkeypatch):
    log = []
    monkeypatch.setattr(comm, "create_comm", lambda **kw: RecordingComm(log, **kw))
    return log


class FakeEngine:
    n_slots, n_ctx, cache, cache_min_tokens = 2, 512, "imc", 100
    model = SimpleNamespace(description="fake 1M", name="Fake 1M (1M parameters, F16)")

    def __init__(self):
        self.bus = EventBus()
        self._slots = [SlotInfo(i, i, self.n_ctx, None, (), (), (), 0, False) for i in range(2)]
        self.fail = False

    def subscribe(self, cb):
        return self.bus.subscribe(cb)

    def publish(self, event):
        self.bus.publish(event)

    def slots(self):
        if self.fail:
            raise RuntimeError("snapshot broke")
        return tuple(self._slots)

    @property
    def history(self):
        return list(self.bus.history)

    def stats(self):
        h = self.history
        p = sum(r.prompt_tokens for r in h)
        return {"requests": len(h),
                "salvage_pct": 100 * sum(r.reused_tokens for r in h) / p if p else 0.0}

    def set_slot(self, i, **kw):
        self._slots[i] = replace(self._slots[i], **kw)


SEGS = (
    Segment(0, 40, 0, "system", "reused", "Be brief."),
    Segment(40, 60, 1, "user", "reused", "What is a CPU?"),
    Segment(60, 80, 2, "assistant", "reused", "A processor."),
    Segment(80, 100, 3, "user", "prefilled", "And memory?"),
    Segment(100, 104, 4, "assistant", "prefilled", "(generation prompt)"),
)


def record(id=1, **kw):
    base = dict(id=id, session="alice", strategy="hash-extend", slot=0, prompt_tokens=104,
                reused_tokens=80, prefilled_tokens=24, trimmed_tokens=6, capacity=512,
                segments=SEGS, reason="continued")
    base.update(kw)
    return RequestRecord(**base)


def bars(trace):
    return sorted(zip(trace.y, trace.base, [b + x for b, x in zip(trace.base, trace.x)]))


def test_slot_cards_follow_a_request(sent):
    eng = FakeEngine()
    cards = SlotCards(eng, Feed(eng, live=False))
    assert "free" in cards.cards[0].value and "0/512 tokens" in cards.cards[0].value
    eng.set_slot(0, session="alice", pending=True, tokens=tuple(range(80)),
                 hashes=("a", "b", "c"), last_used=1)
    eng.publish(RequestStarted(record()))
    eng.publish(Progress(1, 0, "extend", 10, 24))
    cards.feed.flush()
    card = cards.cards[0].value
    assert "alice" in card and "busy" in card and "read 10/24 new (continued)" in card
    assert "3 messages" in card and "80/512 tokens" in card and "images: 0" in card
    assert cards.busy == 1 and cards.used == 80
    eng.publish(Progress(1, 0, "generate", 3, 8))
    cards.feed.flush()
    assert "generating: 3 tokens" in cards.cards[0].value
    eng.set_slot(0, pending=False, tokens=tuple(range(110)), last_used=2)
    eng.set_slot(1, session="bob", tokens=tuple(range(30)), hashes=("x",), last_used=1)
    eng.publish(RequestFinished(record(generated_tokens=6)))
    n = len(sent)
    cards.feed.flush()
    assert "busy" not in cards.cards[0].value and "LRU 1 of 2" in cards.cards[0].value
    assert "LRU 2 of 2" in cards.cards[1].value and cards.busy == 0
    # the redraw reached the front end as widget state messages
    assert any(d and d.get("method") == "update" and "LRU 1 of 2" in str(d)
               for _, d in sent[n:])


def test_kv_map_shows_messages_states_and_progress():
    eng = FakeEngine()
    kv = KVMap(eng, Feed(eng, live=False))
    t = kv.traces
    assert list(kv.figure.data[0].x) == [512] * 4 and kv.segments == 0
    # named in the vocabulary's words (the legend and the hovers)
    assert (t["prefilled"].name, t["todo"].name, t["image"].name) == (
        "read new", "still to read", "image")
    eng.publish(RequestStarted(record()))
    eng.publish(Progress(1, 0, "extend", 10, 24))
    kv.feed.flush()
    # message row: coloured by role, one bar per message
    assert bars(t["system"]) == [("slot 0", 0, 40)]
    assert bars(t["user"]) == [("slot 0", 40, 60), ("slot 0", 80, 100)]
    assert bars(t["assistant"]) == [("slot 0", 60, 80), ("slot 0", 100, 104)]
    assert list(t["user"].marker.opacity) == [0.7, 0.7]  # odd messages shaded
    # request row: reused, prefilled so far, still to prefill
    req = "slot 0 · request"
    assert bars(t["reused"]) == [(req, 0, 40), (req, 40, 60), (req, 60, 80)]
    assert bars(t["prefilled"]) == [(req, 80, 90)]
    assert bars(t["todo"]) == [(req, 90, 100), (req, 100, 104)]
    assert bars(t["trimmed"]) == [(req, 80, 86)]
    # hover: message index, role, token range, preview
    assert list(t["user"].customdata[0]) == [1, "user", 40, 60, "What is a CPU?"]
    eng.publish(Progress(1, 0, "generate", 5, 16))
    kv.feed.flush()
    assert bars(t["todo"]) == [] and bars(t["generated"]) == [(req, 104, 109)]
    final = SEGS + (Segment(104, 110, 4, "assistant", "generated", "Stores data."),)
    eng.set_slot(0, segments=final, tokens=tuple(range(110)), session="alice")
    eng.publish(RequestFinished(record(segments=final, generated_tokens=6)))
    kv.feed.flush()
    assert bars(t["generated"]) == [(req, 104, 110)]
    assert bars(t["assistant"]) == [("slot 0", 60, 80), ("slot 0", 100, 110)]
    assert bars(t["trimmed"]) == [(req, 80, 86)] and bars(t["image"]) == []
    eng.publish(SlotsChanged("cleared"))
    eng.set_slot(0, segments=(), tokens=())
    kv.feed.flush()
    assert kv.segments == 0


def test_timeline_plots_salvage_ttft_and_no_cache_estimate():
    eng = FakeEngine()
    tl = Timeline(eng, Feed(eng, live=False), max_requests=2)
    recs = [
        record(1, strategy="miss", reused_tokens=0, prefilled_tokens=200, prompt_tokens=200,
               ttft_s=1.0, prefill_s=1.0, reason="first"),
        record(2, strategy="hash-extend", reused_tokens=200, prefilled_tokens=20,
               prompt_tokens=220, ttft_s=0.1, prefill_s=0.1, reason="continued"),
        record(3, strategy="prefix-salvage", reused_tokens=100, prefilled_tokens=140,
               prompt_tokens=240, ttft_s=0.7, prefill_s=0.7, reason="copied"),
    ]
    for r in recs:
        eng.publish(RequestFinished(r))
    tl.feed.flush()
    t = tl.traces
    assert tl.shown == 2  # max_requests
    extended, salvaged = t["continued"], t["copied"]
    assert (extended.name, salvaged.name) == ("continued", "copied prefix")  # vocabulary
    assert list(extended.x) == [2] and list(salvaged.x) == [3]
    assert list(t["first"].x) == []
    assert extended.y[0] == pytest.approx(100 * 200 / 220)
    # one visual language: every salvage bar is "reused" green; the event is the pattern
    assert {tr.marker.color for tr in (extended, salvaged, t["first"])} == {COLORS["reused"]}
    assert salvaged.marker.pattern.shape == "/" and not extended.marker.pattern.shape
    assert "reused 200 of 220 tokens" in extended.customdata[0]
    assert "first token after 100 ms" in extended.customdata[0]
    assert list(t["first token"].y) == pytest.approx([100, 700])
    assert "= waited 0 ms" in t["first token"].customdata[0]  # the split, on hover
    # 200 tokens/s observed: reusing 200 tokens saved ~1 s
    assert list(t["no-cache estimate"].y) == pytest.approx([1100, 1200])
    assert list(t["read new"].y) == [20, 140] and list(t["reused"].y) == [200, 100]
    # a request that reused nothing still shows a mark at 0
    eng.publish(RequestFinished(record(4, strategy="miss", reused_tokens=0, prompt_tokens=50,
                                       prefilled_tokens=50, ttft_s=0.2)))
    tl.feed.flush()
    nothing = t["reused nothing"]  # an open circle: never mistaken for a line's label
    assert list(nothing.x) == [4] and list(nothing.y) == [0]
    assert nothing.marker.symbol == "circle-open"
    layout = tl.figure.layout
    assert layout.xaxis3.title.text == "request #" and layout.xaxis.tickformat == "d"
    assert [layout[f"yaxis{i}"].title.text for i in ("", "2", "3")] == ["%", "ms", "tokens"]
    with pytest.raises(ValueError, match="max_requests must be >= 1"):
        tl.max_requests = 0


class ManualClock:
    """The feed's clock, moved only by the test: ``time.monotonic`` and timed event waits.

    Installed as the ``time`` and ``threading.Event`` of :mod:`nbkv.widgets.feed`, so the
    render thread's throttle (``interval`` seconds between redraws) runs on this clock.
    """

    def __init__(self, now=1000.0):
        self.now = now
        self.cv = threading.Condition()

    def monotonic(self):
        with self.cv:
            return self.now

    def advance(self, seconds):
        with self.cv:
            self.now += seconds
            self.cv.notify_all()

    def __getattr__(self, name):  # anything else the feed takes from ``time``
        return getattr(time, name)


class ClockEvent:
    """``threading.Event`` whose ``wait(timeout)`` times out on a :class:`ManualClock`."""

    def __init__(self, clock):
        self.clock, self.flag = clock, False

    def is_set(self):
        return self.flag

    def set(self):
        with self.clock.cv:
            self.flag = True
            self.clock.cv.notify_all()

    def clear(self):
        with self.clock.cv:
            self.flag = False

    def wait(self, timeout=None):
        with self.clock.cv:
            end = None if timeout is None else self.clock.now + timeout
            while not self.flag and (end is None or self.clock.now < end):
                self.clock.cv.wait()
            return self.flag


@pytest.fixture
def clock(monkeypatch):
    from nbkv.widgets import feed as feed_module

    c = ManualClock()

    class Threading:
        def Event(self):  # noqa: N802 - stands in for threading.Event
            return ClockEvent(c)

        def __getattr__(self, name):
            return getattr(threading, name)

    monkeypatch.setattr(feed_module, "time", c)
    monkeypatch.setattr(feed_module, "threading", Threading())
    return c


class Draws:
    """A view that records each redraw: the thread it ran on and the events applied so far."""

    def __init__(self):
        self.seen = []
        self.cv = threading.Condition()

    def render(self, state):
        with self.cv:
            self.seen.append((threading.current_thread().name, state.events))
            self.cv.notify_all()

    def show_error(self, message):
        raise AssertionError(message)

    def wait_for(self, n):
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.seen) >= n, timeout=30), self.seen
        return self.seen[n - 1]


def test_live_feed_redraws_once_per_interval_and_ends_on_the_final_state(sent, clock):
    eng = FakeEngine()
    dash = CacheDashboard(eng, interval=0.25)
    draws = Draws()
    dash.feed.attach(draws)  # drawn once right away, on this thread
    try:
        eng.publish(RequestStarted(record()))  # a prompt is being read: no redraw yet
        time.sleep(0.2)
        assert len(draws.seen) == 1
        eng.publish(Progress(1, 0, "generate", 1, 100))  # its first token: drawn at once
        assert draws.wait_for(2) == ("nbkv-widgets", 2)
        for i in range(2, 52):  # 50 events within 0.2 s of that redraw
            clock.advance(0.004)
            eng.publish(Progress(1, 0, "generate", i, 100))
        assert len(draws.seen) == 2  # the feed waits for the interval to pass
        clock.advance(0.1)  # 0.3 s since the last redraw: one redraw for all 50
        assert draws.wait_for(3) == ("nbkv-widgets", 52)
        for i in range(52, 102):
            clock.advance(0.004)
            eng.publish(Progress(1, 0, "generate", i, 100))
        eng.publish(RequestFinished(record(generated_tokens=100)))
        assert len(draws.seen) == 3
        clock.advance(0.3)  # a request that ended is drawn once nothing follows for 0.4 s
        time.sleep(0.2)
        assert len(draws.seen) == 3
        clock.advance(0.2)  # the final state, once more after the last event
        assert draws.wait_for(4) == ("nbkv-widgets", 103)
        assert dash.feed.renders == 3  # 103 events, 3 redraws
        assert dash.timeline.shown == 1 and "1 requests" in dash.header.value
        assert "generating" not in dash.slots.cards[0].value  # the request ended
        # publishing only queues: every redraw after the first ran on the widget thread
        assert [name for name, _ in draws.seen] == ["MainThread"] + ["nbkv-widgets"] * 3
        assert {name for name, _ in sent} - {"MainThread"} <= {"nbkv-widgets"}
    finally:
        dash.close()
    assert len(draws.seen) == 4  # closing draws nothing more


def test_a_long_prefill_is_redrawn_at_most_once_per_hold(clock):
    eng = FakeEngine()
    feed = Feed(eng, interval=0.25, hold=1.0)
    draws = Draws()
    feed.attach(draws)
    try:
        eng.publish(RequestStarted(record()))
        deadline = time.monotonic() + 10
        while not feed.state.running and time.monotonic() < deadline:  # the thread took it
            time.sleep(0.01)
        clock.advance(0.5)
        time.sleep(0.2)
        assert len(draws.seen) == 1  # still reading, within the hold
        clock.advance(0.6)  # 1.1 s: a long prefill shows its progress
        assert draws.wait_for(2)[1] == 1
        eng.publish(Progress(1, 0, "extend", 10, 24))
        clock.advance(0.3)  # past the interval, but within the hold of the last redraw
        time.sleep(0.2)
        assert len(draws.seen) == 2
        clock.advance(0.8)
        assert draws.wait_for(3)[1] == 2
    finally:
        feed.close()


def test_a_failing_redraw_is_shown_not_raised():
    eng = FakeEngine()
    dash = CacheDashboard(eng, live=False)
    eng.fail = True
    eng.publish(SlotsChanged("cleared"))
    dash.feed.flush()  # no exception
    assert "snapshot broke" in dash.slots.note.value
    assert "snapshot broke" in dash.kvmap.note.value
    eng.fail = False
    eng.publish(SlotsChanged("cleared"))
    dash.feed.flush()
    assert dash.slots.note.value == ""


def test_engine_closed_stops_the_feed():
    eng = FakeEngine()
    dash = CacheDashboard(eng, interval=0.05)
    eng.publish(SlotsChanged("closed"))
    deadline = time.monotonic() + 5
    while dash.feed._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not dash.feed._thread.is_alive()
    assert "engine closed" in dash.header.value and "engine closed" in dash.slots.note.value
    assert not eng.bus._subs  # unsubscribed


# ------------------------------------------------------------------ real engine


@pytest.fixture(scope="module")
def engine(model_path):
    from nbkv import Engine

    with Engine(model_path, n_slots=2, n_ctx=1024) as e:
        yield e


def test_dashboard_follows_a_real_conversation(engine):
    dash = CacheDashboard(engine, interval=0.1)
    try:
        msgs = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a CPU?"}]
        res = engine.chat(msgs, session="real", max_tokens=6, temperature=0)
        msgs += [res.message, {"role": "user", "content": "And memory?"}]
        res2 = engine.chat(msgs, session="real", max_tokens=6, temperature=0)
        deadline = time.monotonic() + 10
        while dash.timeline.shown < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dash.timeline.shown == 2  # the live feed drew both requests on its own
        dash.feed.flush()  # the final state, drawn now whatever the throttle
        slot = res2.record.slot
        card = dash.slots.cards[slot].value
        assert "real" in card and f"{engine.slots()[slot].n_tokens}/1024" in card
        t = dash.kvmap.traces
        req = f"slot {slot} · request"
        reused = [b for b in bars(t["reused"]) if b[0] == req]
        assert reused and reused[-1][2] == res2.record.reused_tokens
        gen = [b for b in bars(t["generated"]) if b[0] == req]
        # the last sampled token is never decoded, so the KV ends one short of the reply
        assert gen == [(req, res2.record.prompt_tokens, engine.slots()[slot].n_tokens)]
        assert list(dash.timeline.traces["continued"].x) == [res2.record.id]
    finally:
        dash.close()


def test_images_show_as_media_spans_and_chunks():
    eng = FakeEngine()
    feed = Feed(eng, live=False)
    cards, kv = SlotCards(eng, feed), KVMap(eng, feed)
    segs = (
        Segment(0, 5, 0, "user", "reused", "Describe"),
        Segment(5, 69, 0, "user", "reused", "", kind="image", image_hash="ab" * 16),
        Segment(69, 80, 0, "user", "prefilled", "it."),
        Segment(80, 90, 1, "assistant", "generated", "A cat."),
    )
    image = MediaKey("ab" * 16, 0, 64, 64)
    tokens = (*range(5), *(MediaUnit(image, i) for i in range(64)), *range(69, 90))
    eng.set_slot(0, session="eve", tokens=tokens, segments=segs, last_used=1)
    feed.flush()
    assert bars(kv.traces["image"]) == [("slot 0", 5, 69)]
    assert bars(kv.traces["user"]) == [("slot 0", 0, 5), ("slot 0", 69, 80)]
    assert kv.traces["image"].customdata[0][4] == "image " + "ab" * 6
    assert "images: 1" in cards.cards[0].value


def test_slot_cards_show_the_memory_class_and_checkpoints():
    from nbkv.static import card, memory_text

    plain = SlotInfo(0, 0, 512, "a", (1, 2, 3), ("h",), (3,), 1, False)
    assert memory_text(plain) == "plain"
    html = card(plain, 1, 2, None)
    # "plain" and "LRU 1 of 2" explain themselves in tooltips
    assert re.search(r'class="nbkv-memory" title="plain memory: [^"]*any earlier position',
                     html)
    assert re.search(r'class="nbkv-lru" title="least recently used order: 1 of the 2[^"]*"'
                     r' style="cursor:help">LRU 1 of 2<', html)
    hybrid = SlotInfo(1, 1, 512, "b", tuple(range(300)), ("h",), (300,), 2, False,
                      checkpoints=(64, 128, 300), checkpoint_bytes=3 * 1100, memory="hybrid")
    assert memory_text(hybrid) == "hybrid · 3 checkpoints (3.2 KiB)"
    big = replace(hybrid, checkpoints=(300,), checkpoint_bytes=5 * 1024 * 1024,
                  memory="recurrent")
    assert memory_text(big) == "recurrent · 1 checkpoint (5.0 MiB)"
    # attention memory that cannot trim its tail is served with checkpoints too
    stuck = replace(hybrid, checkpoints=(128,), checkpoint_bytes=2048, memory="plain")
    assert memory_text(stuck) == "plain · 1 checkpoint (2.0 KiB)"
    assert "plain · 1 checkpoint (2.0 KiB)</span>" in card(stuck, 1, 2, None)


def test_kv_map_marks_checkpoints_on_the_messages_row():
    eng = FakeEngine()
    kv = KVMap(eng, Feed(eng, live=False))
    eng._slots[1] = SlotInfo(1, 1, 512, "b", tuple(range(130)), ("h",), (130,), 1, False,
                             checkpoints=(64, 128), checkpoint_bytes=2200, memory="hybrid")
    eng.publish(RequestFinished(record()))
    kv.feed.flush()
    cp = kv.traces["checkpoint"]
    assert list(zip(cp.y, cp.x)) == [("slot 1", 64), ("slot 1", 128)]
    assert "checkpoint at position" in cp.hovertemplate


def test_kv_map_marks_where_the_prompt_diverged():
    from nbkv.reasons import Divergence

    eng = FakeEngine()
    kv = KVMap(eng, Feed(eng, live=False))
    eng.set_slot(0, segments=SEGS, tokens=tuple(range(104)), session="alice")
    div = Divergence(63, 2, "assistant", (), (), 63)
    eng.publish(RequestFinished(record(7, reason="edited", divergence=div,
                                       reason_text="kept 2 message(s), re-read from message 2")))
    kv.feed.flush()
    mark = kv.traces["divergence"]
    assert list(mark.x) == [63] and list(mark.y) == ["slot 0 · request"]
    assert "request 7: edited message: kept 2 message(s)" in mark.customdata[0]


def test_one_legend_for_the_dashboard_and_the_slot_strips():
    from nbkv.display import LEGEND_STATES, legend_html, stats_table
    from nbkv.palette import ROLE_COLORS

    html = legend_html()
    for key, label in LEGEND_STATES:  # each colour named once, by what it means
        assert html.count(COLORS[key]) == 1 and label in html
    assert all(ROLE_COLORS[r] in html for r in ("system", "user", "assistant"))
    assert "checkpoint" in html and "where the prompt diverged" in html
    eng = FakeEngine()
    dash = CacheDashboard(eng, live=False)
    try:
        assert dash.legend.value == html
    finally:
        dash.close()
    # statistics: internals only under "details", draft counts only when guesses are on
    eng.speculative = False
    eng.stats = lambda: {"requests": 3, "reused_tokens": 10, "draft_tokens": 0,
                         "evictions": 1, "thrashing": False, "advice": "", "spc_entries": 0}
    table = stats_table(eng)
    assert [r[0] for r in table.rows] == ["requests", "reused from cache",
                                          "took another conversation's slot"]
    assert [r[0] for r in table.details] == ["spc_entries"]
    assert "<details>" in table._repr_html_() and table.note == ""
    # the slot strips are drawn in role colours: their legend shows roles and shading only
    strips = legend_html("strips")
    assert not any(COLORS[key] in strips for key, _ in LEGEND_STATES)
    assert "solid = reused" in strips and "pale = read new" in strips
    assert "striped = generated" in strips


def test_a_map_made_after_the_requests_starts_from_the_latest_one():
    from nbkv.reasons import Divergence

    eng = FakeEngine()
    eng.set_slot(0, segments=SEGS, tokens=tuple(range(104)), session="alice", last_request=7)
    div = Divergence(63, 2, "assistant", (), (), 63)
    eng.publish(RequestFinished(record(6)))
    eng.publish(RequestFinished(record(7, reason="edited", divergence=div)))
    kv = KVMap(eng, Feed(eng, live=False))  # drawn once, right away: no flush
    assert list(kv.traces["divergence"].x) == [63]


def test_conversations_follow_session_changes(sent):
    from nbkv.sessions import CellRef, SessionStore, Turn

    eng, store = FakeEngine(), SessionStore()
    view = Conversations(eng, Feed(eng, live=False), sessions=store)
    assert "no conversation yet" in view.view.value and view.turns == 0
    s = store.get("alice")
    s.messages = [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is a CPU?"},
                  {"role": "assistant", "content": "A processor."},
                  {"role": "user", "content": "And memory?"},
                  {"role": "assistant", "content": "Storage."}]
    view.feed.flush()
    assert view.turns == 2 and view.stale == 0 and "What is a CPU?" in view.view.value
    # a cell's turn commits, then a rewind: session events, not engine ones
    n = len(sent)
    s._commit(Turn([{"role": "user", "content": "What is a GPU?"},
                    {"role": "assistant", "content": "A graphics chip."}], CellRef("c1", 7)))
    assert s.turns[0].cell is None  # the turns set from Python had no cell: appended
    s.rewind(0)
    view.feed.flush()
    assert view.stale == 3 and view.view.value.count('data-state="stale"') == 3
    # the redraw reached the front end as a widget state message
    assert any(d and d.get("method") == "update" and 'data-state="stale"' in str(d)
               for _, d in sent[n:])
    eng.set_slot(0, session="alice", tokens=tuple(range(50)), last_used=1)
    eng.publish(RequestFinished(record()))
    view.feed.flush()
    assert "slot 0: 50 tokens in KV" in view.view.value
    view.close()
    s.reset()  # no longer followed: nothing raised, nothing redrawn
    assert view.turns == 3
