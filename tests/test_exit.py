"""An engine left open at interpreter exit must not crash the process.

A script runs two sessions, saves, runs two more turns and ends without ``close()``: right
after a reply (its rewrite pending), right after a save, or while an autosave runs. Without
the ``atexit`` hook (nbkv.engine.native) the scheduler thread could still be inside llama.cpp while
Python tears down, and the process died with a segmentation fault after its last line (3
runs of 4 ending after a 64-token reply, with the hook unregistered).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import nbkv
    from nbkv.store.autosave import Autosaver

    mode, path = sys.argv[1], sys.argv[2]
    e = nbkv.Engine(n_slots=2, n_ctx=512, n_threads=1)
    conv = {s: [{"role": "system", "content": f"You are {s}."}] for s in ("ann", "bob")}

    def turn(s, text, n=3):
        conv[s].append({"role": "user", "content": text})
        r = e.chat(conv[s], session=s, max_tokens=n)
        conv[s].append({"role": "assistant", "content": r.text})

    for i in range(3):
        for s in conv:
            turn(s, f"Question {i}?")
    e.save(path)
    if mode == "save":
        print("end", flush=True)
        sys.exit(0)
    if mode == "autosave":
        saver = Autosaver(e, path, interval=0.0, quiet=0.0)
    for s in conv:  # long replies: their rewrite is still pending at the last line
        turn(s, "And then? Tell me the whole story.", 64)
    print("end", flush=True)  # autosave: its save of the last turn starts about now
""")

RESTORE = textwrap.dedent("""
    import sys
    import nbkv
    e = nbkv.Engine(n_slots=2, n_ctx=512, n_threads=1)
    rep = e.restore(sys.argv[1])
    assert len(rep.slots) == 2, rep
    assert all(v.identical for v in e.verify()), "restored KV differs from a fresh decode"
    e.close()
    print("restored", flush=True)
""")

MODES = ("reply",) * 7 + ("save",) * 7 + ("autosave",) * 6


@pytest.mark.slow
def test_unclosed_engines_exit_cleanly(tmp_path):
    def run(k: int) -> tuple[str, int, str]:
        d = tmp_path / f"save{k}"
        p = subprocess.run([sys.executable, "-c", SCRIPT, MODES[k], str(d)],
                           capture_output=True, text=True, timeout=300)
        return MODES[k], p.returncode, p.stdout + p.stderr[-2000:]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(len(MODES))))
    crashed = [(mode, rc, out) for mode, rc, out in results if rc != 0 or "end" not in out]
    assert not crashed, crashed
    for mode in ("reply", "save", "autosave"):
        k = MODES.index(mode)
        p = subprocess.run([sys.executable, "-c", RESTORE, str(tmp_path / f"save{k}")],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "restored" in p.stdout, (mode, p.stderr[-2000:])


VIEWS = textwrap.dedent("""
    import atexit, gc
    import comm
    import ipywidgets.widgets.widget as widget_module

    held = {}

    def teardown():  # what interpreter teardown does: module globals go, then the objects
        widget_module._instances = None
        comm._comm_manager = None  # it held every open comm, and through it its widget
        held.clear()
        gc.collect()

    atexit.register(teardown)  # registered first: runs after every other exit hook
    import nbkv
    from nbkv.ui.widgets import CacheDashboard, Conversations, KVMap, SlotCards, Timeline

    e = nbkv.Engine(n_slots=2, n_ctx=256, n_threads=1)
    views = [CacheDashboard(e), KVMap(e), SlotCards(e), Timeline(e), Conversations(e)]
    e.chat([{"role": "user", "content": "Hi"}], session="a", max_tokens=2)
    for v in views[:3]:  # as a cell run again closes its views; the others stay open
        v.close()
    held["views"] = views
    del views, v
    print("end", flush=True)
""")


def test_a_script_with_open_views_exits_without_a_word():
    """Every widget nbkv made (a view's parts, their layouts and styles included) is closed
    by the view's close() or, for a view still open, at exit while ipywidgets still works:
    none is left to close itself after its module's globals are gone (a traceback each)."""
    p = subprocess.run([sys.executable, "-c", VIEWS], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout == "end\n", p.stderr[-3000:]
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
