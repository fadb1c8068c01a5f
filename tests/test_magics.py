"""%kvcache and %%chat through a real IPython shell, on the real default model."""

from __future__ import annotations

import os
import re
import signal
from html import escape
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import nbkv
from conftest import assert_consistent, ipython_shell
from nbkv.core.events import Progress
from nbkv.notebook.sessions import STORE
from nbkv.ui import vocabulary
from nbkv.ui.figures import Figures, actions

SYSTEM = "You are a concise assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def ip():
    shell = ipython_shell()
    shell.run_line_magic("load_ext", "nbkv")
    shell.run_line_magic("config", "Nbkv.frontend = 'terminal'")
    shell.run_line_magic("config", "Nbkv.max_tokens = 8")
    STORE.clear()
    yield shell
    shell.run_line_magic("kvcache", "unload")
    shell.run_line_magic("unload_ext", "nbkv")
    shell.config.pop("Nbkv", None)  # the shell is shared by other test modules
    STORE.clear()


@pytest.fixture(scope="module")
def loaded(ip):
    ip.run_line_magic("kvcache", "load --slots 2 --ctx 1024")
    return ip


def chat(ip, line, body):
    return ip.run_cell_magic("chat", line, body)


def test_no_engine_says_how_to_load(ip):
    ip.run_line_magic("kvcache", "unload")
    with pytest.raises(UsageError, match="%kvcache load"):
        chat(ip, "", "hello")
    out = ip.run_line_magic("kvcache", "status")
    assert "%kvcache load" in str(out)


def test_unload_ext_unregisters_the_session_formatter(ip):
    from nbkv.notebook.sessions import Session

    html = ip.display_formatter.formatters["text/html"]
    assert Session in html.type_printers
    ip.run_line_magic("unload_ext", "nbkv")
    try:
        assert Session not in html.type_printers
        with pytest.raises(KeyError):
            html.lookup_by_type(Session)
    finally:
        ip.run_line_magic("load_ext", "nbkv")
    assert Session in html.type_printers


def test_autoload_loads_the_configured_default(ip, capsys):
    ip.run_line_magic("config", "Nbkv.autoload = True")
    ip.run_line_magic("config", "Nbkv.slots = 2")
    ip.run_line_magic("config", "Nbkv.ctx = 1024")
    try:
        chat(ip, "auto --max-tokens 4", "Say hi.")
    finally:
        ip.run_line_magic("config", "Nbkv.autoload = False")
    e = nbkv.current_engine()
    assert e is not None and e.n_slots == 2 and e.n_ctx == 1024
    s = nbkv.session("auto")
    assert s.messages[0] == {"role": "user", "content": "Say hi."}
    reply, rec = s.messages[1]["content"], s.records[-1]
    assert rec.generated_tokens <= 4 and e.history[-1] == rec
    out = capsys.readouterr().out
    # the loading progress (not a terminal: whole lines), then the reply and its figures line
    assert "loading SmolLM2-135M-Instruct (94 MiB): 0%\n" in out and "\r" not in out
    assert ": done in " in out
    # how it ended is said once, on the figures line
    assert out.endswith(reply + "\n" + Figures(rec).text() + "\n")


def test_conversation_continues_across_cells(loaded, capsys):
    chat(loaded, f'alice --new --system "{SYSTEM}"', "What is a CPU?")
    first = capsys.readouterr().out
    chat(loaded, "alice", "And what is memory?")
    out = capsys.readouterr().out
    s = nbkv.session("alice")
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user",
                                                "assistant"]
    assert s.messages[0]["content"] == SYSTEM  # quotes removed by the parser
    assert s.messages[2]["content"] and s.messages[2]["content"] in first
    r1, r2 = s.records
    assert r2.strategy == "hash-extend" and r2.slot == r1.slot
    # the first reply stayed in KV; cells run back to back (as here, or Run All), the rows of
    # it not yet rewritten are read again with the question instead (see exactness)
    assert r2.reused_tokens >= r1.prompt_tokens
    assert r2.reused_tokens + r2.rewrite_absorbed > r1.prompt_tokens
    assert r2.prefilled_tokens < 25
    assert first.endswith(Figures(r1).text() + "\n")
    # the figures line of the second turn, with this request's own numbers
    line = out.strip().splitlines()[-1]
    assert line == Figures(r2).text()
    fields = line.split(" · ")
    assert fields[0] == f"slot {r2.slot}: continued" and r2.reason == "continued"
    assert fields[1:3] == [f"reused {r2.reused_tokens}/{r2.prompt_tokens} "
                           f"({r2.salvage_pct:.0f}%)", f"read {r2.prefilled_tokens} new"]
    assert fields[3] == f"first token {r2.ttft_s * 1000:.0f} ms"
    # the first turn of a session says why nothing was reused, on a second line
    assert Figures(r1).text().endswith(f"\n  why: {r1.reason_text}") and r1.reason == "first"
    assert s.messages[4]["content"] and out.startswith(s.messages[4]["content"])


def test_new_starts_over_and_no_stats_hides_figures(loaded, capsys):
    chat(loaded, "alice --new --no-stats", "Name a colour.")
    out = capsys.readouterr().out
    s = nbkv.session("alice")
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]
    assert s.messages[0]["content"] == SYSTEM  # --new keeps the system prompt
    rec = s.records[-1]
    assert len(s.records) == 1 and rec.matched_messages == 1  # only the system prompt matched
    # no figures line: the ending is said after the reply, in the same words
    note = " [stopped at the token limit]" if rec.finish_reason == "length" else ""
    assert out == s.messages[2]["content"] + note + "\n"


def test_out_and_interpolation(loaded):
    loaded.user_ns["topic"] = "the moon"
    loaded.user_ns["n"] = 3
    chat(loaded, "bob --new --out answer --max-tokens 6", "Tell me {n} facts about {topic}. "
                                                          "Use {{braces}} literally.")
    s = nbkv.session("bob")
    assert s.messages[-2]["content"] == ("Tell me 3 facts about the moon. "
                                         "Use {braces} literally.")
    answer = loaded.user_ns["answer"]
    assert isinstance(answer, str) and answer == s.messages[-1]["content"]
    assert answer.record.session == "bob" and answer.record.generated_tokens <= 6
    assert answer.finish_reason in ("stop", "length")


def test_edited_message_is_salvaged(loaded):
    s = nbkv.session("alice")
    chat(loaded, "alice --no-stats", "And a fruit?")
    s.messages[3]["content"] = "And an animal?"  # edit the second user message
    chat(loaded, "alice --no-stats", "Thanks.")
    rec = s.records[-1]
    assert rec.strategy == "hash-extend" and 0 < rec.reused_tokens < rec.prompt_tokens
    assert rec.trimmed_tokens > 0  # the old turn after the edit was cut from the KV


@pytest.mark.parametrize("line, body, match", [
    ("--bogus", "hi", "unrecognized arguments"),
    ("--max-tokens x", "hi", "invalid int"),
    ("--max-tokens 0", "hi", "max-tokens"),
    ("--out 1x", "hi", "not a valid variable name"),
    ("--temp -1", "hi", "temperature"),
    ("", "   ", "cell is empty"),
    ("", "about {undefined_thing}", "undefined_thing"),
    ("", "json {\"a\": 1}", "literal braces"),
    ("--image no/such/cat.png", "what is this?", "no image file at"),
    ('--system "unclosed', "hi", "cannot parse"),
    ("--system You are a pirate", "hi", 'quote text with spaces: --system "You are a pirate"'),
])
def test_bad_chat_arguments_raise_usage_errors(loaded, line, body, match):
    with pytest.raises(UsageError, match=match):
        chat(loaded, line, body)


@pytest.mark.parametrize("line, match", [
    ("bogus", "invalid choice"),
    ("stats --slots 3", "does not take --slots"),
    ("slots 1", "takes no argument"),
    ("clear 9", "no slot 9"),
    ("clear x", "must be a number"),
    ("clear 0 --all", "not both"),
    ("load /nonexistent/model.gguf", "no model file"),
    ("load --mmproj no/such/proj.gguf", "no projector file"),
    ("load --template /nonexistent.jinja", "cannot read"),
    ("load --slots 0", "--slots must be at least 1, not 0"),  # not silently "the default"
    ("load --ctx 0", "--ctx must be at least 1, not 0"),
    ("load --min-tokens -1", "cache_min_tokens must be an integer >= 0, not -1"),
    ("load --gpu-layers -5", "n_gpu_layers must be an integer >= -1"),
    ("stats --slots 0", "does not take --slots"),  # 0 is given, though 0 == False
    ("clear", "name a slot .* or clear every slot with %kvcache clear --all"),
    ("history -n -3", "-n must be at least 1, not -3"),
    ("history -n 0", "-n must be at least 1, not 0"),
])
def test_bad_kvcache_arguments_raise_usage_errors(loaded, line, match):
    engine = nbkv.current_engine()
    held = [(s.session, s.tokens) for s in engine.slots()]
    with pytest.raises(UsageError, match=match):
        loaded.run_line_magic("kvcache", line)
    assert nbkv.current_engine() is engine  # a failed load keeps the engine
    assert [(s.session, s.tokens) for s in engine.slots()] == held  # a bare clear clears nothing


def test_a_refused_load_leaves_the_engine_working(loaded):
    engine = nbkv.current_engine()
    with pytest.raises(UsageError, match="--slots must be at least 1"):
        loaded.run_line_magic("kvcache", "load --slots 0")
    chat(loaded, "kept --new --no-stats --max-tokens 2", "Say hi.")
    assert nbkv.current_engine() is engine and engine.history[-1].session == "kept"


def rendered(table):
    """Every cell of a table as text, checked to appear in both its HTML and text forms."""
    html, text = table._repr_html_(), str(table)
    assert "<table" in html
    for row in table.rows:
        for cell in row:
            cell_html = cell.html if hasattr(cell, "html") else escape(str(cell))
            assert cell_html in html and str(cell) in text, cell
    return [tuple(str(c) for c in row) for row in table.rows]


def test_kvcache_commands_render_html_and_text(loaded):
    e = nbkv.current_engine()
    stats = e.stats()
    status = dict(rendered(loaded.run_line_magic("kvcache", "status")))
    assert rendered(loaded.run_line_magic("kvcache", "")) == list(status.items())
    # a known model's name, not GGUF general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2")
    assert status["model"].startswith("SmolLM2-135M-Instruct (135M parameters, Q4_1)")
    assert status["model"].endswith(e.model.path.name)
    assert status["memory"] == "plain (any trim is exact)" == e.memory.describe()
    assert status["slots"] == "2 x 1024 tokens"
    assert status["cache"] == f"imc (min {e.cache_min_tokens} tokens)"
    used = sum(s.n_tokens for s in e.slots())
    assert status["KV in use"] == f"{used}/2048 tokens"
    assert status["served from cache"] == (f"{stats['reused_tokens']}/{stats['prompt_tokens']} "
                                           f"prompt tokens ({stats['salvage_pct']:.0f}%)")
    assert "alice" in status["sessions"].split(", ")

    slots = rendered(loaded.run_line_magic("kvcache", "slots"))
    assert [row[:4] for row in slots] == [
        (str(s.index), s.session or "-", str(s.n_messages), f"{s.n_tokens}/{s.capacity}")
        for s in e.slots()]
    assert any(row[1] == "alice" for row in slots)
    assert [row[7] for row in slots] == ["-", "-"]  # plain attention: no checkpoints

    assert dict(rendered(loaded.run_line_magic("kvcache", "stats")))["requests"] == str(
        stats["requests"])

    history = rendered(loaded.run_line_magic("kvcache", "history -n 3"))
    last = e.history[-3:]
    assert [row[:6] for row in history] == [  # no cell: these cells ran with no cell id
        (str(r.id), r.session or "-", "-", vocabulary.event(r).words, str(r.slot),
         str(r.prompt_tokens)) for r in last]
    assert [row[12] for row in history] == [vocabulary.ending(r) for r in last]

    explained = loaded.run_line_magic("kvcache", f"explain {last[0].id}")
    assert explained.explanation.record is last[0]
    assert str(explained).startswith(f"request #{last[0].id} ")
    assert "nbkv-explain" in explained._repr_html_()
    assert loaded.run_line_magic("kvcache", "explain").explanation.record is e.history[-1]
    with pytest.raises(UsageError, match="request number"):
        loaded.run_line_magic("kvcache", "explain soon")

    verified = rendered(loaded.run_line_magic("kvcache", "verify"))
    assert verified and all(row[1] == "bit-identical to a from-scratch decode"
                            for row in verified)

    config = {row[0]: row[1] for row in rendered(loaded.run_line_magic("kvcache", "config"))}
    magics = loaded.magics_manager.registry["Nbkv"]
    assert config["Nbkv.slots"] == repr(magics.slots) and config["Nbkv.max_tokens"] == "8"

    assert str(loaded.run_line_magic("kvcache", "clear 1")).startswith("cleared slot 1")
    assert e.slots()[1].empty
    assert "cleared every idle slot" in str(loaded.run_line_magic("kvcache", "clear --all"))
    assert all(s.empty for s in e.slots())
    dash = loaded.run_line_magic("kvcache", "widget")
    try:
        assert type(dash).__name__ == "CacheDashboard" and dash.engine is e
    finally:
        dash.close()


def test_config_traits(loaded):
    loaded.run_line_magic("config", "Nbkv.max_tokens = 5")
    try:
        chat(loaded, "cfg --new --no-stats", "Count from one to twenty.")
        assert nbkv.session("cfg").records[-1].generated_tokens <= 5
    finally:
        loaded.run_line_magic("config", "Nbkv.max_tokens = 8")
    magics = loaded.magics_manager.registry["Nbkv"]
    loaded.run_line_magic("config", "Nbkv.slots = 0")  # %config logs the TraitError
    assert magics.slots == 2
    magics.refresh = 0.05
    with pytest.raises(ValueError, match="refresh must be >= 0"):
        magics.refresh = -1


def test_interrupt_keeps_partial_reply_and_next_cell_works(loaded, capsys):
    engine = nbkv.current_engine()
    sent = []

    def interrupt(event):
        if isinstance(event, Progress) and event.phase == "generate" and not sent:
            sent.append(event)
            os.kill(os.getpid(), signal.SIGINT)

    unsubscribe = engine.subscribe(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            chat(loaded, "carol --new --max-tokens 200 --out part",
                 "Write a long story about a dragon who learns to cook.")
    finally:
        unsubscribe()
    out = capsys.readouterr().out
    assert sent
    s = nbkv.session("carol")
    part = loaded.user_ns["part"]
    assert part.finish_reason == "cancelled" and 0 < part.record.generated_tokens < 200
    assert s.messages[-1] == {"role": "assistant", "content": str(part)}
    assert s.records[-1] == part.record
    # "interrupted" once: on the figures line
    assert out.endswith(f"{part}\n{Figures(part.record).text()}\n")
    assert Figures(part.record).text().count("interrupted") == 1
    # one line instead of a red traceback, and still an error that stops "Run All"
    n = part.record.generated_tokens
    assert stopped.value._render_traceback_() == [
        f"stopped here: the partial reply is kept ({n} tokens)"]
    assert_consistent(engine)
    chat(loaded, "carol --max-tokens 4", "Continue.")
    rec = s.records[-1]
    assert rec.finish_reason in ("stop", "length") and rec.strategy == "hash-extend"
    assert len(s.messages) == 4


def test_notebook_frontend_streams_markdown_with_progress(loaded):
    loaded.run_line_magic("config", "Nbkv.frontend = 'notebook'")
    long = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}."
                    for i in range(60))
    try:
        with capture_output() as cap:
            chat(loaded, "dave --new --max-tokens 6", long + "\nHow many facts?")
    finally:
        loaded.run_line_magic("config", "Nbkv.frontend = 'terminal'")
    outs = cap.outputs
    rec = nbkv.session("dave").records[-1]
    assert rec.prefilled_tokens > 256  # long enough to report progress
    progress = [o for o in outs if "text/html" in o.data and "nbkv-progress" in o.data["text/html"]]
    assert progress
    what = "extending" if rec.reused_tokens else "rebuilding"  # the slot's prefix was reused
    for o in progress:  # the prefill so far, out of this request's prefill
        m = re.fullmatch(what + r" the cache: prefilled (\d+)/(\d+) tokens \((\d+)%\)",
                         o.data["text/plain"])
        assert m, o.data["text/plain"]
        done, total, pct = map(int, m.groups())
        assert 0 < done < total == rec.prefilled_tokens and pct == round(100 * done / total)
    md = [o for o in outs if "text/markdown" in o.data]
    reply = nbkv.session("dave").messages[-1]["content"]
    assert md and md[-1].data["text/markdown"] == reply  # the figures line says it stopped
    assert outs.index(progress[-1]) < outs.index(md[0])  # progress, then the reply
    assert all(o.update for o in progress + md)  # one display, updated in place
    fig = outs[-1].data
    assert fig["text/plain"] == Figures(rec).text()
    assert fig["text/html"] == Figures(rec)._repr_html_()


def test_loading_again_replaces_the_engine(loaded, capsys):
    old = nbkv.current_engine()
    loaded.run_line_magic("kvcache", "load --slots 1 --ctx 512 --mode spc --min-tokens 10")
    new = nbkv.current_engine()
    assert new is not old and old.closed
    assert (new.n_slots, new.n_ctx, new.cache, new.cache_min_tokens) == (1, 512, "spc", 10)
    chat(loaded, "alice --no-stats --max-tokens 4", "One more?")  # sessions outlive engines
    assert nbkv.session("alice").records[-1].strategy in ("miss", "spc")
    out = capsys.readouterr().out
    assert "loading SmolLM2-135M-Instruct (94 MiB)" in out and ": done in " in out
    assert len(nbkv.session("alice").records[-1].segments) > 0


def _png(path, seed=0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    return path


def test_images_need_a_projector(loaded, tmp_path):
    img = _png(tmp_path / "pic.png")
    with pytest.raises(UsageError, match="vision projector: load one with %kvcache load "
                                         r"\[MODEL\] --mmproj"):
        chat(loaded, f"alice --image {img}", "What is this?")


def test_reloading_says_so_and_the_memory_note_tells_the_truth(loaded, capsys):
    """The next turn after %kvcache load says the engine was reloaded; past the model's
    trained context a warning; the sizing note is computed from the plan."""
    chat(loaded, "rita --new --no-stats --max-tokens 2", "Hello.")
    magics = loaded.magics_manager.registry["Nbkv"]
    slots, magics.slots = magics.slots, None  # left to the memory plan
    try:
        loaded.run_line_magic("kvcache", "load --ctx 8448")
    finally:
        magics.slots = slots
    out = capsys.readouterr().out
    e = nbkv.current_engine()
    share = 100 * e.plan.total / 2**30
    assert re.search(rf"picked slots: {e.n_slots} slots x 8448 tokens take \d+\.\d MiB of KV, "
                     r"\d+% of the [\d.]+ GiB of free RAM", out), out
    assert share > 0 and "at most a quarter" not in out
    assert f"past the {e.model.n_ctx_train} this model was trained for" in out
    chat(loaded, "rita --max-tokens 2", "Again.")
    out = capsys.readouterr().out
    rec = nbkv.session("rita").records[-1]
    assert rec.reason == "reloaded" and f"slot {rec.slot}: engine reloaded · " in out
    assert "nothing of session rita was cached" not in out
    loaded.run_line_magic("kvcache", "load --slots 2 --ctx 1024")


def test_images_through_the_magics(loaded, tmp_path):
    from nbkv.fixtures import make_mmproj
    from nbkv.ui.display import slots_table

    proj = make_mmproj(kind="tiny")
    img = _png(tmp_path / "pic.png")
    loaded.run_line_magic("kvcache", f"load --mmproj {proj} --slots 1 --ctx 1024")
    try:
        chat(loaded, f"eve --new --image {img} --max-tokens 4 --no-stats", "Describe it.")
        chat(loaded, "eve --max-tokens 4 --no-stats", "Shorter?")
        s = nbkv.session("eve")
        first, second = s.records
        assert first.media_chunks == 1 and first.encoder_runs == 1
        assert second.media_chunks == 1 and second.media_reused == 1
        assert second.strategy == "hash-extend" and second.encoder_runs == 0
        assert s.messages[0]["content"][0]["type"] == "image_url"
        slot = nbkv.current_engine().slots()[second.slot]
        assert slot.n_media == 1
        images = [seg for seg in slot.segments if seg.kind == "image"]
        assert [(seg.length, seg.state) for seg in images] == [(16, "reused")]
        assert images[0].image_name == "pic.png"  # hover names the file, not a hash
        from nbkv.ui.views import thumbnail_html

        thumb = thumbnail_html(s.messages[0]["content"][0])
        assert 'src="data:image/png;base64,' in thumb and "pic.png</figcaption>" in thumb
        strip = slots_table(nbkv.current_engine()).rows[second.slot][-1].text
        assert "I" in strip and "i" not in strip  # the image span, reused by the last turn
        # a Markdown image in the cell body is an image too, in its place in the text
        chat(loaded, "md --new --max-tokens 4 --no-stats", f"Look: ![a cat]({img}) What is it?")
        md = nbkv.session("md")
        parts = md.messages[0]["content"]
        assert [p["type"] for p in parts] == ["text", "image_url", "text"]
        assert md.records[0].encoder_runs == 0 and md.records[0].embedding_cache_hits == 1
        with pytest.raises(UsageError, match="not fetched from the network"):
            chat(loaded, "md", "![x](https://example.com/cat.png)")
    finally:
        loaded.run_line_magic("kvcache", "load --slots 2 --ctx 1024")


def test_figures_say_what_happened_in_plain_words():
    from nbkv.core.events import RequestRecord

    base = dict(id=1, session="s", strategy="hash-extend", slot=0, prompt_tokens=200,
                reused_tokens=180, prefilled_tokens=20, trimmed_tokens=0)
    parts = Figures(RequestRecord(**base, reason="checkpoint", reason_text="x",
                                  checkpoint_pos=180, reprefilled_tokens=6)).text()
    assert parts.startswith("slot 0: checkpoint restored · ") and "why: x" in parts
    parts = Figures(RequestRecord(**base, reprefilled_tokens=40)).text().split(" · ")
    assert "re-read 40" in parts
    took = RequestRecord(**base, donor_slot=1, donor_session="alice", evicted_session="carol",
                         evicted_tokens=164, finish_reason="length", reason="copied",
                         ttft_s=0.5, wait_s=0.1, prefill_s=0.4, rewrite_absorbed=10,
                         rewrite_absorbed_s=0.15, first_decode_s=0.002)
    parts = Figures(took).text().split(" · ")
    assert parts[0] == "slot 0: copied prefix from alice's slot"
    assert parts[1] == "took carol's slot (164 tokens gone)"
    assert parts[-1] == "stopped at the token limit"
    html = Figures(took)._repr_html_()
    assert 'title="carol&#x27;s cached conversation was dropped to make room"' in html
    # a long line wraps between fields, never inside one
    fields = re.findall(r'<span class="nbkv-field" title="[^"]*" style="([^"]*)">', html)
    assert len(fields) == len(actions(took))
    assert all("white-space:nowrap" in style for style in fields)
    # the first token's time explains itself: its parts add up to it
    assert ("first token 500 ms = waited (for a free slot, or the step in progress: e.g. the "
            "rewrite of the previous reply) 100 ms + restored 0 ms + re-read the previous reply "
            "(10 tokens, its rewrite had not run yet) 150 ms + read the prompt (10 new "
            "tokens) 248 ms + first token 2 ms") in html.replace("time from the request to "
                                                               "the first reply token: ",
                                                               "first token ")


def test_slots_table_counts_checkpoints_and_marks_them_on_the_kv_strip():
    from types import SimpleNamespace

    from nbkv.core.events import Segment
    from nbkv.engine.facade import SlotInfo
    from nbkv.kv.slot_kv import MemoryInfo
    from nbkv.kv.slot_table import Conversation
    from nbkv.ui.display import slots_table

    segs = (Segment(0, 40, 0, "system", "reused", "Be brief."),
            Segment(40, 60, 1, "user", "reused", "Hi"),
            Segment(60, 80, 2, "assistant", "reused", "Hello."),
            Segment(80, 100, 3, "user", "prefilled", "More?"))
    hybrid = SlotInfo(0, 0, 512, Conversation("a", tuple(range(100)), ("h",) * 4,
                                              (40, 60, 80, 100), segs, 2, settled=0,
                                              checkpoints=(60, 80, 100)),
                      False, checkpoint_bytes=3 * 1100, memory="hybrid")
    empty = SlotInfo(1, 1, 512, Conversation(None, settled=0), False, memory="hybrid")
    engine = SimpleNamespace(slots=lambda: (hybrid, empty),
                             memory=MemoryInfo("hybrid", can_trim=False))
    table = slots_table(engine)
    assert table.columns[7] == "checkpoints" and table.columns[8] == "KV map (positions 0–125)"
    assert [str(r[7]) for r in table.rows] == ["3 (3.2 KiB)", "0"]
    assert "| = checkpoint" in table.note
    strip = table.rows[0][8]
    # 48 columns over 125 positions: S x15, U x8, A x8, u x8; each tick where its position
    # starts (the assistant's first column, the last user message's, just past the end)
    assert strip.text == "[" + "S" * 15 + "U" * 8 + "|" + "A" * 7 + "|" + "u" * 7 + "|" \
        + "." * 8 + "]"
    ticks = re.findall(r'class="nbkv-checkpoint" title="checkpoint at (\d+)" '
                       r'style="position:absolute;top:0;left:([\d.]+)%', strip.html)
    assert ticks == [("60", "48.00"), ("80", "64.00"), ("100", "80.00")]
    assert 'class="nbkv-kvstrip" style="position:relative;' in strip.html
    assert "nbkv-checkpoint" not in table.rows[1][8].html and "|" not in table.rows[1][8].text
    # plain attention: the column says "-" and the note has no checkpoint legend
    plain = slots_table(SimpleNamespace(slots=lambda: (empty,), memory=MemoryInfo("plain")))
    assert str(plain.rows[0][7]) == "-" and "checkpoint" not in plain.note


def test_report_writes_one_self_contained_page(loaded, tmp_path):
    chat(loaded, "rose --new --no-stats --max-tokens 2", "Hello.")
    out = loaded.run_line_magic("kvcache", f"report {tmp_path / 'cache.html'}")
    assert str(out).startswith(f"wrote {tmp_path / 'cache.html'} (")
    page = (tmp_path / "cache.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "nbkv-dashboard-static" in page
    assert "nbkv-kvmap-svg" in page and "nbkv-timeline-svg" in page
    assert "last " in page and "nbkv-explain" in page  # history, and the latest explained
    # nothing from elsewhere: no script, no stylesheet, no remote image or font
    assert "<script" not in page and not re.search(r'(src|href)="(https?:)?//', page)
    inline = loaded.run_line_magic("kvcache", "report")  # no FILE: shown in the notebook
    assert "nbkv-dashboard-static" in inline._repr_html_()
    assert nbkv.report().engine is nbkv.current_engine()


def _unloadable_gguf(path):
    """A whole, well-formed GGUF file of an architecture llama.cpp does not know."""
    import gguf

    w = gguf.GGUFWriter(str(path), "nbkv-unknown")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_failed_load_leaves_the_engine_serving_with_its_caches(loaded, tmp_path, model_path):
    """Issue 32: a truncated model whose magic is valid, a --park-dir under a file and a bad
    --template are refused before the loaded engine is closed; its slots stay as they were."""
    chat(loaded, "keeper --new --no-stats --max-tokens 2", "Say hi.")
    engine = nbkv.current_engine()
    engine.settle()  # the reply's rewrite done: nothing changes the slots on its own
    before = engine.slots()
    data = open(model_path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])  # header and magic intact, weights cut short
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    for line, match in [(f"load {cut}", "not a whole GGUF file: truncated"),
                        (f"load --slots 2 --ctx 1024 --park-dir {afile}/parked",
                         f"lies under the file {afile}"),
                        (f"load --slots 2 --ctx 1024 --park-dir {afile}", "is a file"),
                        (f"load --slots 2 --ctx 1024 --template {bad}", "does not compile")]:
        with pytest.raises(UsageError, match=match):
            loaded.run_line_magic("kvcache", line)
        assert nbkv.current_engine() is engine and not engine.closed, line
        assert engine.slots() == before, line
    with pytest.raises(UsageError, match=f"cannot write it there: {afile} is a file"):
        loaded.run_line_magic("kvcache", f"report {afile}/page.html")
    chat(loaded, "keeper --no-stats --max-tokens 2", "Again.")
    assert nbkv.session("keeper").records[-1].reason == "continued"


def test_a_load_that_fails_in_llama_cpp_brings_the_previous_engine_back(loaded, tmp_path):
    chat(loaded, "kept2 --new --no-stats --max-tokens 2", "Say hi.")
    old = nbkv.current_engine()
    unknown = _unloadable_gguf(tmp_path / "unknown.gguf")
    with pytest.raises(UsageError, match="could not load .*; the previous engine was loaded "
                                         "again"):
        loaded.run_line_magic("kvcache", f"load {unknown} --slots 2 --ctx 1024")
    new = nbkv.current_engine()
    assert new is not None and new is not old and old.closed and not new.closed
    assert (new.n_slots, new.n_ctx, Path(new.model.path).resolve()) == (
        old.n_slots, old.n_ctx, Path(old.model.path).resolve())  # (.venv may be a symlink)
    chat(loaded, "kept2 --no-stats --max-tokens 2", "Again.")
    assert nbkv.session("kept2").records[-1].reason == "reloaded"


def test_loading_again_with_the_same_settings_keeps_the_engine(loaded, capsys):
    loaded.run_line_magic("kvcache", "load --slots 2 --ctx 1024")
    engine = nbkv.current_engine()
    chat(loaded, "kim --new --no-stats --max-tokens 2", "Hello.")
    capsys.readouterr()
    out = loaded.run_line_magic("kvcache", "load --slots 2 --ctx 1024")
    assert nbkv.current_engine() is engine and not engine.closed
    assert str(out).startswith("kept the loaded engine: same model and settings, so its "
                               "caches stay (")
    assert "%kvcache load --reload starts afresh" in str(out)
    assert "loading" not in capsys.readouterr().out  # no model load
    chat(loaded, "kim --no-stats --max-tokens 2", "Again.")
    assert nbkv.session("kim").records[-1].reason == "continued"
    loaded.run_line_magic("kvcache", "load --slots 2 --ctx 1024 --reload")
    assert nbkv.current_engine() is not engine and engine.closed
    chat(loaded, "kim --no-stats --max-tokens 2", "Once more.")
    assert nbkv.session("kim").records[-1].reason == "reloaded"


def test_load_ext_again_is_quiet(ip, capsys):
    """ "Run All" a second time runs %load_ext nbkv again: nothing to say, nothing changes."""
    capsys.readouterr()
    ip.run_line_magic("load_ext", "nbkv")
    assert capsys.readouterr().out == ""
    assert "kvcache" in ip.magics_manager.magics["line"]


def test_a_cell_run_again_closes_the_views_its_last_run_made(loaded, monkeypatch):
    """A re-run cell's old outputs are gone: their widgets would go on following the engine
    (and be sent again on a page reload); they are closed, the other cells' are not."""
    import comm

    from conftest import QuietComm

    monkeypatch.setattr(comm, "create_comm", lambda **kw: QuietComm())
    src = "from nbkv.ui.widgets import KVMap\nm = KVMap(nbkv.current_engine())"
    loaded.run_cell("import nbkv")
    loaded.run_cell(src, cell_id="views-1")
    first = loaded.user_ns["m"]
    loaded.run_cell(src.replace("m =", "other ="), cell_id="views-2")
    other = loaded.user_ns["other"]
    assert not first.feed._stop.is_set()
    loaded.run_cell(src, cell_id="views-1")  # the same cell again
    second = loaded.user_ns["m"]
    assert second is not first and first.feed._stop.is_set() and first.comm is None
    assert not second.feed._stop.is_set() and not other.feed._stop.is_set()
    loaded.run_cell(src)  # no cell id (a terminal, nbval): nothing is closed
    assert not second.feed._stop.is_set()
    for w in (second, other, loaded.user_ns["m"]):
        w.close()
