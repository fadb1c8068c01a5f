"""A load says what it does while it runs, and what Binder's postBuild calibrated is reused.

The real model, calibrated once into a private cache directory (a few seconds); the rest are
cached loads and pure functions.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap

import pytest

from nbkv import Engine
from nbkv.core.progress import PlainLines, Step, Task, TerminalLine, resolve, silent
from nbkv.kv import calibrate
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.cpus import cpu_budget
from nbkv.llama.hardware import FLASH_ATTN
from nbkv.ui.display import status_table


class Recorder:
    def __init__(self):
        self.steps = []

    def __call__(self, step):
        self.steps.append(step)

    def texts(self, prefix):
        return [s.text() for s in self.steps if s.what.startswith(prefix) and not s.final]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A calibration cache of its own, filled by a first load of 2 slots (measured)."""
    d = tmp_path_factory.mktemp("nbkv-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("NBKV_CACHE_DIR", str(d))
    rec = Recorder()
    # one thread: the others reuse it with theirs (threads are not in the key), and on a
    # crowded machine 2 spinning threads per engine make a calibration many times slower
    with Engine(n_slots=2, n_ctx=512, n_threads=1, progress=rec) as e:
        rule = e.prefill_rule
    yield d, rec, rule
    mp.undo()


def test_a_fresh_load_says_what_it_does_and_why(cache):
    _, rec, rule = cache
    assert rule.exact
    loads = rec.texts("loading SmolLM2-135M-Instruct")
    assert loads and "0%" in loads[0] and "100%" in loads[-1]
    assert any("then its KV cache: 2 slots x 512 tokens" in t for t in loads)
    checks = [s for s in rec.steps if s.what == calibrate.WHAT]
    total = calibrate.steps(2)
    assert checks[0].done == 0 and checks[0].total == total and checks[0].why == calibrate.WHY
    assert checks[-1].final and max(s.done for s in checks) == total
    dones = [s.done for s in checks]
    assert dones == sorted(dones)  # the bar never goes back
    assert checks[1].text().startswith(
        "checking which prefill groupings are exact on this CPU (once per model, llama.cpp "
        "build and CPU): ")
    order = [s.what.split(" (")[0].split(",")[0] for s in rec.steps]
    assert order.index(calibrate.WHAT) > order.index("loading SmolLM2-135M-Instruct")


def test_a_launch_loads_what_postbuild_calibrated(cache, monkeypatch, capsys):
    """Binder's postBuild runs ``python -m nbkv.kv.calibrate``; the notebooks' loads then
    measure nothing, whatever their n_ctx, slot count up to the one calibrated, or threads."""
    assert calibrate.main(["--slots", "2"]) == 0  # already cached by the first load
    assert "exact: yes" in capsys.readouterr().out

    def no(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(calibrate, "measure", no)
    rec = Recorder()
    for slots, ctx, threads in ((2, 2048, None), (1, 1024, 1), (2, 256, 3)):
        with Engine(n_slots=slots, n_ctx=ctx, n_threads=threads, progress=rec) as e:
            assert e.prefill_rule.exact and e.prefill_rule.gen_rows == 0
            row = dict(r[:2] for r in status_table(e).rows)["threads"]
            budget = cpu_budget()
            assert e.n_threads == (threads or budget.threads)
            assert row == (budget.describe() if e.n_threads == budget.threads else
                           f"{threads} (n_threads; this process may use {budget.describe()})")
    assert not [s for s in rec.steps if s.what == calibrate.WHAT]


def test_more_slots_than_calibrated_measure_the_generation_test_only(cache, monkeypatch):
    def no(*a, **k):
        raise AssertionError("measured the grouping again")

    monkeypatch.setattr(calibrate, "_grouping", no)
    rec = Recorder()
    with Engine(n_slots=3, n_ctx=256, n_threads=1, progress=rec) as e:
        assert e.prefill_rule.exact
    checks = [s for s in rec.steps if s.what == calibrate.WHAT]
    assert checks and checks[0].total == calibrate.steps(3) - calibrate.steps(1)
    found = calibrate.cached_entry(next(iter(calibrate._read(cache[0] / calibrate.FILE))),
                                   cache[0] / calibrate.FILE)
    assert found is not None and found[1] == 3


def test_what_the_calibration_key_holds():
    base = {"n_threads": 4, "flash_attn": FLASH_ATTN["off"], "type_k": 1, "type_v": 1}
    key = calibrate.key_settings(base, True, 0)
    assert "n_threads" not in key and "n_ctx" not in key and "n_seq" not in key
    assert key == calibrate.key_settings({**base, "n_threads": 1}, True, 0)
    assert key != calibrate.key_settings(base, False, 0)
    on = calibrate.key_settings({**base, "flash_attn": FLASH_ATTN["on"]}, True, 0)
    assert on["n_threads"] == 4  # the flash-attention kernel splits a cache by threads


def test_a_measurement_answers_for_other_slot_counts():
    rule = PrefillRule(2, 1)
    fs = calibrate.for_sequences
    assert fs(rule, 1, 1).gen_rows == 0
    assert fs(rule, 1, 2) is None  # never tried two sequences in one decode
    assert fs(rule, 2, 2).gen_rows == 0 and fs(rule, 2, 3) is None
    assert fs(rule, 8, 8).gen_rows == 0
    assert fs(PrefillRule(2, 1, gen_rows=8), 8, 20).gen_rows == 8  # capped as measured
    failed = PrefillRule(2, 1, gen_rows=2)  # 3 sequences in one decode differed
    assert fs(failed, 5, 2).gen_rows == 0 and fs(failed, 5, 3).gen_rows == 2
    assert fs(failed, 5, 9).gen_rows == 2
    inexact = PrefillRule(2, 1, exact=False, reason="x")
    assert fs(inexact, 1, 9) is inexact
    assert calibrate.tested(1) == 1 and calibrate.tested(3) == 3 and calibrate.tested(20) == 8


def test_steps_in_words():
    assert Step("checking", "once", 3, 6).text() == "checking (once): 3 of 6"
    assert Step("loading x", done=45, total=100, unit="%").text() == "loading x: 45%"
    assert Step("saving", done=12.5, total=80, unit="MiB", elapsed=3.2).text() == \
        "saving: 12.5 of 80.0 MiB · 3 s"
    assert Step("starting llama-server", elapsed=4.4).text() == "starting llama-server: 4 s"
    assert resolve(False) is silent and resolve(print) is print


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_line_is_rewritten_then_cleared():
    out = Terminal()
    line = TerminalLine(out, interval=0)
    with Task(line, "loading", total=2) as t:
        t.advance()
        t.advance()
    text = out.getvalue()
    assert "\rloading: 1 of 2" in text and "\rloading: 2 of 2" in text
    assert text.endswith("\r") and "\n" not in text


def test_a_terminal_line_on_a_stream_that_is_not_a_terminal_writes_plain_lines():
    """A child process's captured stderr, a log file: one whole line per step, no ``\\r``."""
    out = io.StringIO()
    with Task(TerminalLine(out, interval=0), "loading x", total=100, unit="%") as t:
        t.update(0)
        t.update(50)
        t.update(90, what="loading x, then its KV cache")
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[:2] == ["loading x: 0%", "loading x, then its KV cache: 90%"]
    assert lines[2].startswith("loading x, then its KV cache: done in ") and len(lines) == 3


def test_plain_lines_for_logs():
    out = io.StringIO()
    with Task(PlainLines(out, every=3600), "building", total=100, unit="%") as t:
        for p in range(0, 101, 10):
            t.update(p)
        t.update(100, what="building, compiling")
    lines = out.getvalue().splitlines()
    assert lines[0] == "building: 0%" and lines[1] == "building, compiling: 100%"
    assert lines[2].startswith("building, compiling: done in ") and len(lines) == 3


def test_a_reporter_that_fails_does_not_stop_the_work():
    def broken(step):
        raise RuntimeError("display gone")

    with Task(broken, "x", total=1) as t:
        t.advance()
    assert t.step.done == 1


def test_llama_cpp_warnings_go_to_the_logger_not_to_stderr():
    """libmtmd warns on every Qwen-VL projector; with no logging set up (a kernel), that
    must not reach stderr, which a notebook shows in the cell."""
    code = textwrap.dedent("""
        import logging
        from nbkv.llama import backend
        backend.log_callback(3, b"load_hparams: Qwen-VL models require at minimum 1024 "
                                b"image tokens\\n", None)
        logging.getLogger("nbkv.llama").warning("a warning of llama.cpp's")
        logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
        backend.log_callback(3, b"seen once logging is set up\\n", None)
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "LOG seen once logging is set up"


def test_a_big_save_and_restore_show_their_bytes(cache, tmp_path, monkeypatch):
    from nbkv.notebook.sessions import SessionStore
    from nbkv.store import persist

    monkeypatch.setattr(persist, "SHOWN", 1)  # every save counts as big here
    with Engine(n_slots=1, n_ctx=512, n_threads=1, progress=False) as e:
        e.chat([{"role": "user", "content": "Hi"}], session="a", max_tokens=2)
        rec = Recorder()
        e.save(tmp_path / "s", SessionStore(), progress=rec)
        saving = [s for s in rec.steps if s.what.startswith("saving to ")]
        assert saving[0].unit == "MiB" and saving[-1].final
        assert saving[-1].done == pytest.approx(saving[0].total)
        rec = Recorder()
        e.restore(tmp_path / "s", SessionStore(), progress=rec)
        reading = [s for s in rec.steps if s.what.startswith("reading and checking the save")]
        assert reading and reading[-1].final and reading[-1].done == pytest.approx(
            reading[0].total)
        monkeypatch.setattr(persist, "SHOWN", 1 << 40)  # a small save shows nothing
        rec = Recorder()
        e.save(tmp_path / "s", SessionStore(), progress=rec)
        assert not rec.steps


def test_the_llama_server_build_reports_the_compile_percentage(tmp_path):
    from nbkv.core.errors import ServerError
    from nbkv.remote import build

    seen = []
    script = ("print('-- Configuring'); print('[ 10%] Building C object a.o'); "
              "print('[3/6] Building CXX object b.o'); print('[100%] Linking llama-server')")
    build._run([sys.executable, "-c", script], tmp_path / "log", seen.append)
    assert seen == [10, 50, 100] and "Linking" in (tmp_path / "log").read_text()
    with pytest.raises(ServerError, match=r"(?s)failed \(exit 3\).*the end of its output"):
        build._run([sys.executable, "-c", "print('the end of its output'); exit(3)"],
                   tmp_path / "log")


def test_a_built_llama_server_is_found_and_not_built_again(tmp_path, monkeypatch):
    from nbkv.remote import build, server

    target = build.target(tmp_path)
    assert target == tmp_path / f"llama-server-{build.version()}" / "llama-server"
    target.parent.mkdir()
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    assert build.build(tmp_path) == target  # there already: nothing downloaded or built
    monkeypatch.delenv("NBKV_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # where postBuild puts it on Binder
    assert server.binary() == target
    monkeypatch.setenv("NBKV_LLAMA_SERVER", str(tmp_path / "missing"))
    assert server.binary() is None
    with pytest.raises(Exception, match="python -m nbkv.remote.build"):
        server.LlamaServer()


@pytest.mark.slow
def test_in_a_kernel_an_engine_made_in_a_cell_draws_its_bar_in_that_cell(tmp_path, monkeypatch):
    """What 02 and 04 do (``Engine(...)`` in a cell after ``%load_ext nbkv``): the load and
    a fresh calibration update one output of that cell (text too, for saved notebooks)."""
    from test_cells import Kernel

    monkeypatch.setenv("NBKV_CACHE_DIR", str(tmp_path))
    k = Kernel()
    try:
        k.run("%load_ext nbkv")
        _, out = k.run("from nbkv import Engine\n"
                       "e = Engine(n_slots=1, n_ctx=256, n_threads=1)\ne.close()")
    finally:
        k.close()
    assert "loading SmolLM2-135M-Instruct (94 MiB)" in out
    lines = [s for s in out.splitlines() if s.startswith(calibrate.WHAT)]
    # drawn while it runs (how far it got by the first draw depends on the machine: a
    # grouping that differs stops at its first differing chunk, so a step can take < 1 s)
    first = re.search(r"\(once per model, llama.cpp build and CPU\): (\d+) of (\d+)", lines[0])
    assert first and int(first[1]) < int(first[2]) == calibrate.steps(1), lines
    assert any(f": {calibrate.steps(1)} of {calibrate.steps(1)}" in s for s in lines)


def test_a_terminal_chat_view_draws_progress_only_on_a_terminal():
    from nbkv.ui.views import TerminalChatView

    for out, drawn in ((io.StringIO(), False), (Terminal(), True)):
        view = TerminalChatView(out)
        view.progress("prefill", 10, 100)
        view.delta("Hello")
        assert ("\r" in out.getvalue()) is drawn
        assert out.getvalue().replace("\r", " ").strip().endswith("Hello")
