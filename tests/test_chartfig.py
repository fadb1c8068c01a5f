"""The charts as plotly figures and PNGs, from records of a scripted two-Run-All session.

No model and no browser: the records are what an engine writes for a lesson run twice (the
first Run All reads and continues, the second replays every turn, the first replay after a
restore of the parked conversation), and each chart is checked against them: its words
(hovers, legend names), its drawing (which trace each request is in, the PNG's colours) and
its size.
"""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import pytest

from nbkv.core.events import GENERATED, KEPT, PREFILLED, REUSED, RequestRecord, Segment
from nbkv.ui import chartfig, charts, raster
from nbkv.ui import vocabulary as vocab
from nbkv.ui.figures import ttft_parts
from nbkv.ui.palette import COLORS, REPLAYED_COLOR
from nbkv.ui.plots import plot

go = pytest.importorskip("plotly.graph_objects")
Image = pytest.importorskip("PIL.Image")

SYSTEM = "You are a concise assistant."


def rec(id, reason, reused, read, gen=8, **kw):
    """A finished request's record whose first-token parts add up (as the engine writes)."""
    base = dict(id=id, session="alice", strategy="hash-extend", slot=0,
                prompt_tokens=reused + read, reused_tokens=reused, prefilled_tokens=read,
                trimmed_tokens=0, generated_tokens=gen, reason=reason,
                reason_text=f"{reason} because", wait_s=0.002, prefill_s=0.01 * (read > 0),
                ttft_s=0.002 + 0.01 * (read > 0))
    base.update(kw)
    return RequestRecord(**base)


def session() -> list[RequestRecord]:
    """Run All twice: three turns read, then the same three replayed (the first restored)."""
    first = [rec(1, "first", 0, 40), rec(2, "continued", 48, 12), rec(3, "continued", 68, 10)]
    replayed = [
        rec(4, "replayed", 40, 0, 0, replayed_tokens=8, restored_from="ram",
            restored_session="alice", restored_tokens=86, restore_s=0.005, wait_s=0.009,
            ttft_s=0.014),
        rec(5, "replayed", 60, 0, 0, replayed_tokens=8, ttft_s=0.001, wait_s=0.001),
        rec(6, "replayed", 78, 0, 0, replayed_tokens=8, ttft_s=0.001, wait_s=0.001)]
    return first + replayed


def slot_after(records: list[RequestRecord]) -> SimpleNamespace:
    """Slot 0 as the last replay leaves it: the prompt and reply reused, later turns kept."""
    segs = (Segment(0, 12, 0, "system", REUSED, SYSTEM),
            Segment(12, 40, 1, "user", REUSED, "What is a CPU?"),
            Segment(40, 48, 2, "assistant", REUSED, "A processor."),
            Segment(48, 60, 3, "user", REUSED, "And memory?"),
            Segment(60, 68, 4, "assistant", REUSED, "Storage for data."),
            Segment(68, 78, 5, "user", REUSED, "And a disk?"),
            Segment(78, 86, 6, "assistant", REUSED, "Storage that lasts."))
    return SimpleNamespace(index=0, checkpoints=(), segments=segs, n_tokens=86,
                           verified=True, server_cached=None)


def test_a_second_run_all_is_drawn_replayed_everywhere():
    history = session()
    pts = charts.timeline_points(history)
    fig = chartfig.timeline_figure(pts)
    go.Figure(fig)  # plotly's own schema accepts it
    by_code = {t["meta"]["nbkv"]: t for t in fig["data"]}
    replayed = by_code["replayed"]
    assert replayed["x"] == ["#4", "#5", "#6"]  # the restored one too: not "restored"
    assert "restored" not in by_code and replayed["name"] == vocab.EVENTS["replayed"].words
    assert replayed["marker"]["color"] == REPLAYED_COLOR
    assert all("replayed" in t for t in replayed["text"])
    assert by_code["ttft"]["y"] == pytest.approx([r.ttft_s * 1000 for r in history])
    # the first-token parts of every record add up to its first-token time
    for r in history:
        assert sum(s for _, s in ttft_parts(r)) == pytest.approx(r.ttft_s), r.id
    assert [vocab.bar(r).code for r in history] == [
        "first", "continued", "continued", "replayed", "replayed", "replayed"]


def test_the_first_token_breakdown_adds_up_as_written():
    """The engine's record splits its first-token time into parts that sum to it, and the
    text writes whole milliseconds that sum to the total it writes (each rounded alone,
    three parts of 4.6 ms would read 5 + 5 + 5 under a total of 14)."""
    import random
    import re

    from nbkv.engine.jobs import finished_record
    from nbkv.ui.figures import ttft_text

    # a request that waited, had a parked conversation restored, read its prompt, sampled
    counts = SimpleNamespace(decode_calls=1, rows=5, prefill_calls=1, prefill_rows=5,
                             kv_bytes=0, host_s={})
    # (the first token's sampling time, and a re-read reply's, are the job's until the record
    # is finished)
    job = SimpleNamespace(t_submit=100.0, t_prefill=100.0131, t_first=100.0184,
                          first_decode_s=0.0011, absorbed_s=0.0, generated=[1, 2], todo=[],
                          encoder_runs=0, embedding_hits=0, drafted=0, accepted=0,
                          counts=counts)
    started = rec(7, "restored", 40, 5, restore_s=0.0052, first_decode_s=0.0,
                  wait_s=0.0, ttft_s=0.0, prefill_s=0.0)
    done = finished_record(job, started, "stop", None, 100.03, ())
    assert done.ttft_s == pytest.approx(0.0184)
    assert sum(s for _, s in ttft_parts(done)) == pytest.approx(done.ttft_s)
    assert [round(s * 1000, 1) for _, s in ttft_parts(done)] == [7.9, 5.2, 4.2, 1.1]

    def written(r: RequestRecord) -> tuple[int, list[int]]:
        total, split = re.fullmatch(r".*?: (\d+) ms = (.*)", ttft_text(r)).groups()
        return int(total), [int(n) for n in re.findall(r" (\d+) ms(?: \+|$)", split)]

    thirds = rec(8, "restored", 40, 5, wait_s=0.0046, restore_s=0.0046, prefill_s=0.0046,
                 first_decode_s=0.0, ttft_s=0.0138)
    assert written(thirds) == (14, [5, 4, 5, 0])  # 4.6 + 4.6 + 4.6 = 13.8
    rng = random.Random(47)
    for i in range(300):
        w, re_s, pre, first = (rng.uniform(0, 0.02) for _ in range(4))
        r = rec(i, "continued", 40, 5, wait_s=w, restore_s=re_s, prefill_s=pre + first,
                first_decode_s=first, ttft_s=w + re_s + pre + first)
        total, parts = written(r)
        assert len(parts) == len(ttft_parts(r)) and sum(parts) == total, ttft_text(r)
        assert all(abs(n - s * 1000) < 1 for n, (_, s) in zip(parts, ttft_parts(r),
                                                              strict=True)), ttft_text(r)


def test_request_numbers_carry_their_cells():
    cells = {r.id: SimpleNamespace(label=f"[{r.id + 2}]") for r in session()}
    pts = charts.timeline_points(session(), cell_of=lambda r: cells.get(r.id))
    assert pts[0].cell == "[3]" and pts[0].text.startswith("request 1 · alice · cell [3]\n")
    assert charts.timeline_points(session())[0].cell == ""
    fig = chartfig.timeline_figure(pts)
    assert fig["layout"]["xaxis"]["categoryarray"][:2] == ["#1 [3]", "#2 [4]"]
    assert "cell" in fig["layout"]["xaxis"]["title"]["text"]


def test_the_kv_map_figure_hovers_each_message_and_zooms():
    history = session()
    slot = slot_after(history)
    m = charts.kvmap_model([slot], 1024, {0: history[-1]})
    fig = chartfig.kvmap_figure(m)
    go.Figure(fig)
    bars = {t["meta"]["nbkv"]: t for t in fig["data"] if t["type"] == "bar"}
    assert list(fig["layout"]["yaxis"]["categoryarray"]) == ["slot 0", "slot 0 · request"]
    assert fig["layout"]["xaxis"]["range"] == [0, m.right]  # plotly zooms from there
    hovers = [row for t in bars.values() if "customdata" in t for row in t["customdata"]]
    users = [h for h in bars["user"]["customdata"]]
    assert users[0] == [1, "user", 12, 40, "What is a CPU?"]
    assert bars["user"]["hovertemplate"].startswith("user · message %{customdata[0]}")
    assert len(hovers) == m.segments  # every span, with its hover
    # the request row: all of it reused (a replay), nothing read, nothing trimmed
    assert sum(bars["reused"]["x"]) == 86 and set(bars["reused"]["y"]) == {"slot 0 · request"}
    assert "trimmed" not in bars and PREFILLED not in bars
    assert GENERATED not in bars and KEPT not in bars


def test_the_pngs_draw_the_records_colours():
    history = session()
    pts = charts.timeline_points(history)

    def colours(png: bytes) -> set[tuple[int, int, int]]:
        img = Image.open(io.BytesIO(png)).convert("RGB")
        return {c for _, c in img.getcolors(1 << 16)}

    def near(want: str, got: set[tuple[int, int, int]]) -> bool:
        r, g, b = (int(want[i:i + 2], 16) for i in (1, 3, 5))
        return any(abs(r - x) + abs(g - y) + abs(b - z) <= 24 for x, y, z in got)

    tl = colours(raster.timeline_png(pts))
    assert near(REPLAYED_COLOR, tl) and near(COLORS["reused"], tl) and near(
        COLORS["prefilled"], tl)
    m = charts.kvmap_model([slot_after(history)], 1024, {0: history[-1]})
    km = colours(raster.kvmap_png(m))
    assert near(COLORS["reused"], km) and not near(COLORS["trimmed"], km)


def test_one_bundle_per_chart_small_and_readable_untrusted():
    """plotly's JSON and a PNG, no HTML (stripped of its SVG when untrusted); <= 100 kB."""
    many = [rec(i, "continued", 3000, 40, reason_text="x" * 300) for i in range(1, 60)]
    pts = charts.timeline_points(many)
    b = chartfig.bundle(chartfig.timeline_figure(pts), raster.timeline_png(pts), "timeline")
    assert set(b) == {chartfig.PLOTLY_MIME, "image/png", "text/plain"}
    assert base64.b64decode(b["image/png"]).startswith(b"\x89PNG")
    assert chartfig.bundle_size(b) <= 100_000
    segs = tuple(Segment(i * 40, i * 40 + 40, i, "user" if i % 2 else "assistant", REUSED,
                         "a long message " * 20) for i in range(100))
    slots = [SimpleNamespace(index=k, checkpoints=(), segments=segs, n_tokens=4000,
                             verified=True, server_cached=None) for k in range(4)]
    m = charts.kvmap_model(slots, 4096, {})
    b = chartfig.bundle(chartfig.kvmap_figure(m), raster.kvmap_png(m), "KV map")
    assert m.segments >= 800 and chartfig.bundle_size(b) <= 100_000


def test_a_lessons_plot_is_a_figure_and_a_picture():
    p = plot("time to first token per turn", {"no cache": [2160, 1726], "IMC": [75, 161]},
             x_title="turn", y_title="ms")
    b = p._repr_mimebundle_()
    fig = b[chartfig.PLOTLY_MIME]
    go.Figure(fig)
    assert [t["name"] for t in fig["data"]] == ["no cache", "IMC"]
    assert fig["data"][1]["y"] == [75, 161] and "text/html" not in b
    img = Image.open(io.BytesIO(base64.b64decode(b["image/png"])))
    assert img.size[0] == p.width


def test_explain_draws_a_replayed_reply_as_reused_not_trimmed():
    from nbkv.kv.admission import explain_request
    from nbkv.ui.figures import EXPLAIN_TRIMMED, ExplainReport

    history = session()
    prompt, held = list(range(40)), list(range(86))  # the slot holds the reply and later turns
    compared = {4: (held, prompt), 2: (list(range(60)), list(range(48)) + [999] * 12)}
    text_of = lambda units: " ".join(map(str, units))  # noqa: E731
    replay = explain_request(history, compared, text_of, 4)
    assert replay.tail_state == "reused" and replay.cached_tail.startswith("40 ")
    page = ExplainReport(replay)._repr_html_()
    assert "line-through" not in page and EXPLAIN_TRIMMED not in page
    assert ">reused</span>" in page and ">trimmed</span>" not in page
    edited = explain_request(history, compared, text_of, 2)
    assert edited.tail_state == "trimmed"
    assert EXPLAIN_TRIMMED in ExplainReport(edited)._repr_html_()


def test_counts_are_words_never_s_in_brackets():
    from nbkv.core.events import counted

    assert [counted(n, "message") for n in (0, 1, 3)] == ["0 messages", "1 message",
                                                          "3 messages"]
    assert counted(2, "parked conversation") == "2 parked conversations"


# Machado, Oliveira and Fernandes (2009), severity 1: linear RGB as a protanope or a
# deuteranope sees it
MACHADO = {
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216),
                   (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413),
                     (-0.011820, 0.042940, 0.968881)),
}


def _lab(color: str, vision: str | None) -> tuple[float, float, float]:
    """CIELAB of an sRGB colour, as seen with ``vision`` (None: normal)."""
    srgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in srgb]
    if vision:
        lin = [min(max(sum(m * c for m, c in zip(row, lin, strict=True)), 0.0), 1.0)
               for row in MACHADO[vision]]
    xyz = [sum(m * c for m, c in zip(row, lin, strict=True)) / w for row, w in zip(
        ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505)),
        (0.95047, 1.0, 1.08883), strict=True)]
    f = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in xyz]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def test_the_key_colours_stay_apart_for_red_green_colour_blindness():
    from nbkv.ui.palette import RESTORED_COLOR, ROLE_COLORS, TODO_COLOR

    key_pairs = [  # drawn side by side, each pair in one chart
        (COLORS["reused"], COLORS["prefilled"]), (COLORS["reused"], COLORS["trimmed"]),
        (COLORS["prefilled"], COLORS["trimmed"]), (COLORS["reused"], COLORS["generated"]),
        (COLORS["prefilled"], TODO_COLOR), (REPLAYED_COLOR, COLORS["reused"]),
        (RESTORED_COLOR, COLORS["reused"]), (REPLAYED_COLOR, RESTORED_COLOR),
        (ROLE_COLORS["user"], ROLE_COLORS["assistant"]),
        (ROLE_COLORS["system"], ROLE_COLORS["user"]),
        (ROLE_COLORS["user"], COLORS["generated"]),
        (ROLE_COLORS["assistant"], COLORS["generated"])]
    for a, b in key_pairs:
        for vision in (None, "protanopia", "deuteranopia"):
            la, lb = _lab(a, vision), _lab(b, vision)
            delta = sum((x - y) ** 2 for x, y in zip(la, lb, strict=True)) ** 0.5
            assert delta >= 25, (a, b, vision, round(delta, 1))


def test_one_hatch_per_kind_of_event_and_mirror_images_never_both():
    shapes = {t.code: t.pattern for t in vocab.EVENTS.values()}
    assert shapes["copied"] != shapes["edited"]
    used = set(shapes.values())
    assert not {"/", "\\"} <= used  # a diagonal and its mirror look alike at bar size
    assert shapes["copied"] == shapes["shared"] != shapes["continued"]


def test_the_latest_replys_span_says_the_reply_not_generation_prompt():
    from nbkv.kv.slot_table import message_segments

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    segs = message_segments(msgs, [12, 20], 24, 20, 30, "Hello there.")
    merged = charts.messages(segs)
    assert [(s.start, s.end, s.preview) for s in merged][-1] == (20, 30, "Hello there.")
    waiting = message_segments(msgs, [12, 20], 24, 20, 24, "")  # no reply yet
    assert charts.messages(waiting)[-1].preview == "(generation prompt)"


def test_kvcache_slots_and_history_show_their_table_then_their_chart():
    from IPython.utils.capture import capture_output

    from conftest import ipython_shell
    from nbkv.ui.display import history_table

    ipython_shell()
    history = session()
    cells = {r.id: SimpleNamespace(label=f"[{r.id}]") for r in history}
    table = history_table(history, 4, cell_of=lambda r: cells.get(r.id))
    shown = chartfig.history_chart(table, history, 4, lambda r: cells.get(r.id))
    assert shown.rows == table.rows and str(shown) == str(table)  # the table reads through
    with capture_output() as cap:
        from IPython.display import display

        display(shown)
    first, chart = cap.outputs
    assert first.data["text/plain"].startswith("last 4 requests")  # the table, first
    fig = chart.data[chartfig.PLOTLY_MIME]
    assert fig["layout"]["xaxis"]["categoryarray"] == ["#3 [3]", "#4 [4]", "#5 [5]", "#6 [6]"]
    assert "image/png" in chart.data and "text/html" not in chart.data

    slots = chartfig.slots_chart("slots table", SimpleNamespace(
        n_ctx=1024, n_slots=1, history=history,
        slots=lambda: [SimpleNamespace(**{**vars(slot_after(history)), "last_request": 6})]))
    assert slots.figure["layout"]["yaxis"]["categoryarray"] == ["slot 0", "slot 0 · request"]
    assert str(slots) == "slots table"
    drawn = {t["meta"]["nbkv"] for t in slots.figure["data"]}
    assert {"system", "user", "assistant", "reused"} <= drawn  # messages, and the last request


def test_previews_kept_by_prefix_hash_are_those_of_the_messages():
    """A message's preview is kept by its prefix hash: the same text as computed afresh, and
    a changed message (a new hash) gets its own."""
    from nbkv.core.messages import prefix_hashes
    from nbkv.kv.slot_table import message_segments

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi " * 80}]
    fresh = message_segments(msgs, [12, 20], 24, 20, 30, "Hello.")
    keys = prefix_hashes(msgs)
    assert message_segments(msgs, [12, 20], 24, 20, 30, "Hello.", keys) == fresh
    assert message_segments(msgs, [12, 20], 24, 20, 30, "Hello.", keys) == fresh  # kept
    edited = [msgs[0], {"role": "user", "content": "Bye"}]
    again = message_segments(edited, [12, 20], 24, 20, 30, "Hello.", prefix_hashes(edited))
    assert again == message_segments(edited, [12, 20], 24, 20, 30, "Hello.")
    assert again[-3].preview == "Bye" != fresh[-3].preview
