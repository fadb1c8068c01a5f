"""What every server nbkv starts has in common: its URL, its PID, its log, ``with``.

:class:`~nbkv.remote.server.LlamaServer` and :class:`~nbkv.remote.vllm_server.VLLMServer`
each start and stop their own process (how they are stopped differs: vLLM leaves a process
group behind); this is the rest, and what keeps a server from outliving its owner:

- on Linux the child is started with a parent-death signal (:func:`die_with_parent`): if the
  process that started it dies, whatever ended it (SIGKILL included), the kernel sends the
  server SIGTERM;
- SIGTERM and SIGHUP to the owner stop the server first (:mod:`nbkv.core.signals`), as
  ``atexit`` does at a normal exit;
- the temporary files a server was given (its log, its slot folder, its sockets) are removed
  when it stops, except a log that explains a failure: that one is kept, and its path logged.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

log = logging.getLogger("nbkv")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGTERM the child when this process dies.

    None where it cannot hold: not Linux, or not the main thread (the parent-death signal
    fires when the *thread* that started the child ends, which for another thread may be
    long before the process does; there the signal handlers and ``atexit`` stop the server).
    The function it returns is resolved here, so the child only calls it, and it ends a
    child whose parent died before the call.
    """
    if not sys.platform.startswith("linux") or \
            threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # it died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


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

    def _temp_log(self, prefix: str) -> str:
        """A new log file of ours (removed by :meth:`_clean_up` unless a failure needs it)."""
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
        os.close(fd)
        self._temp(path)
        return path

    def _temp(self, path: str) -> str:
        """``path`` (a file or folder this object made) is removed when the server stops."""
        owned: list[str] = self.__dict__.setdefault("_owned", [])
        owned.append(path)
        return path

    def _clean_up(self, failed: str | None = None) -> None:
        """Remove the temporary files made for the server; ``failed``: keep its log (why)."""
        owned: list[str] = self.__dict__.get("_owned", [])
        for path in list(owned):
            if failed and path == self.log_path:
                log.warning("%s %s: its log is kept at %s", type(self).__name__, failed, path)
                owned.remove(path)  # the user's now
            elif os.path.isdir(path):  # still owned: a start again makes it again
                shutil.rmtree(path, ignore_errors=True)
            else:
                Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        """The same as :meth:`stop` (what ``atexit`` and the signal handlers call)."""
        self.stop()

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
