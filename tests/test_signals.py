"""SIGTERM and SIGHUP close what nbkv holds, then end the process as they would have.

A child process with a ``park_dir`` and five conversations is sent SIGTERM: it spills them
(the next engine adopts 5 of 5, as after Ctrl-C) and still dies by SIGTERM. The handler is
checked without a model too: it chains to the handler that was there, leaves an ignored
signal alone, and the handlers found are restored when the last engine closes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbkv import Engine

HERE = Path(__file__).parent

HOLDER = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from nbkv.core.signals import close_on_signal, release

    out = Path(sys.argv[1])
    if sys.argv[2] == "chain":
        signal.signal(signal.SIGTERM, lambda s, f: (out.open("a").write("theirs\\n"),
                                                    sys.exit(7)))
    elif sys.argv[2] == "ignored":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    class Held:
        def close(self):  # as Engine.close: the last release restores the handlers
            out.open("a").write("closed\\n")
            release(self)

    held = Held()
    close_on_signal(held)
    print("ready", flush=True)
    time.sleep(60)
    print("survived", flush=True)
""")


def started(code: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), *sys.path]))
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)  # the test's key
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.poll() is not None else "")
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_closes_what_is_held_then_ends_the_process_by_it(tmp_path, sig):
    out = tmp_path / "log"
    p = started(HOLDER, str(out), "plain")
    p.send_signal(sig)
    assert p.wait(30) == -sig  # the default action, taken again
    assert out.read_text() == "closed\n"


def test_a_handler_that_was_there_is_called_after_the_close(tmp_path):
    out = tmp_path / "log"
    p = started(HOLDER, str(out), "chain")
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 7
    assert out.read_text() == "closed\ntheirs\n"


def test_an_ignored_signal_stays_ignored(tmp_path):
    out = tmp_path / "log"
    p = started(HOLDER, str(out), "ignored")
    p.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert p.poll() is None and not out.exists()  # nohup's choice holds
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM and out.read_text() == "closed\n"


RESTORED = textwrap.dedent("""
    import signal
    from nbkv.core import signals

    def mine(s, f):
        pass

    signal.signal(signal.SIGHUP, mine)

    class Held:
        def close(self):
            pass

    a, b = Held(), Held()
    signals.close_on_signal(a)
    signals.close_on_signal(b)
    assert set(signals.installed()) == {signal.SIGTERM, signal.SIGHUP}
    signals.release(a)
    assert set(signals.installed()) == {signal.SIGTERM, signal.SIGHUP}
    signals.release(b)
    assert signals.installed() == ()
    assert signal.getsignal(signal.SIGHUP) is mine
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    print("ready", flush=True)
""")


def test_the_handlers_found_are_restored_when_the_last_one_is_released():
    p = started(RESTORED)  # in a process of its own: engines of other tests hold them here
    assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""


SPILLER = textwrap.dedent("""
    import sys, time
    import nbkv

    e = nbkv.Engine(n_slots=2, n_ctx=512, n_threads=1, park_dir=sys.argv[1])
    for i in range(5):
        e.chat([{"role": "system", "content": f"You are helper number {i}."},
                {"role": "user", "content": "Hello?"}], session=f"s{i}", max_tokens=2)
    print("ready", flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_a_terminated_process_spills_its_conversations_for_the_next_engine(tmp_path, sig):
    p = started(SPILLER, str(tmp_path))
    p.send_signal(sig)
    assert p.wait(120) == -sig, p.stderr.read()[-2000:] if p.stderr else ""
    with Engine(n_slots=2, n_ctx=512, n_threads=1, park_dir=str(tmp_path)) as e:
        assert e.parking is not None and e.parking.stats()["adopted"] == 5
        assert sorted(i.session for i in e.parked()) == [f"s{i}" for i in range(5)]


def test_a_kernel_terminated_by_its_manager_spills_its_conversations(tmp_path):
    """What Jupyter does to a kernel that does not shut down in time: SIGTERM (to its
    process group). The kernel's engine spills, as a script's does."""
    pytest.importorskip("ipykernel")
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), *sys.path]))
    km.start_kernel(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(60)
        code = SPILLER.replace("sys.argv[1]", repr(str(tmp_path))).replace(
            "time.sleep(120)", "")
        reply = kc.execute_interactive(code, timeout=120, store_history=False,
                                       output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]
        km.signal_kernel(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while km.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not km.is_alive()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    with Engine(n_slots=2, n_ctx=512, n_threads=1, park_dir=str(tmp_path)) as e:
        assert e.parking is not None and e.parking.stats()["adopted"] == 5
