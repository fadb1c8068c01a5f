"""No llama-server outlives the process that started it, whatever signal ends that process.

A child Python starts a :class:`LlamaServer` (or runs ``python -m nbkv.remote.server``) and is
sent SIGTERM, SIGHUP or SIGKILL: the server's PID is gone within a bounded wait. SIGTERM and
SIGHUP stop it cleanly (the handlers of :mod:`nbkv.core.signals`) and remove the log and slot
folder it was given; SIGKILL leaves that to the kernel's parent-death signal.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbkv.remote.server import binary, free_port

if binary() is None:
    if os.environ.get("NBKV_REQUIRE_SERVER"):
        raise RuntimeError("no llama-server binary, and NBKV_REQUIRE_SERVER is set: "
                           "run `make llama-server`")
    pytest.skip("no llama-server binary: run `make llama-server`", allow_module_level=True)



def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent),
                                                         *sys.path]))

GONE_WITHIN = 30.0  # seconds: a bound, not a timing (the server stops in well under it)

OWNER = textwrap.dedent("""
    import json, time
    from nbkv.remote.server import LlamaServer

    s = LlamaServer(slots=1, ctx=256, advertise=False).start()
    print(json.dumps({"pid": s.pid, "log": s.log_path, "slots": s.slot_save_path}),
          flush=True)
    time.sleep(300)
""")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)  # leave no orphan behind the failing test
        return False
    return True


def children(pid: int) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int(p.joinpath("stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(p.name))
            except (OSError, ValueError, IndexError):
                pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_server_dies_with_the_process_that_started_it(sig):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env())
    assert owner.stdout is not None
    line = owner.stdout.readline()
    if not line:
        owner.wait(30)
        pytest.fail(f"the owner did not start its server: {owner.stderr.read()[-3000:]}")
    started = json.loads(line)
    assert alive(started["pid"])
    owner.send_signal(sig)
    assert owner.wait(60) == -sig
    assert gone(started["pid"]), "llama-server outlived the process that started it"
    if sig == signal.SIGKILL:  # nothing ran in the owner: the kernel stopped the server
        Path(started["log"]).unlink(missing_ok=True)
        shutil.rmtree(started["slots"], ignore_errors=True)
    else:
        assert not Path(started["log"]).exists() and not Path(started["slots"]).exists()


def test_the_server_command_stops_its_server_on_sigterm():
    port = free_port()
    cli = subprocess.Popen([sys.executable, "-m", "nbkv.remote.server", "--port", str(port),
                            "--slots", "1", "--ctx", "256", "--cache-ram", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    assert cli.stdout is not None
    for line in cli.stdout:
        if "ready" in line:
            break
    else:
        cli.wait(30)
        pytest.fail(f"python -m nbkv.remote.server did not start: {cli.stderr.read()[-3000:]}")
    servers = children(cli.pid)
    assert len(servers) == 1
    cli.send_signal(signal.SIGTERM)
    assert cli.wait(60) == -signal.SIGTERM
    assert gone(servers[0]), "llama-server outlived python -m nbkv.remote.server"
