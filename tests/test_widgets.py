"""Widgets on the real engine: traits, figure data and comm messages follow its events.

One SmolLM2 engine (with the generated tiny vision projector, for images) serves the module
(the generated tiny LFM2 stands in where an engine must be hybrid, or be closed);
a scripted conversation (:func:`story`) runs on it once while the widgets are drawn at each
of its events, on the engine's thread, so what they showed is what the engine held then.
The live feed's throttle runs on a clock the test moves, and the engine is held at chosen
events: nothing depends on how fast this machine is.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field, replace
from html import escape
from typing import Any

import comm
import pytest

from conftest import picture
from nbkv import Engine
from nbkv.core.events import (
    Progress,
    RequestFinished,
    RequestRecord,
    RequestStarted,
    SlotRewritten,
)
from nbkv.engine import rewrite
from nbkv.engine.facade import SlotInfo
from nbkv.fixtures import make_mmproj, make_text_model
from nbkv.kv.slot_table import Conversation
from nbkv.ui import vocabulary
from nbkv.ui.palette import COLORS
from nbkv.ui.widgets import CacheDashboard, Conversations, Feed, KVMap, SlotCards, Timeline
from nbkv.ui.widgets.kvmap import BARS

CTX = 512
WAIT = 30.0  # seconds: the bound of every wait (a failure, never a hang)
SYSTEM = {"role": "system", "content": "Be brief."}


def user(text, image=None):
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image", "image": image}]}


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


def record_comms(mp, log):
    mp.setattr(comm, "create_comm", lambda **kw: RecordingComm(log, **kw))


@pytest.fixture
def sent(monkeypatch):
    log = []
    record_comms(monkeypatch, log)
    return log


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, mmproj=str(make_mmproj(kind="tiny")), n_slots=2, n_ctx=CTX) as e:
        yield e


def bars(rows):
    return sorted((b.row, b.start, b.end) for b in rows)


def req(slot):
    return f"slot {slot} · request"


# ------------------------------------------------------------------ the scripted conversation


@dataclass
class Shown:
    """What the slot cards and the KV map showed at one moment."""

    cards: list[str]
    busy: int
    used: int
    bars: dict[str, list[tuple[str, int, int]]]
    hover: dict[str, list[list[Any]]]
    opacity: dict[str, Any]
    divergence: list[tuple[Any, ...]]
    segments: int
    slots: tuple[SlotInfo, ...]
    svg: str  # what the browser was sent


def shown(engine, cards, kv):
    m = kv.model
    return Shown([c.value for c in cards.cards], cards.busy, cards.used,
                 {name: bars(m.bars[name]) for name in BARS},
                 {name: [[b.message, b.role, b.start, b.end, b.text] for b in m.bars[name]]
                  for name in BARS},
                 {name: [b.shade for b in m.bars[name]] for name in BARS},
                 [(pos, row, what) for row, pos, what in m.divergences],
                 kv.segments, engine.slots(), kv.view.value)


@dataclass
class Story:
    """Requests on the real engine, and what the widgets showed at each of their events."""

    records: dict[str, RequestRecord] = field(default_factory=dict)
    #: (request, "started" / "first token" / "finished"), ("empty", ""), ("cleared", "")
    at: dict[tuple[str, str], Shown] = field(default_factory=dict)
    sent: list[Any] = field(default_factory=list)  # the widgets' comm messages
    late_divergence: list[Any] = field(default_factory=list)  # of a map made afterwards


@pytest.fixture(scope="module")
def story(engine):
    """alice (twice), bob, alice with an earlier message edited, eve with an image.

    Two slots: alice and bob fill them, the edit is salvaged up to the changed message,
    and eve takes bob's slot (the least recently used). Then every slot is cleared.
    """
    engine.clear()
    out = Story()
    with pytest.MonkeyPatch.context() as mp:
        record_comms(mp, out.sent)
        feed = Feed(engine, live=False)
        cards, kv = SlotCards(engine, feed), KVMap(engine, feed)
    out.at[("empty", "")] = shown(engine, cards, kv)
    current = [""]

    def draw(moment):
        feed.flush()  # on the engine's thread, as the event is published
        out.at[(current[0], moment)] = shown(engine, cards, kv)

    def watch(ev):
        if isinstance(ev, RequestStarted):
            draw("started")
        elif isinstance(ev, Progress) and ev.phase == "generate" and ev.done == 1:
            draw("first token")
        elif isinstance(ev, RequestFinished):
            draw("finished")

    def ask(name, messages, session):
        current[0] = name
        r = engine.chat(messages, session=session, max_tokens=6, temperature=0)
        out.records[name] = r.record
        return r

    unsubscribe = engine.subscribe(watch)  # after the feed: it has queued each event
    grace = pytest.MonkeyPatch()
    # back to back: each reply's rewrite waits for the next request, however long a draw takes
    grace.setattr(rewrite, "GRACE_S", 600.0)
    try:
        alice = [SYSTEM, user("What is a CPU?")]
        alice += [ask("first", alice, "alice").message, user("And memory?")]
        ask("continued", alice, "alice")
        ask("bob", [user("Name a fruit.")], "bob")
        ask("edited", [SYSTEM, user("What is a GPU?"), *alice[2:]], "alice")
        ask("image", [user("Describe it.", picture(3))], "eve")
    finally:
        unsubscribe()
        grace.undo()
    late = KVMap(engine, Feed(engine, live=False))  # drawn once, right away: no flush
    out.late_divergence = [(pos, row) for row, pos, _ in late.model.divergences]
    late.close()
    engine.clear()
    feed.flush()
    out.at[("cleared", "")] = shown(engine, cards, kv)
    cards.close()
    kv.close()
    return out


def by_message(segments, slot):
    """The message row a map should draw: a bar per message (an image apart), by role."""
    spans: list[tuple[str, Any, int, int]] = []  # (key, message, start, end)
    for s in segments:
        key = "image" if s.is_media else s.role
        if spans and spans[-1][:2] == (key, s.message) and spans[-1][3] == s.start:
            spans[-1] = (key, s.message, spans[-1][2], s.end)
        else:
            spans.append((key, s.message, s.start, s.end))
    rows: dict[str, list[tuple[str, int, int]]] = {}
    for key, _, a, b in spans:
        rows.setdefault(key, []).append((f"slot {slot}", a, b))
    return {key: sorted(row) for key, row in rows.items()}


def on_slot(rows, slot):
    return [r for r in rows if r[0] in (f"slot {slot}", req(slot))]


def test_the_story_went_as_scripted(story):
    r = story.records
    assert [r[k].reason for k in ("first", "continued", "bob", "edited")] == [
        "first", "continued", "first", "edited"]
    assert r["first"].slot == r["continued"].slot == r["edited"].slot != r["bob"].slot
    assert r["image"].slot == r["bob"].slot and r["image"].evicted_session == "bob"
    assert r["edited"].trimmed_tokens > 0 and r["edited"].divergence is not None


def test_slot_cards_follow_a_request(story):
    empty = story.at[("empty", "")]
    assert all("free" in c and f"0/{CTX} tokens" in c for c in empty.cards)
    rec = story.records["first"]
    started = story.at[("first", "started")]
    card = started.cards[rec.slot]
    assert "alice" in card and "busy" in card and started.busy == 1
    assert f"read 0/{rec.prefilled_tokens} new (new conversation)" in card  # the vocabulary
    first = story.at[("first", "first token")]
    assert "generating: 1 tokens" in first.cards[rec.slot] and first.busy == 1
    done = story.at[("first", "finished")]
    slot = done.slots[rec.slot]
    card = done.cards[rec.slot]
    assert "busy" not in card and done.busy == 0 and "LRU 1 of 1" in card
    assert f"{slot.n_messages} messages" in card and slot.n_messages == 3  # with the reply
    assert f"{slot.n_tokens}/{CTX} tokens" in card and done.used == slot.n_tokens
    assert "latest: new conversation" in card and "images: 0" in card
    # bob took the free slot: alice's is now the less recently used
    bob = story.records["bob"]
    after_bob = story.at[("bob", "finished")]
    assert "LRU 1 of 2" in after_bob.cards[bob.slot]
    assert "LRU 2 of 2" in after_bob.cards[rec.slot]
    # eve took bob's slot: its card says so
    eve = story.records["image"]
    assert vocabulary.took(eve) == f"took bob's slot ({eve.evicted_tokens} tokens parked)"
    assert escape(vocabulary.took(eve)) in story.at[("image", "finished")].cards[eve.slot]
    # the redraws reached the front end as widget state messages
    assert any(d and d.get("method") == "update" and "LRU 1 of 2" in str(d)
               for _, d in story.sent)


def test_kv_map_shows_messages_states_and_progress(engine, story):
    # named in the vocabulary's words (the legend and the hovers)
    assert (BARS["prefilled"][0], BARS["todo"][0], BARS["image"][0]) == (
        "read new", "still to read", "image")
    rec = story.records["continued"]
    segs, row = rec.segments, req(rec.slot)
    reused = [(row, s.start, s.end) for s in segs if s.state == "reused"]
    read = [(row, s.start, s.end) for s in segs if s.state == "prefilled"]
    assert reused and read and reused[-1][2] == rec.reused_tokens
    started = story.at[("continued", "started")]
    # message row: coloured by role, one bar per message (the prompt's, until the reply)
    want = by_message([s for s in segs if s.state != "generated"], rec.slot)
    assert {k: on_slot(started.bars[k], rec.slot) for k in want} == want
    assert set(want) == {"system", "user", "assistant"}
    # solid, neighbours parted by a white edge: pale means "read new" on every surface
    assert list(started.opacity["user"]) == [1.0, 1.0]
    # hover: message index, role, token range, preview
    first_user = started.hover["user"][0]
    assert first_user[:2] == [1, "user"] and first_user[4].startswith("What is a CPU?")
    assert "user · message 1 · user · tokens" in started.svg  # the hover the browser gets
    # request row while the prompt is read: reused, and still to read
    assert started.bars["reused"] == sorted(reused)
    assert started.bars["prefilled"] == [] and started.bars["todo"] == sorted(read)
    first = story.at[("continued", "first token")]
    assert first.bars["todo"] == [] and first.bars["prefilled"] == sorted(read)
    assert "read new · message" in first.svg and "still to read" in started.svg
    assert first.bars["generated"] == [(row, rec.prompt_tokens, rec.prompt_tokens + 1)]
    done = story.at[("continued", "finished")]
    # the last sampled token is never decoded, so the KV can end one short of the reply
    assert done.bars["generated"] == [(row, rec.prompt_tokens,
                                       done.slots[rec.slot].n_tokens)]
    # back to back: the first reply's token-by-token rows, cut and read again canonically,
    # show as a thin band where they were
    assert 0 < rec.trimmed_tokens == rec.rewrite_absorbed
    assert done.bars["trimmed"] == [(row, rec.reused_tokens,
                                     rec.reused_tokens + rec.trimmed_tokens)]
    assert done.divergence == []
    # an edited earlier message: the cut-off KV as a thin band, a mark where it diverged
    ed = story.records["edited"]
    done = story.at[("edited", "finished")]
    a = ed.reused_tokens
    assert done.bars["trimmed"] == [(req(ed.slot), a, a + ed.trimmed_tokens)]
    ((x, y, text),) = done.divergence
    assert (x, y) == (ed.divergence.position, req(ed.slot))
    assert text.startswith(f"request {ed.id}: edited message: ")
    assert story.at[("cleared", "")].segments == 0


def test_images_show_as_media_spans_and_chunks(story):
    rec = story.records["image"]
    done = story.at[("image", "finished")]
    images = [s for s in rec.segments if s.is_media]
    assert len(images) == 1 and rec.media_chunks == 1
    want = by_message(rec.segments, rec.slot)
    assert done.bars["image"] == want["image"] == [(f"slot {rec.slot}", images[0].start,
                                                     images[0].end)]
    assert on_slot(done.bars["user"], rec.slot) == want["user"]  # the text around the image
    assert done.hover["image"][0][4] == "image array"  # its name, else its hash's start
    assert "images: 1" in done.cards[rec.slot]


def test_a_map_made_after_the_requests_starts_from_the_latest_one(story):
    ed = story.records["edited"]
    assert story.late_divergence == [(ed.divergence.position, req(ed.slot))]


def test_timeline_plots_salvage_ttft_and_no_cache_estimate(engine, story):
    tl = Timeline(engine, Feed(engine, live=False))
    history = engine.history
    pts = {p.id: p for p in tl.points}
    assert tl.shown == len(history) >= len(story.records) and list(pts) == [r.id for r in
                                                                            history]
    continued = story.records["continued"]
    p = pts[continued.id]
    assert p.bar == "continued" and p.salvage_pct == pytest.approx(continued.salvage_pct)
    assert f"reused {continued.reused_tokens} of {continued.prompt_tokens} tokens" in p.text
    assert f"first token after {continued.ttft_s * 1000:.0f} ms" in p.text
    assert pts[story.records["edited"].id].bar == "edited"
    # a request that reused nothing still shows a mark at 0: an open circle, not a bar
    assert pts[story.records["first"].id].bar == "nothing-reused"
    svg = tl.view.value
    assert svg.count('data-bar="nothing-reused"') == sum(1 for r in history
                                                         if not r.reused_tokens)
    assert '<circle cx=' in svg and 'fill="none"' in svg
    assert [p.ttft_ms for p in tl.points] == pytest.approx([r.ttft_s * 1000 for r in history])
    assert "= waited" in tl.points[0].ttft_text and "= waited" in svg  # the split, on hover
    # the estimate adds the reused tokens at one prefill speed, the same for every request
    per_token = {round((p.estimate_ms - p.ttft_ms) / p.reused, 9) for p in tl.points
                 if p.reused}
    assert len(per_token) == 1 and per_token.pop() > 0
    assert all(p.estimate_ms == pytest.approx(p.ttft_ms) for p in tl.points if not p.reused)
    assert [p.read for p in tl.points] == [r.prefilled_tokens for r in history]
    assert [p.reused for p in tl.points] == [r.reused_tokens for r in history]
    # one visual language: every salvage bar is "reused" green; the event is the pattern
    for code in ("continued", "copied", "edited"):
        assert f'fill="{COLORS["reused"]}" data-bar="{code}"' in svg or code == "copied"
    assert 'data-bar="continued"' in svg and "copied prefix" in tl.view.value + (
        vocabulary.EVENTS["copied"].words)
    assert "request #" in svg and "time to first token (ms)" in svg
    assert "no-cache estimate" in svg and "first token" in svg  # the legend
    tl.max_requests = 2
    tl.feed.flush()
    assert tl.shown == 2 and [p.id for p in tl.points] == [r.id for r in history[-2:]]
    with pytest.raises(ValueError, match="max_requests must be >= 1"):
        tl.max_requests = 0
    tl.close()


# ------------------------------------------------------------------ the live feed's throttle


class ManualClock:
    """The feed's clock, moved only by the test: ``time.monotonic`` and timed event waits.

    Installed as the ``time`` and ``threading.Event`` of :mod:`nbkv.ui.widgets.feed`, so the
    render thread's throttle (``interval`` seconds between redraws) runs on this clock.
    """

    def __init__(self, now=1000.0):
        self.now = now
        self.cv = threading.Condition()
        self.waiters: list[tuple[ClockEvent, float | None]] = []  # threads in ClockEvent.wait

    def monotonic(self):
        with self.cv:
            return self.now

    def advance(self, seconds):
        with self.cv:
            self.now += seconds
            self.cv.notify_all()

    def settled(self, timeout=WAIT):
        """Wait until the feed's thread waits on this clock with nothing to wake it.

        Every queued event it could act on has then been acted on: only moving the clock
        or a new event changes what it shows.
        """
        def idle():
            return self.waiters and all(not ev.flag and (end is None or self.now < end)
                                        for ev, end in self.waiters)
        with self.cv:
            return self.cv.wait_for(idle, timeout)

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
            me = (self, end)
            self.clock.waiters.append(me)
            self.clock.cv.notify_all()
            try:
                while not self.flag and (end is None or self.clock.now < end):
                    self.clock.cv.wait()
            finally:
                self.clock.waiters.remove(me)
                self.clock.cv.notify_all()
            return self.flag


@pytest.fixture
def clock(monkeypatch):
    from nbkv.ui.widgets import feed as feed_module

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
            assert self.cv.wait_for(lambda: len(self.seen) >= n, timeout=WAIT), self.seen
        return self.seen[n - 1]


class Gate:
    """Holds the engine's thread at the events ``when`` picks, until the test lets it go.

    Subscribed after the feed, so the feed has queued the event when the engine stops:
    the test sees the feed with exactly the events so far. Also counts every event.
    """

    def __init__(self, engine, when):
        self.when = when
        self.cv = threading.Condition()
        self.events: list[Any] = []
        self.held: list[Any] = []
        self.released = 0
        self.opened = False
        self.unsubscribe = engine.subscribe(self._on_event)

    def _on_event(self, ev):
        with self.cv:
            self.events.append(ev)
            self.cv.notify_all()
            if self.when is not None and self.when(ev):
                self.held.append(ev)
                n = len(self.held)
                self.cv.wait_for(lambda: self.opened or self.released >= n, timeout=WAIT)

    def reached(self, n):
        """The ``n``-th event the engine was held at, once it is held there."""
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.held) >= n, timeout=WAIT), self.events
            return self.held[n - 1]

    def release(self):
        with self.cv:
            self.released += 1
            self.cv.notify_all()

    def seen(self, test):
        """Wait for an event that passes ``test``."""
        with self.cv:
            assert self.cv.wait_for(lambda: any(test(ev) for ev in self.events),
                                    timeout=WAIT), self.events

    def open(self):
        """Hold nothing more, let everything go."""
        with self.cv:
            self.when, self.opened = None, True
            self.cv.notify_all()
        self.unsubscribe()


def test_live_feed_redraws_once_per_interval_and_ends_on_the_final_state(engine, sent, clock):
    engine.clear()  # nothing of earlier requests left to rewrite: every event is this test's
    dash = CacheDashboard(engine, interval=0.25)
    draws = Draws()

    def hold(ev):  # a's start; each request's first token
        return (isinstance(ev, RequestStarted) and ev.record.session == "a"
                or isinstance(ev, Progress) and ev.phase == "generate" and ev.done == 1)

    gate = Gate(engine, hold)
    dash.feed.attach(draws)  # drawn once right away, on this thread
    streams = []

    def ask(session, text):
        streams.append(engine.chat([SYSTEM, user(text)], session=session, stream=True,
                                   max_tokens=8, temperature=0))

    try:
        ask("a", "Name a colour.")
        assert isinstance(gate.reached(1), RequestStarted)  # a's prompt is being read
        assert clock.settled() and len(draws.seen) == 1  # no redraw for that
        gate.release()
        first = gate.reached(2)
        assert first.phase == "generate" and first.done == 1  # a's first token
        assert draws.wait_for(2) == ("nbkv-widgets", 2)  # drawn at once: no clock moved
        ask("b", "Name a fruit.")  # queued while the engine is held: it starts after
        gate.release()
        third = gate.reached(3)
        assert third.request_id == next(ev.record.id for ev in gate.events if isinstance(
            ev, RequestStarted) and ev.record.session == "b")  # b's first token
        # b started and answered within the interval of the last redraw: not drawn yet
        assert clock.settled() and len(draws.seen) == 2
        clock.advance(0.3)  # the interval passed: one redraw for all that came
        assert draws.wait_for(3) == ("nbkv-widgets", len(gate.events))
        gate.when = None  # the rest, at the engine's own pace
        gate.release()
        ids = {s.result().record.id for s in streams}
        gate.seen(lambda ev: ids == {e.request_id for e in gate.events
                                     if isinstance(e, SlotRewritten)})
        assert clock.settled() and len(draws.seen) == 3  # within the interval again
        clock.advance(0.3)  # past it; the requests ended: drawn once 0.4 s are quiet
        assert clock.settled() and len(draws.seen) == 3
        clock.advance(0.2)
        assert draws.wait_for(4) == ("nbkv-widgets", len(gate.events))  # the final state
        assert clock.settled() and dash.feed.renders == 3
        assert f"{len(engine.history)} requests" in dash.header.value
        assert not any("generating" in c.value for c in dash.slots.cards)  # they ended
        # publishing only queues: every redraw after the first ran on the widget thread
        assert [name for name, _ in draws.seen] == ["MainThread"] + ["nbkv-widgets"] * 3
        assert {name for name, _ in sent} - {"MainThread"} <= {"nbkv-widgets"}
    finally:
        gate.open()
        for s in streams:
            s.close()
        dash.close()
    assert len(draws.seen) == 4  # closing draws nothing more


def test_a_long_prefill_is_redrawn_at_most_once_per_hold(engine, clock):
    engine.clear()
    feed = Feed(engine, interval=0.25, hold=1.0)
    draws = Draws()

    def reading(ev):  # the start, and the progress of the prompt's reading
        return (isinstance(ev, RequestStarted)
                or isinstance(ev, Progress) and ev.phase != "generate")

    gate = Gate(engine, reading)
    feed.attach(draws)
    # a prompt longer than n_batch: read in two pieces, with a progress event after the first
    long = [SYSTEM, user(" ".join(f"Fact {i}: cats sleep a lot." for i in range(40)))]
    assert engine.ctx.n_batch < len(engine.tokenize_prompt(long)) < CTX - 8
    stream = None
    try:
        stream = engine.chat(long, session="long", stream=True, max_tokens=2, temperature=0)
        gate.reached(1)
        assert clock.settled() and len(draws.seen) == 1
        clock.advance(0.5)
        assert clock.settled() and len(draws.seen) == 1  # still reading, within the hold
        clock.advance(0.6)  # 1.1 s: a long prefill shows its progress
        assert draws.wait_for(2)[1] == 1
        gate.release()
        progress = gate.reached(2)
        assert isinstance(progress, Progress) and 0 < progress.done < progress.total
        clock.advance(0.3)  # past the interval, but within the hold of the last redraw
        assert clock.settled() and len(draws.seen) == 2
        clock.advance(0.8)
        assert draws.wait_for(3)[1] == 2
    finally:
        gate.open()
        if stream is not None:
            stream.close()
        feed.close()


# ------------------------------------------------------------------ the dashboard


def test_a_failing_redraw_is_shown_not_raised(engine, monkeypatch):
    dash = CacheDashboard(engine, live=False)
    try:
        def broken():
            raise RuntimeError("snapshot broke")

        monkeypatch.setattr(engine, "slots", broken)  # the engine's snapshot fails once
        engine.clear()
        dash.feed.flush()  # no exception
        assert "snapshot broke" in dash.slots.note.value
        assert "snapshot broke" in dash.kvmap.note.value
        monkeypatch.undo()
        engine.clear()
        dash.feed.flush()
        assert dash.slots.note.value == ""
    finally:
        dash.close()


def test_engine_closed_stops_the_feed():
    e = Engine(str(make_text_model("lfm2")), n_slots=1, n_ctx=CTX)  # tiny: closed here
    dash = CacheDashboard(e, interval=0.05)
    subscribers = len(e.events._subs)
    e.close()
    dash.feed._thread.join(WAIT)  # the feed's thread ends on its own
    assert not dash.feed._thread.is_alive()
    assert "engine closed" in dash.header.value and "engine closed" in dash.slots.note.value
    assert len(e.events._subs) == subscribers - 1  # unsubscribed


def test_dashboard_follows_a_real_conversation(engine):
    engine.clear(parked=True)  # earlier tests' conversations parked: this one starts afresh
    dash = CacheDashboard(engine, interval=0.1)
    drawn = Draws()
    dash.feed.attach(drawn)  # after the dashboard's own pieces: redrawn after them
    try:
        msgs = [SYSTEM, user("What is a CPU?")]
        res = engine.chat(msgs, session="real", max_tokens=6, temperature=0)
        msgs += [res.message, user("And memory?")]
        res2 = engine.chat(msgs, session="real", max_tokens=6, temperature=0)
        with drawn.cv:  # the live feed draws both requests on its own
            assert drawn.cv.wait_for(lambda: res2.record in dash.feed.state.last_by_slot.values()
                                     and dash.timeline.shown == len(engine.history), WAIT)
        dash.feed.flush()  # the final state, drawn now whatever the throttle
        slot = res2.record.slot
        card = dash.slots.cards[slot].value
        assert "real" in card and f"{engine.slots()[slot].n_tokens}/{CTX}" in card
        m = dash.kvmap.model
        reused = [b for b in bars(m.bars["reused"]) if b[0] == req(slot)]
        assert reused and reused[-1][2] == res2.record.reused_tokens
        gen = [b for b in bars(m.bars["generated"]) if b[0] == req(slot)]
        # the last sampled token is never decoded, so the KV ends one short of the reply
        assert gen == [(req(slot), res2.record.prompt_tokens, engine.slots()[slot].n_tokens)]
        assert (res2.record.id, "continued") in [(p.id, p.bar) for p in dash.timeline.points]
    finally:
        dash.close()


def test_one_legend_for_the_dashboard_and_the_slot_strips(engine):
    from nbkv.ui.display import LEGEND_STATES, legend_html, stats_table
    from nbkv.ui.palette import ROLE_COLORS

    html = legend_html()
    for key, label in LEGEND_STATES:  # each colour named once, by what it means
        assert html.count(COLORS[key]) == 1 and label in html
    assert all(ROLE_COLORS[r] in html for r in ("system", "user", "assistant"))
    assert "checkpoint" in html and "where the prompt diverged" in html
    dash = CacheDashboard(engine, live=False)
    try:
        assert dash.legend.value == html
    finally:
        dash.close()
    # statistics: internals only under "details", draft counts only when guesses are on
    assert not engine.speculative
    table = stats_table(engine)
    rows = [r[0] for r in table.rows]
    assert rows[:3] == ["requests", "prompt tokens", "reused from cache"]
    assert "took another conversation's slot" in rows
    assert [r[0] for r in table.details] == ["spc_entries"]
    assert "<details>" in table._repr_html_()
    # the slot strips are drawn in role colours: their legend shows roles and shading only
    strips = legend_html("strips")
    assert not any(COLORS[key] in strips for key, _ in LEGEND_STATES)
    assert "solid = reused" in strips and "pale = read new" in strips
    assert "striped = generated" in strips


def test_conversations_follow_session_changes(engine, sent):
    from nbkv.notebook.sessions import SessionStore

    store = SessionStore()
    view = Conversations(engine, Feed(engine, live=False), sessions=store)
    assert "no conversation yet" in view.view.value and view.turns == 0
    s = store.get("dora")
    for q in ("What is a CPU?", "And memory?"):  # each turn commits: a session event
        s.chat(q, engine=engine, max_tokens=4, temperature=0)
    view.feed.flush()
    assert view.turns == 2 and view.stale == 0 and "What is a CPU?" in view.view.value
    slot = next(x for x in engine.slots() if x.session == "dora")
    assert f"slot {slot.index}: {slot.n_tokens} tokens in KV" in view.view.value
    n = len(sent)
    s.rewind(1)  # the second turn goes stale
    view.feed.flush()
    assert view.stale == 1 and view.view.value.count('data-state="stale"') == 1
    # the redraw reached the front end as a widget state message
    assert any(d and d.get("method") == "update" and 'data-state="stale"' in str(d)
               for _, d in sent[n:])
    view.close()
    s.reset()  # no longer followed: nothing raised, nothing redrawn
    assert view.turns == 2


# ------------------------------------------------------------------ checkpoints


def test_kv_map_marks_checkpoints_on_the_messages_row():
    """A hybrid model (the generated tiny LFM2) keeps checkpoints: ticks on the messages row."""
    with Engine(str(make_text_model("lfm2")), n_slots=1, n_ctx=CTX) as e:
        msgs = [SYSTEM, user("What is a CPU?")]
        msgs += [e.chat(msgs, session="h", max_tokens=4, temperature=0).message,
                 user("And memory?")]
        e.chat(msgs, session="h", max_tokens=4, temperature=0)
        e.settle()  # the reply's rewrite (and its checkpoint) done before the map is drawn
        kv = KVMap(e, Feed(e, live=False))
        cards = SlotCards(e, kv.feed)
        s = e.slots()[0]
        assert s.memory == "hybrid" and len(s.checkpoints) > 1
        assert kv.model.checkpoints == [("slot 0", p) for p in s.checkpoints]
        assert kv.view.value.count("<title>checkpoint at ") == len(s.checkpoints)
        assert f"hybrid · {len(s.checkpoints)} checkpoints (" in cards.cards[0].value
        kv.close()
        cards.close()


def test_slot_cards_show_the_memory_class_and_checkpoints():
    from nbkv.ui.static import card, memory_text

    plain = SlotInfo(0, 0, 512, Conversation("a", (1, 2, 3), ("h",), (3,), last_used=1,
                                             settled=0), False)
    assert memory_text(plain) == "plain"
    html = card(plain, 1, 2, None)
    # "plain" and "LRU 1 of 2" explain themselves in tooltips
    assert re.search(r'class="nbkv-memory" title="plain memory: [^"]*any earlier position',
                     html)
    assert re.search(r'class="nbkv-lru" title="least recently used order: 1 of the 2[^"]*"'
                     r' style="cursor:help">LRU 1 of 2<', html)
    hybrid = SlotInfo(1, 1, 512, Conversation("b", tuple(range(300)), ("h",), (300,),
                                              last_used=2, settled=0,
                                              checkpoints=(64, 128, 300)),
                      False, checkpoint_bytes=3 * 1100, memory="hybrid")
    assert memory_text(hybrid) == "hybrid · 3 checkpoints (3.2 KiB)"
    big = replace(hybrid, conversation=replace(hybrid.conversation, checkpoints=(300,)),
                  checkpoint_bytes=5 * 1024 * 1024, memory="recurrent")
    assert memory_text(big) == "recurrent · 1 checkpoint (5.0 MiB)"
    # attention memory that cannot trim its tail is served with checkpoints too
    stuck = replace(hybrid, conversation=replace(hybrid.conversation, checkpoints=(128,)),
                    checkpoint_bytes=2048, memory="plain")
    assert memory_text(stuck) == "plain · 1 checkpoint (2.0 KiB)"
    assert "plain · 1 checkpoint (2.0 KiB)</span>" in card(stuck, 1, 2, None)


# ------------------------------------------------------------------ what a saved notebook shows


def test_a_displayed_view_keeps_a_snapshot_that_follows_the_cache(engine, sent, clock):
    """The live view, and beside it a static snapshot that the feed refreshes after the
    requests (never while one runs, at most every few seconds): what a saved notebook shows.
    The live view carries the rule that hides its snapshot in a running notebook."""
    from IPython.display import display
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell

    ipython_shell()
    engine.clear()
    dash = CacheDashboard(engine, interval=0.25)
    gate = Gate(engine, lambda ev: isinstance(ev, RequestStarted))
    stream = None
    try:
        with capture_output() as cap:
            display(dash)
        view, snap, *charts = cap.outputs  # the KV map and the timeline: outputs of their own
        assert [sorted(c.data) for c in charts] == [
            ["application/vnd.plotly.v1+json", "image/png", "text/plain"]] * 2
        assert "application/vnd.jupyter.widget-view+json" in view.data
        assert "text/html" not in view.data and "live view" in view.data["text/plain"]
        uid = dash.model_id
        html0 = snap.data["text/html"]
        assert html0.startswith(f'<div data-nbkv-snapshot="{uid}">')
        assert "nbkv-dashboard-static" in html0 and "<script" not in html0
        assert f'[data-nbkv-snapshot="{uid}"]{{display:none!important}}' in dash.hider.value
        shot = dash.feed.snapshots[0]
        with capture_output() as cap:
            stream = engine.chat([SYSTEM, user("Name a colour.")], session="snap", stream=True,
                                 max_tokens=4, temperature=0)
            gate.reached(1)  # the request runs: however long, no snapshot
            clock.advance(10)
            assert clock.settled() and shot.refreshes == 0
            gate.when = None  # the rest, at the engine's own pace
            gate.release()
            stream.result()
            gate.seen(lambda ev: isinstance(ev, SlotRewritten))
            assert clock.settled() and shot.refreshes == 0  # the quiet spell first
            clock.advance(5)
            deadline = time.monotonic() + WAIT
            while shot.refreshes == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert shot.refreshes == 1
        updates = [o for o in cap.outputs if o.transient.get("display_id")]
        (update,) = [o for o in updates if o.transient == snap.transient]  # updated in place
        assert {o.transient["display_id"] for o in updates} <= {
            o.transient["display_id"] for o in (snap, *charts)}  # and the charts, in theirs
        html = update.data["text/html"]
        assert f"{len(engine.history)} requests" in html and "snap" in html, html[:300]
        assert dash.feed.refresh_snapshots() == 0  # nothing changed since: nothing sent
    finally:
        gate.open()
        if stream is not None:
            stream.close()
        dash.close()


class NoEngine:
    """What a feed reads of an engine that has run nothing."""

    history: list[Any] = []

    def subscribe(self, cb):
        return lambda: None

    def slots(self):
        return ()


def test_a_refresh_called_while_the_feed_draws_waits_for_it_and_sends_nothing_again():
    """The feed's own refresh is drawing a chart's PNG when the kernel asks for one
    (``make notebooks``, before it saves): that call returns once the chart is sent, and
    sends nothing itself (before, it took the chart as sent and sent the next one twice
    over, or on its own: one update too many, and a notebook saved without the chart)."""
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell
    from nbkv.ui.widgets.snapshot import ChartOutput

    ipython_shell()
    version, drawing, release = [0], threading.Event(), threading.Event()

    def png():
        if version[0] == 1 and threading.current_thread().name == "feed":
            drawing.set()
            release.wait(WAIT)
        return b"\x89PNG"

    def source():
        return {"data": [], "layout": {"v": version[0]}}, png, "chart"

    feed = Feed(NoEngine(), live=False)
    results: dict[str, Any] = {}

    def refresh(name):
        n = feed.refresh_snapshots()
        results[name] = (n, [out.refreshes for out in feed.snapshots])

    with capture_output() as cap:
        feed.snapshots += [ChartOutput(source), ChartOutput(source)]
        version[0] = 1
        own = threading.Thread(target=refresh, args=("feed",), name="feed")
        own.start()
        assert drawing.wait(WAIT)  # the feed's refresh draws the first chart's PNG
        kernel = threading.Thread(target=refresh, args=("kernel",))
        kernel.start()
        kernel.join(1.0)  # (only lets a call that does not wait return first)
        release.set()
        own.join(WAIT)
        kernel.join(WAIT)
    assert results == {"feed": (2, [1, 1]), "kernel": (0, [1, 1])}
    # each chart: shown, then updated once (a holder, then the figure: see ChartOutput.refresh)
    figures = [o for o in cap.outputs if "application/vnd.plotly.v1+json" in o.data]
    assert len(figures) == 4 and len(cap.outputs) == 6
    assert feed.refresh_snapshots() == 0


def test_an_update_that_failed_is_sent_again_at_the_next_refresh():
    """A snapshot or chart whose update raised is not taken as shown: the next refresh sends it."""
    from types import SimpleNamespace

    from IPython.utils.capture import capture_output

    from conftest import ipython_shell
    from nbkv.ui.widgets.snapshot import ChartOutput, Snapshot

    ipython_shell()
    html = ["<p>0</p>"]
    view = SimpleNamespace(static_html=lambda: html[0], model_id="m", label="view")
    with capture_output() as cap:
        outs = [Snapshot(view), ChartOutput(lambda: ({"layout": {"v": html[0]}},
                                                     lambda: b"\x89PNG", "chart"))]
        html[0] = "<p>1</p>"
        for out in outs:
            update, out.handle.update = out.handle.update, None  # calling it raises
            assert out.refresh() is False
            out.handle.update = update
            assert out.refresh() is True and out.refresh() is False
    # both shown, then each updated once (the chart's update: a holder, then the figure)
    assert len(cap.outputs) == 5 and [o.refreshes for o in outs] == [1, 1]


def test_a_closed_engine_leaves_the_snapshot_with_its_last_requests(sent):
    from IPython.display import display
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell

    ipython_shell()
    e = Engine(str(make_text_model("lfm2")), n_slots=1, n_ctx=CTX)
    dash = CacheDashboard(e, live=False)
    dash.feed.live = True  # a live feed whose thread does not run: refreshed by hand here
    with capture_output():
        display(dash)
    e.chat([user("Hi.")], session="last", max_tokens=2, temperature=0)
    assert dash.feed.refresh_snapshots() == 3  # its snapshot, the KV map, the timeline
    e.close()
    assert dash.feed.refresh_snapshots() == 0  # it keeps the request, not "engine closed"
    assert "last" in dash.feed.snapshots[0]._shown
    dash.close()


#: 01_quickstart's conversations, as its cells send them
LESSON = [
    ("main", "You are a concise assistant in a tutorial about prompt caching. Answer in one or "
             "two short sentences.", ["What is a KV cache in a language model?",
                                      "Why does reusing it make the next reply start faster?"]),
    ("bob", "You answer with short lists.", ["Name three red fruits.",
                                             "Which 2 of them are the sweetest?"]),
    ("sampler", "", ["Invent a name for a cat."]),
]


def test_one_dashboard_update_after_a_turn_sends_at_most_100_kb(engine, sent):
    """What a displayed dashboard sends after each turn of a lesson (01's five turns, then
    Run All again): the live view's widget messages, its snapshot and each chart's update
    through their display ids (the holder, then plotly's JSON, the PNG and a line of text).
    At most 100 kB per turn, and 1 MB over the lesson."""
    import json

    from IPython.display import display
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell

    ipython_shell()
    engine.clear()
    dash = CacheDashboard(engine, live=False)
    dash.feed.live = True  # a live feed whose thread does not run: refreshed by hand here
    with capture_output():
        display(dash)
    per_turn, parts = [], []
    try:
        for _ in range(2):  # Run All twice
            for name, system, questions in LESSON:
                msgs = [{"role": "system", "content": system}] if system else []
                for q in questions:
                    msgs.append(user(q))
                    n = len(sent)
                    reply = engine.chat(msgs, session=name, max_tokens=24, temperature=0,
                                        seed=42)
                    msgs.append({"role": "assistant", "content": reply.text})
                    dash.feed.flush()  # the live view's redraw after the request
                    with capture_output() as cap:
                        assert dash.feed.refresh_snapshots() >= 2  # the snapshot and a chart
                    shown = sum(len(json.dumps(o.data)) for o in cap.outputs)
                    live = sum(len(json.dumps(d, default=str)) for _, d in sent[n:])
                    per_turn.append(shown + live)
                    parts.append((shown, live))
    finally:
        dash.close()
    sizes = [c for out in dash.chart_outputs for c in out.sizes]
    print(f"dashboard update per turn: max {max(per_turn) / 1000:.1f} kB, "
          f"{sum(per_turn) / 1000:.0f} kB over {len(per_turn)} turns; largest chart bundle "
          f"{max(sizes) / 1000:.1f} kB; outputs and widget messages per turn (kB): "
          + ", ".join(f"{a / 1000:.0f}+{b / 1000:.0f}" for a, b in parts))
    assert len(per_turn) == 10 and max(per_turn) <= 100_000, per_turn
    assert sum(per_turn) <= 1_000_000
