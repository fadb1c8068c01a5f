"""What every server nbkv starts has in common: its URL, its PID, its log, ``with``.

:class:`~nbkv.remote.server.LlamaServer` and :class:`~nbkv.remote.vllm_server.VLLMServer`
each start and stop their own process (how they are stopped differs: vLLM leaves a process
group behind); this is the rest.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Self


def log_tail(path: str, n: int) -> str:
    """The last ``n`` lines of a server's log file."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """A server process on ``127.0.0.1:port``, logging to ``log_path``; stopped by ``stop()``."""

    port: int
    log_path: str
    proc: subprocess.Popen[bytes] | None
    TAIL = 15  # log lines shown by default

    @property
    def url(self) -> str:
        """Where the server listens."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's PID while it runs (for vLLM: its process group's id too)."""
        return self.proc.pid if self.proc is not None else None

    def tail(self, n: int | None = None) -> str:
        """The last lines of the server's log."""
        return log_tail(self.log_path, self.TAIL if n is None else n)

    def start(self, timeout: float = 120.0) -> Self:
        """Start the process and wait until it answers."""
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the process by its PID; idempotent."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
