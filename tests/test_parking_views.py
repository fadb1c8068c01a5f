"""Parking on every surface, from constructed objects (no model): the slot cards' shelf, the
timeline's restore bars, the stats table."""

from __future__ import annotations

from types import SimpleNamespace

import comm
import pytest

from conftest import QuietComm
from nbkv.core.events import EventBus, RequestFinished, RequestRecord
from nbkv.engine.facade import SlotInfo
from nbkv.kv.slot_table import Conversation
from nbkv.store.parked import DISK, RAM, ParkedInfo
from nbkv.ui import static, vocabulary
from nbkv.ui.display import stats_table
from nbkv.ui.palette import PARKED_COLOR, RESTORED_COLOR
from nbkv.ui.widgets import Feed, SlotCards, Timeline

PARKED = (ParkedInfo("alice#3", Conversation("alice", tuple(range(1204)), ("h",), (1204,),
                                          last_used=9), 3 << 20, RAM),
          ParkedInfo("bob#1", Conversation("bob", tuple(range(80)), ("h",), (80,), last_used=2),
                     512 << 10, DISK))


def slots():
    return (SlotInfo(0, 0, 2048, Conversation("carol", (1, 2, 3), ("h",), (3,), last_used=5,
                                              settled=0), False),
            SlotInfo(1, 1, 2048, Conversation(None, settled=0), False))


def restore_record(i=1, **kw):
    base = dict(reason="restored", reason_text="session alice's conversation was parked",
                restored_from=RAM, restored_tokens=1204, restored_session="alice",
                restore_s=0.004, ttft_s=0.02)
    return RequestRecord(i, "alice", "hash-extend", 1, 1210, 1204, 6, 0, **{**base, **kw})


class Engine:
    """What the views read from an engine, and a parking lot's view of it."""

    n_slots, n_ctx, cache = 2, 2048, "imc"

    def __init__(self, parked=PARKED):
        self.bus = EventBus()
        self._parked = parked

    def subscribe(self, cb):
        return self.bus.subscribe(cb)

    def slots(self):
        return slots()

    def parked(self):
        return self._parked

    # the rest of nbkv.core.protocol.Parks, which the views check for
    def park(self, session=None, all=False):  # noqa: A002
        raise NotImplementedError

    def unpark(self, session=None, all=False):  # noqa: A002
        raise NotImplementedError

    def clear_parked(self):
        raise NotImplementedError

    @property
    def history(self):
        return list(self.bus.history)


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(comm, "create_comm", lambda **kw: QuietComm())


def test_the_shelf_lists_sessions_tokens_bytes_and_tier():
    html = static.shelf_html(PARKED)
    assert "parked" in html and "2 conversations" in html and "3.5 MiB" in html
    assert 'data-session="alice"' in html and "1,204 tokens · 3.0 MiB · " in html
    assert "80 tokens · 512.0 KiB" in html
    assert ">RAM</span>" in html and ">disk</span>" in html and PARKED_COLOR in html
    assert vocabulary.PARKING["disk"].tip in html  # each tier explains itself
    assert static.shelf_html(()) == ""
    cards = static.cards_html(slots(), {}, None, PARKED)
    assert cards.index('data-slot="1"') < cards.index("nbkv-shelf")
    assert "nbkv-shelf" not in static.cards_html(slots(), {})


def test_the_dashboards_fallback_and_the_live_cards_show_the_shelf(quiet):
    eng = Engine()
    cards = SlotCards(eng, Feed(eng, live=False))
    assert "alice" in cards.shelf.value and cards.parked == 2
    assert "nbkv-shelf" in cards.static_html()
    eng._parked = ()
    cards.feed.flush()
    assert cards.shelf.value == "" and cards.parked == 0
    assert static.parked_of(SimpleNamespace()) == ()  # an engine that does not park


def test_a_restore_is_its_own_kind_of_bar():
    recs = [RequestRecord(1, "carol", "miss", 0, 100, 0, 100, 0, reason="first"),
            restore_record(2)]
    svg = static.timeline_svg(recs)
    assert f'fill="{RESTORED_COLOR}"' in svg
    assert "restored alice&#x27;s 1,204 tokens from RAM in 4 ms" in svg  # the hover
    assert vocabulary.EVENTS["restored"].tip in svg  # its legend entry
    # a restore is drawn as one even when the request's event is another
    other = restore_record(3, reason="overflow")
    assert f'fill="{RESTORED_COLOR}"' in static.timeline_svg([other])


def test_the_live_timeline_has_a_restore_trace(quiet):
    eng = Engine()
    tl = Timeline(eng, Feed(eng, live=False))
    eng.bus.publish(RequestFinished(restore_record(1)))
    eng.bus.publish(RequestFinished(restore_record(2, reason="edited")))
    tl.feed.flush()
    assert [(p.id, p.bar) for p in tl.points] == [(1, "restored"), (2, "restored")]
    assert tl.view.value.count(f'fill="{RESTORED_COLOR}"') >= 2
    assert 'data-bar="edited"' not in tl.view.value


def test_the_stats_table_counts_parking_only_when_there_is_some():
    base = {"requests": 3, "prompt_tokens": 10, "reused_tokens": 5, "salvage_pct": 50.0,
            "restored_requests": 0, "restored_tokens": 0}
    quiet = stats_table(SimpleNamespace(stats=lambda: base))
    assert not any("restore" in str(label) or "parked" in str(label) for label, _ in quiet.rows)
    busy = {**base, "restored_requests": 2, "restored_tokens": 2408, "parks": 4, "restores": 2,
            "spills": 1, "parking_drops": 0, "parked_ram_entries": 1,
            "parked_ram_bytes": 3 << 20, "parked_disk_bytes": 0}
    rows = dict(stats_table(SimpleNamespace(stats=lambda: busy)).rows)
    assert rows["requests served by a restore (restored)"] == 2
    assert rows["conversations parked"] == 4 and rows["spilled to disk"] == 1
    assert rows["parked bytes in RAM"] == "3.0 MiB"
    assert "parked conversations dropped (over the budgets)" not in rows


def test_the_conversation_view_says_a_parked_conversation_comes_back():
    from nbkv.notebook.sessions import Session
    from nbkv.store.parked import ParkedInfo
    from nbkv.ui.conversation_view import conversation_html, conversation_text

    s = Session("alice")
    s.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    parked = (ParkedInfo("alice#1", Conversation("alice", tuple(range(40)), last_used=3),
                         1 << 20, "disk"),)
    for view in (conversation_html([s], (), parked), conversation_text([s], (), parked)):
        assert "parked on disk: 40 tokens (its next turn restores them)" in view
    assert "not in KV now (its next turn rebuilds it)" in conversation_html([s])


def test_displayed_charts_are_plotly_outputs_updated_in_place_and_small(quiet):
    """Displayed, the KV map and the timeline are outputs of their own (plotly figure and
    PNG, no HTML), sent again only when they changed, each update <= 100 kB, a lesson's
    worth of updates <= 1 MB; the widget does not draw them again as SVG."""
    from IPython.display import display
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell
    from nbkv.ui.chartfig import PLOTLY_MIME
    from nbkv.ui.widgets import KVMap

    ipython_shell()
    eng = Engine()
    eng.bus.publish(RequestFinished(restore_record(99)))
    feed = Feed(eng, live=False)
    tl, kv = Timeline(eng, feed), KVMap(eng, feed)
    feed.flush()
    assert "<svg" in tl.view.value and "<svg" in kv.view.value  # not displayed: SVG here
    with capture_output() as cap:
        display(tl)
        display(kv)
    assert len(cap.outputs) == 6  # each: the live view, its snapshot, its chart
    charts = [o for o in cap.outputs if PLOTLY_MIME in o.data]
    assert len(charts) == 2 and all("image/png" in o.data and "text/html" not in o.data
                                    for o in charts)
    assert charts[1].data[PLOTLY_MIME]["layout"]["yaxis"]["categoryarray"] == [
        "slot 0", "slot 0 · request", "slot 1", "slot 1 · request"]
    assert not tl.svg and not kv.svg and tl.view.value == kv.view.value == ""
    (chart,) = tl.chart_outputs
    for i in range(1, 31):  # a lesson's requests, the chart refreshed after each
        eng.bus.publish(RequestFinished(restore_record(i, reason="replayed" if i > 15
                                                       else "restored")))
        feed.flush()
        with capture_output() as cap:
            assert chart.refresh()
        # the same output, updated: a holder as tall as the chart, then the new figure (a
        # renderer of another type in between: jupyterlab-plotly's keeps an interactive chart)
        holder, update = cap.outputs
        assert update.transient == holder.transient == charts[0].transient
        assert set(holder.data) == {"text/html", "text/plain"} and "height:" in \
            holder.data["text/html"]
        assert chart.refresh() is False  # nothing changed: nothing sent
    assert tl.view.value == "" and "<svg" not in tl.static_html()
    assert max(chart.sizes) <= 100_000 and sum(chart.sizes) <= 1_000_000
    shown = update.data[PLOTLY_MIME]
    replayed = [t for t in shown["data"] if t.get("meta", {}).get("nbkv") == "replayed"]
    assert replayed and len(replayed[0]["x"]) == 15


class LessonEngine(Engine):
    """:class:`Engine` with what a dashboard's header reads."""

    model = SimpleNamespace(name="SmolLM2-135M")

    def stats(self):
        h = self.history
        prompt = sum(r.prompt_tokens for r in h)
        reused = sum(r.reused_tokens for r in h)
        return {"requests": len(h), "salvage_pct": 100 * reused / prompt if prompt else 0.0}


def test_a_displayed_dashboard_costs_at_most_a_megabyte_over_a_lesson(quiet):
    """A lesson's two Run Alls (12 requests each), the dashboard's outputs refreshed after
    every request: every chart update <= 100 kB, all of its bytes together <= 1 MB."""
    from IPython.display import display
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell
    from nbkv.ui.chartfig import bundle_size
    from nbkv.ui.widgets import CacheDashboard

    ipython_shell()
    eng = LessonEngine()
    dash = CacheDashboard(eng, live=False, sessions=())
    sent: list[int] = []
    try:
        with capture_output() as cap:
            display(dash)
        first = [bundle_size(o.data) for o in cap.outputs]
        charts = dash.chart_outputs
        assert len(charts) == 2 and len(cap.outputs) == 4  # live view, snapshot, 2 charts
        assert dash.outputs[1:] == charts
        for i in range(1, 25):
            eng.bus.publish(RequestFinished(restore_record(
                i, reason="restored" if i <= 12 else "replayed")))
            dash.feed.flush()
            with capture_output() as cap:
                for out in dash.outputs:  # the snapshot and the charts
                    out.refresh()
            sent += [bundle_size(o.data) for o in cap.outputs]
    finally:
        dash.close()
    assert max(sent) <= 100_000 and len(sent) >= 24
    total = sum(first) + sum(sent)
    print(f"dashboard over a lesson: {total} bytes in {len(sent)} updates")
    assert total <= 1_000_000


def test_a_report_in_a_notebook_is_its_page_then_its_charts(quiet):
    """Inline, ``%kvcache report`` shows its page without inline SVG (an untrusted notebook
    strips it), then the KV map and the timeline as plotly figures with their PNGs; the
    page written to a file keeps its SVG (it opens in any browser, offline)."""
    from IPython.display import display
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell
    from nbkv.ui.chartfig import PLOTLY_MIME
    from nbkv.ui.page import report

    ipython_shell()
    eng = LessonEngine()
    for i in (1, 2):
        eng.bus.publish(RequestFinished(restore_record(i)))
    page = report(eng, explain_last=0)
    with capture_output() as cap:
        display(page)
    html, kvmap, timeline = cap.outputs
    assert "<svg" not in html.data["text/html"] and "nbkv-report" in html.data["text/html"]
    kinds = [o.data[PLOTLY_MIME]["layout"]["meta"]["nbkv"] for o in (kvmap, timeline)]
    assert kinds == ["kvmap", "timeline"] and all("image/png" in o.data for o in (kvmap,
                                                                                   timeline))
    assert "nbkv-kvmap-svg" in page.html() and "nbkv-timeline-svg" in page.html()


def test_a_chart_that_cannot_be_drawn_says_so_and_the_next_refresh_draws_it(quiet):
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell
    from nbkv.ui.chartfig import PLOTLY_MIME
    from nbkv.ui.widgets.snapshot import ChartOutput

    ipython_shell()
    fig = {"data": [], "layout": {}}
    broken = [True]

    def source():
        if broken[0]:
            raise RuntimeError("no slots yet")
        return fig, lambda: b"\x89PNG", "chart"

    with capture_output() as cap:
        out = ChartOutput(source)
    assert cap.outputs[0].data == {"text/plain": "nbkv chart: not drawn (the log says why)"}
    broken[0] = False
    with capture_output() as cap:
        assert out.refresh()
    assert PLOTLY_MIME in cap.outputs[-1].data and out.sizes  # (after the chart's holder)


def test_a_map_shown_right_after_a_request_draws_that_request(quiet):
    """A view shown at the end of the cell whose request just ended, before the feed's thread
    applied its events, draws that request (04_vision's Qwen map was drawn one request
    behind, and its engine closed before the next refresh could catch up)."""
    from nbkv.ui import chartfig
    from nbkv.ui.widgets import KVMap

    eng = Engine()
    feed = Feed(eng, live=False)
    kv = KVMap(eng, feed)
    eng.bus.publish(RequestFinished(restore_record(7)))  # queued: no redraw since
    assert feed.snapshot().last_by_slot[1].id == 7  # what kv.chart() draws from
    assert kv.chart()[0] == chartfig.kvmap_figure(kv.map_model(feed.snapshot()))
