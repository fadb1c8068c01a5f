"""Run llama-server with the flags nbkv needs: ``python -m nbkv.remote.server [MODEL] [--port N]``.

The binary is ``$NBKV_LLAMA_SERVER``, else the one ``python -m nbkv.remote.build`` (run by
``make llama-server`` and Binder's ``postBuild``) builds from the llama.cpp sources inside the
installed llama-cpp-python's sdist, as ``<sys.prefix>/llama-server-<version>/llama-server``,
else ``llama-server`` on ``PATH``.

The flags nbkv's exact slot pinning needs (``SERVER_FLAGS``; the docs say why, each):

- ``-np N`` and ``--no-kv-unified``: one KV buffer per slot, so that llama-server never
  clears an idle slot (and a pinned conversation) to make room;
- ``--cache-ram MIB``: the server's parking lot, sized from the in-kernel parking budget
  (``default_ram_budget()``; 0 = off). :class:`LlamaServer` leaves it off unless asked
  (``cache_ram``): tests and benchmarks pin what the server holds;
- ``--metrics``, ``/slots`` and ``--slot-save-path DIR``: the server's figures, and slot
  save, restore and erase (``%kvcache save`` / ``clear``);
- ``-b 256 -ub 256 -fa off`` and explicit threads: the in-kernel engine's arithmetic;
- ``--ui-config``: these flags, the calibrated prefill rule and the start time in ``/props``
  (:mod:`nbkv.remote.facts`), so a remote engine can prove replies exact and see a restart.

:class:`LlamaServer` runs one as a child process (:mod:`nbkv.remote.process`), for the
tests, the benchmark and the remote-engine notebook.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nbkv.core.errors import NbkvError, ServerError
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.backend import default_threads
from nbkv.remote import build
from nbkv.remote.facts import advert, flags_of
from nbkv.remote.process import ServerProcess, free_port

SERVER_FLAGS = ("--no-kv-unified", "--metrics", "--slots", "--no-webui")
NO_BINARY = ("no llama-server binary: build one from the installed llama-cpp-python's llama.cpp "
             "with `python -m nbkv.remote.build` (a few minutes; needs a C++ compiler), or set "
             "$NBKV_LLAMA_SERVER to one")


def binary() -> Path | None:
    """The llama-server binary to run, or None when there is none."""
    env = os.environ.get("NBKV_LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).is_file() else None
    return _own_binary()


def _own_binary() -> Path | None:
    """The llama-server built from the installed llama-cpp-python's own sources, else PATH's."""
    here = build.target() if _build() else None
    if here is not None and here.is_file():
        return here
    found = shutil.which("llama-server")
    return Path(found) if found else None


def _build() -> str:
    try:
        return build.version()
    except importlib.metadata.PackageNotFoundError:
        return ""


def calibrate_for(model: str, flags: dict[str, Any]) -> tuple[PrefillRule | None, str]:
    """The prefill rule of ``model`` with a server's ``flags``, and its memory class.

    Measured in this process with the llama.cpp the server is built from (cached like the
    in-kernel engine's, :mod:`nbkv.kv.calibrate`); only plain attention memory is
    calibrated, the only kind a server's prompt cache can be steered on. Never raises: a
    failure is a rule that proves nothing.
    """
    from nbkv.kv import calibrate
    from nbkv.kv.slot_kv import PLAIN, classify
    from nbkv.llama.backend import Model
    from nbkv.llama.hardware import FLASH_ATTN, kv_type_id

    try:
        m = Model(model)
    except Exception as e:  # noqa: BLE001 - an unreadable model proves nothing
        return PrefillRule(exact=False, reason=f"the model could not be calibrated: {e}"), ""
    try:
        kind = classify(m)
        if kind != PLAIN:
            return None, kind
        fa = str(flags.get("flash_attn") or "auto")
        if fa not in ("on", "off"):
            return PrefillRule(exact=False, reason=f"flash attention is {fa!r}"), kind
        settings = {"n_threads": int(flags.get("threads") or default_threads()),
                    "flash_attn": FLASH_ATTN[fa], "type_k": kv_type_id("f16"),
                    "type_v": kv_type_id("f16")}
        try:
            return calibrate.calibrate(m, n_seq=1, can_trim=True, settings=settings), kind
        except Exception as e:  # noqa: BLE001
            return PrefillRule(exact=False, reason=f"the calibration failed: {e}"), kind
    finally:
        m.close()


class LlamaServer(ServerProcess):
    """A llama-server child process on 127.0.0.1 (``with`` or ``start()`` / ``stop()``).

    ``ctx`` is per slot (llama-server's ``-c`` is the total: ``slots * ctx``). What changes
    the arithmetic is pinned to the in-kernel engine's values by default: ``batch`` and
    ``ubatch`` 256 (``-b``, ``-ub``), ``flash_attn="off"`` (llama-server's ``auto`` turns it
    on) and ``threads`` (what this process may use: :mod:`nbkv.llama.cpus`); None leaves a
    flag to llama-server's default. ``cache_ram``: MiB of ``--cache-ram`` (0 = off).
    """

    NAME = "llama-server"

    def __init__(self, model: str | None = None, *, port: int | None = None, slots: int = 2,
                 ctx: int = 2048, threads: int | None = None, batch: int | None = 256,
                 ubatch: int | None = 256, flash_attn: str | None = "off",
                 slot_save_path: str | None = None, cache_ram: int = 0,
                 extra: tuple[str, ...] = (), log_path: str | None = None,
                 advertise: bool = True) -> None:
        exe = binary()
        if exe is None:
            raise NbkvError(NO_BINARY)
        if model is None:
            from nbkv.llama.models import default_model_path

            model = str(default_model_path())
        self.model = model
        self.port = port or free_port()
        self.slots = slots
        self.ctx = ctx
        self.cache_ram = int(cache_ram)
        self.argv = [str(exe), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(slots), "-c", str(slots * ctx), *SERVER_FLAGS,
                     "--cache-ram", str(int(cache_ram))]
        if not threads:  # llama-server's own default counts the node's cores, not the quota
            from nbkv.llama.cpus import cpu_budget

            threads = cpu_budget().threads
        self.argv += ["-t", str(threads), "-tb", str(threads)]
        if batch:
            self.argv += ["-b", str(batch)]
        if ubatch:
            self.argv += ["-ub", str(ubatch)]
        if flash_attn:
            self.argv += ["-fa", flash_attn]
        # also what lets /slots/N?action=erase work (%kvcache clear)
        self.slot_save_path = slot_save_path or self._temp(tempfile.mkdtemp(prefix="nbkv-slots-"))
        self.folders = (self.slot_save_path,)
        Path(self.slot_save_path).mkdir(parents=True, exist_ok=True)
        self.argv += ["--slot-save-path", self.slot_save_path]
        self.argv += list(extra)
        self.log_path = log_path or self._temp_log("nbkv-llama-server-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.same_build = exe == _own_binary()
        self.advertise = advertise  # state the flags in /props (False: a plain llama-server)
        self._calibrated: tuple[PrefillRule | None, str] | None = None

    def calibration(self) -> tuple[PrefillRule | None, str]:
        """The model's prefill rule under the server's flags, and its memory class (cached)."""
        if self._calibrated is None:
            self._calibrated = calibrate_for(self.model, flags_of(self.argv))
        return self._calibrated

    def command(self) -> list[str]:
        """The full command line: ``argv`` and the ``--ui-config`` stating the flags."""
        if not self.advertise:
            return list(self.argv)
        rule, memory = self.calibration()
        return [*self.argv, "--ui-config", advert(self.argv, rule, memory,
                                                  _build(), self.same_build)]

    def _starting(self) -> dict[str, Any]:
        return {"what": f"starting llama-server on port {self.port}",
                "why": f"it loads {Path(self.model).name} for {self.slots} slots", "tick": 0.5}


def main(argv: list[str] | None = None) -> int:
    """``python -m nbkv.remote.server``: run llama-server in the foreground until Ctrl-C."""
    ap = argparse.ArgumentParser(prog="python -m nbkv.remote.server", description=__doc__.split(
        "\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--slots", type=int, default=4, help="slots (llama-server -np)")
    ap.add_argument("--ctx", type=int, default=4096, help="tokens per slot")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-ram", type=int, default=None, metavar="MIB",
                    help="llama-server's host-memory prompt cache, where prompts leaving a "
                         "slot are parked (default: the in-kernel engine's parking budget, "
                         "min(1/4 of free RAM, 4 GiB); 0 = off)")
    args, extra = ap.parse_known_args(argv)
    if args.cache_ram is None:
        from nbkv.store.parking import default_ram_budget

        args.cache_ram = default_ram_budget() >> 20
    try:
        server = LlamaServer(args.model, port=args.port, slots=args.slots, ctx=args.ctx,
                             threads=args.threads, cache_ram=args.cache_ram,
                             extra=tuple(extra))
    except NbkvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" ".join(server.argv), flush=True)
    try:
        server.start()
        print(f"llama-server ready: connect with  %kvcache connect {server.url}  "
              f"(Ctrl-C or SIGTERM stops it; log: {server.log_path})", flush=True)
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
        print(f"llama-server exited: {server.tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping llama-server", flush=True)
        return 0
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
