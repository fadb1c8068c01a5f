"""One word for each event: every surface names it from nbkv.ui.vocabulary, and nothing else does.

A real conversation on the model goes through every event the notebooks show (new
conversation, continued, copied prefix, took another's slot, rebuilt after eviction, edited
message, rebuilt after clear, engine reloaded, stopped at the token limit); then every
surface is rendered: figures and why lines, history, stats, status, slots, legends, explain,
the live widgets' traces, hovers and cards, the static fallbacks and the report page.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import comm
import pytest

from conftest import SYSTEM, QuietComm
from nbkv import Engine
from nbkv.ui import page, palette, static, vocabulary
from nbkv.ui.display import (
    history_table,
    legend_html,
    slots_table,
    stats_table,
    status_table,
)
from nbkv.ui.figures import EXPLAIN_READ, EXPLAIN_TRIMMED, ExplainReport, Figures
from nbkv.ui.widgets import CacheDashboard, Feed

ROOT = Path(__file__).resolve().parents[1]


def user(text):
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def engine(model_path):
    """Every event of the lesson, on 2 slots."""
    with Engine(model_path, n_slots=2, n_ctx=1024, park_ram=0) as e:  # evictions lose
        def ask(session, msgs):
            res = e.chat(msgs, session=session, max_tokens=3, temperature=0)
            msgs.append(res.message)
            return res.record

        alice = [{"role": "system", "content": SYSTEM}, user("What is a CPU?")]
        ask("alice", alice)  # new conversation
        alice.append(user("And memory?"))
        ask("alice", alice)  # continued
        bob = [{"role": "system", "content": SYSTEM}, user("Name three red fruits.")]
        ask("bob", bob)  # copied prefix
        carol = [{"role": "system", "content": "You are a pirate."}, user("Say hello.")]
        ask("carol", carol)  # new conversation, took alice's slot
        alice.append(user("Why?"))
        ask("alice", alice)  # rebuilt after eviction, salvaging bob's slot: took it
        e.clear(next(s.index for s in e.slots() if s.session == "alice"))
        alice.append(user("Really?"))
        ask("alice", alice)  # rebuilt after clear
        e.carry_over(["dora"])
        ask("dora", [user("Hi."), {"role": "assistant", "content": "Hello."}, user("More?")])
        yield e


def surfaces(engine, sent_off):
    """Every rendering of the engine's state and records: (name, text)."""
    out = []
    for r in engine.history:
        f = Figures(r)
        out += [(f"figures #{r.id}", f.text()), (f"figures html #{r.id}", f._repr_html_())]
        try:
            x = ExplainReport(engine.explain(r.id))
        except Exception:  # noqa: BLE001 - only the latest are kept
            continue
        out += [(f"explain #{r.id}", x.text()), (f"explain html #{r.id}", x._repr_html_())]
    for name, table in (("history", history_table(engine.history)), ("stats", stats_table(engine)),
                        ("status", status_table(engine)), ("slots", slots_table(engine))):
        out += [(name, table.text()), (name + " html", table._repr_html_())]
    out += [("legend", legend_html()), ("strips legend", legend_html("strips"))]
    dash = CacheDashboard(engine, live=False)
    try:
        dash.feed.flush()
        for piece in (dash.kvmap, dash.timeline):  # the live charts' SVG, hovers included
            out.append((f"{piece.__class__.__name__} view", piece.view.value))
        out += [("cards", "".join(c.value for c in dash.slots.cards)),
                ("header", dash.header.value), ("fallback", dash.static_html())]
    finally:
        dash.close()
    out.append(("report", page.report(engine).html()))
    return out


def test_no_surface_spells_an_event_another_way(engine, monkeypatch):
    monkeypatch.setattr(comm, "create_comm", lambda **kw: QuietComm())
    rendered = surfaces(engine, None)
    bad = {name: vocabulary.misspellings(text) for name, text in rendered}
    assert not {k: v for k, v in bad.items() if v}
    every = "\n".join(text for _, text in rendered)
    events = {vocabulary.event(r).code for r in engine.history}
    assert events >= {"first", "continued", "copied", "evicted", "cleared", "reloaded"}
    for r in engine.history:  # each request's event, in its words, where the request shows
        words = vocabulary.event(r).words
        by_name = dict(rendered)
        assert f"slot {r.slot}: " in by_name[f"figures #{r.id}"]
        assert words in by_name[f"figures #{r.id}"] or r.donor_slot is not None
        assert words in by_name["history"] and words in every
    assert any(r.finish_reason == "length" for r in engine.history)
    assert "stopped at the token limit" in dict(rendered)["history"]


def test_every_surface_says_when_a_request_took_another_conversations_slot(engine, monkeypatch):
    monkeypatch.setattr(comm, "create_comm", lambda **kw: QuietComm())
    taker = next(r for r in engine.history if r.session == "carol")
    took = vocabulary.took(taker)
    assert took.startswith(f"took {taker.evicted_session}'s slot (")
    assert took in Figures(taker).text()
    row = next(row for row in history_table(engine.history).rows if row[0] == taker.id)
    assert row[-1] == taker.evicted_session
    assert took in static.request_text(taker)  # timeline hovers, static and live
    assert took in ExplainReport(engine.explain(taker.id)).text()
    assert html.escape(took) in static.card(engine.slots()[taker.slot], 1, 2, None, taker)
    assert static.trimmed_text(taker) == took  # the KV map's trimmed band
    assert dict(stats_table(engine).rows)["took another conversation's slot"] >= 1


def test_colours_live_only_in_the_palette():
    hexes = re.compile(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b")
    found = {str(p.relative_to(ROOT)): hexes.findall(p.read_text())
             for p in (ROOT / "nbkv").rglob("*.py") if p.name != "palette.py"}
    assert not {k: v for k, v in found.items() if v}
    for t in vocabulary.terms():  # every term says what it is, in a palette colour
        assert t.tip and t.color.startswith("#") and t.color in vars(palette).values() or (
            t.color in {c for d in (palette.COLORS, palette.ROLE_COLORS) for c in d.values()})
    assert {t.pattern for t in vocabulary.EVENTS.values()} <= {"", "/", "\\", "x", "-", "|",
                                                               "+", "."}


def _rgb(color):
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def test_explain_highlights_are_distinguishable():
    """The trimmed (cached side) and read-new (new side) highlights differ in colour and
    pattern, so they never look alike (they were red and orange at 20% opacity)."""
    a, b = _rgb(palette.TRIMMED_TINT), _rgb(palette.PREFILLED_TINT)
    assert sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5 > 60  # RGB distance
    assert "repeating-linear-gradient" in EXPLAIN_TRIMMED and "line-through" in EXPLAIN_TRIMMED
    assert "gradient" not in EXPLAIN_READ


def test_a_widget_carries_its_static_fallback(engine, monkeypatch):
    monkeypatch.setattr(comm, "create_comm", lambda **kw: QuietComm())
    from nbkv.ui.widgets import KVMap, SlotCards, Timeline

    feed = Feed(engine, live=False)
    for cls, marker in ((SlotCards, "nbkv-slot-cards-static"), (KVMap, "nbkv-kvmap-svg"),
                        (Timeline, "nbkv-timeline-svg")):
        w = cls(engine, feed)
        data = w._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in data
        assert marker in data["text/html"] and "<script" not in data["text/html"]
    dash = CacheDashboard(engine, live=False)
    try:
        html = dash._repr_mimebundle_()["text/html"]
    finally:
        dash.close()
    # the state at the end of the cell: every slot's card and both charts, small
    for s in engine.slots():
        assert f'data-slot="{s.index}"' in html and (s.session or "free") in html
    assert "nbkv-kvmap-svg" in html and "nbkv-timeline-svg" in html
    assert len(html) < 60_000
