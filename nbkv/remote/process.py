"""What every server nbkv starts has in common: starting, waiting, stopping, its files.

:class:`~nbkv.remote.server.LlamaServer` and :class:`~nbkv.remote.vllm_server.VLLMServer`
build their command lines; :class:`ServerProcess` runs them. A server never outlives its owner:

- on Linux the child is started with a parent-death signal (:func:`die_with_parent`): if the
  process that started it dies, whatever ended it (SIGKILL included), the kernel sends the
  server SIGTERM;
- SIGTERM and SIGHUP to the owner stop the server first (:mod:`nbkv.core.signals`), as
  ``atexit`` does at a normal exit;
- the temporary files a server was given (its log, its slot folder, its sockets) are removed
  when it stops, except a log that explains a failure: that one is kept, and its path logged.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from nbkv.core.errors import ServerError
from nbkv.core.progress import Reporter, Task, resolve
from nbkv.core.signals import close_on_signal, release

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, n: int) -> str:
    """The last ``n`` lines of a server's log file."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """A server child process on ``127.0.0.1:port``, logging to ``log_path``.

    A subclass builds its command line (:meth:`command`), ``env`` and the words of its start
    (:meth:`_starting`); this class starts it, waits for it, and stops it by its PID with
    bounded waits.
    ``GROUP``: the server is the leader of a new process group (vLLM's engine core and worker),
    and the whole group is killed when it stops.
    """

    port: int
    log_path: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None
    env: dict[str, str] | None = None
    folders: tuple[str, ...] = ()  # made again by each start
    start_s = 0.0  # how long the last start took, to /health answering 200
    NAME = "server"  # in messages
    GROUP = False
    POLL_S = 0.1  # between two looks at /health
    START_S = 120.0  # the default wait for /health to answer
    STOP_S = 10.0  # the default wait for SIGTERM to end it
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

    def command(self) -> list[str]:
        """The command line the server is started with."""
        return list(self.argv)

    def _spawn(self) -> None:
        """Start the process, stopped at exit, on SIGTERM/SIGHUP, or if this process dies.

        Without ``GROUP`` it stays in the caller's process group: whoever stops the kernel
        (or the terminal's Ctrl-C) stops the server too.
        """
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=self.GROUP,
                                         preexec_fn=die_with_parent())
        atexit.register(self.stop)
        close_on_signal(self)

    def _progress(self, task: Task) -> None:
        """Tell ``task`` how far a start has come (a server whose log says so)."""

    def wait_ready(self, timeout: float = 120.0, task: Task | None = None) -> None:
        """Poll ``/health`` until it answers 200; raise (and stop it) if it dies or stalls."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if task is not None:
                self._progress(task)
            if self.proc is None or self.proc.poll() is not None:
                tail = self.tail()
                self._stop("exited during start-up")
                raise ServerError(f"{self.NAME} exited during start-up (its log: "
                                  f"{self.log_path}): {tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.POLL_S)
        tail = self.tail()
        self._stop(f"was not ready in {timeout:.0f} s")
        raise ServerError(f"{self.NAME} did not become ready in {timeout:.0f} s (its log: "
                          f"{self.log_path}): {tail}")

    def close(self) -> None:
        """The same as :meth:`stop` (what ``atexit`` and the signal handlers call)."""
        self.stop()

    def start(self, timeout: float | None = None, progress: Reporter | bool | None = None
              ) -> Self:
        """Start it and wait (at most ``timeout`` s, default ``START_S``) for ``/health``.

        ``progress``: where the wait is shown (:func:`nbkv.core.progress.resolve`), in the
        words of :meth:`_starting`.
        """
        t0 = time.monotonic()
        for folder in self.folders:  # (removed by the last stop: a start again)
            Path(folder).mkdir(parents=True, exist_ok=True)
        self._spawn()
        with Task(resolve(progress), **self._starting()) as task:
            self.wait_ready(self.START_S if timeout is None else timeout, task)
        self.start_s = time.monotonic() - t0
        return self

    def _starting(self) -> dict[str, Any]:
        """The start's progress task: what it does and why it takes time (``Task``'s words)."""
        return {"what": f"starting {self.NAME} on port {self.port}", "why": ""}

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM it by its PID, SIGKILL after ``timeout`` s (default ``STOP_S``); idempotent.

        Its temporary files are removed, unless it had died on its own (its log is kept
        then, and its path logged).
        """
        proc = self.proc
        code = proc.poll() if proc is not None else None
        self._stop(None if code is None else f"had exited with code {code}",
                   self.STOP_S if timeout is None else timeout)

    def _stop(self, failed: str | None, timeout: float | None = None) -> None:
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        release(self)
        wait = self.STOP_S if timeout is None else timeout
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                    proc.wait(wait)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    pass
            if self.GROUP:  # what lingers of the group too
                self._kill(proc)
            elif proc.poll() is None:
                self._kill(proc, wait)
        self._clean_up(failed)

    def kill(self) -> None:
        """SIGKILL the server now (a crash, for tests); the object can be started again."""
        proc, self.proc = self.proc, None
        if proc is not None and (self.GROUP or proc.poll() is None):
            self._kill(proc)

    def _kill(self, proc: subprocess.Popen[bytes], wait: float = 10.0) -> None:
        """SIGKILL ``proc`` (with ``GROUP``, the process group it leads), bounded waits."""
        if not self.GROUP:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(wait)
            return
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

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
