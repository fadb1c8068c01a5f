"""Long work, said while it runs: one line that says what is happening, why, and how far.

Anything that can take more than a second or two reports steps (:class:`Step`): loading a model,
calibrating it, opening a vision projector, starting or building llama-server, a save or a
restore of many MB. A *reporter* shows them: ``Engine(progress=...)`` and the other entry
points take one; by default they use :func:`default_reporter`:

- in a kernel with ``%load_ext nbkv``, a progress bar in the running cell (with the same line
  as text, so a saved or exported notebook reads it too; :mod:`nbkv.ui.progress`);
- in a terminal, one line on stderr, rewritten in place (:class:`TerminalLine`; given a
  stream that is not a terminal, it writes whole lines instead, :class:`PlainLines`, so a
  log never holds carriage returns);
- elsewhere (a script piped to a file, a test), the ``nbkv`` logger at INFO only.

:class:`Task` is what long work holds: it times itself, throttles nothing (reporters do),
and can tick on its own while a native call that reports nothing runs.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TextIO

log = logging.getLogger("nbkv")


@dataclass(frozen=True)
class Step:
    """Where one piece of long work stands."""

    what: str  # what is happening: "checking which prefill groupings are exact on this CPU"
    why: str = ""  # why it takes this long, or how often: "once per model and build"
    done: float = 0.0
    total: float = 0.0  # 0: no known end (the elapsed time is shown instead)
    unit: str = ""  # "" (steps: "3 of 6"), "%", "MiB"
    elapsed: float = 0.0  # seconds since the work started
    final: bool = False  # the work ended: a bar goes away

    @property
    def fraction(self) -> float | None:
        """``done / total``, or None when the end is not known."""
        return min(max(self.done / self.total, 0.0), 1.0) if self.total > 0 else None

    def count(self) -> str:
        """How far, in words: ``3 of 6``, ``45%``, ``12.5 of 80.0 MiB``, or ``4 s``.

        After 2 s the elapsed time follows (``3 of 6 · 5 s``): a bar that has not moved for a
        while still shows that the work goes on.
        """
        if self.total <= 0:
            return f"{self.elapsed:.0f} s"
        if self.unit == "%":
            n = f"{100 * (self.fraction or 0):.0f}%"
        elif self.unit:
            n = f"{self.done:.1f} of {self.total:.1f} {self.unit}"
        else:
            n = f"{self.done:.0f} of {self.total:.0f}"
        return n + (f" · {self.elapsed:.0f} s" if self.elapsed >= 2 else "")

    def text(self) -> str:
        """The one line: ``checking ... (once per model and build): 3 of 6``."""
        why = f" ({self.why})" if self.why else ""
        return f"{self.what}{why}: {self.count()}"


#: what shows steps: called from the working thread (maybe not the caller's)
Reporter = Callable[[Step], object]


def silent(step: Step) -> None:
    """A reporter that shows nothing (the ``nbkv`` logger still gets each work's end)."""


def is_terminal(out: TextIO | None) -> bool:
    """True when ``out`` is a terminal (a closed or detached stream is not)."""
    try:
        return out is not None and out.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class TerminalLine:
    """Steps as one line on a text stream (stderr), rewritten in place, at most 10 a second.

    100% and the work's end are always drawn; the end clears the line. On a stream that is
    not a terminal (a log file, a pipe, a child process's captured stderr) a line rewritten
    in place would pile up: there it writes :class:`PlainLines` instead.
    """

    def __init__(self, out: TextIO | None = None, interval: float = 0.1) -> None:
        self.out = out or sys.stderr
        self.interval = interval
        self._last = 0.0
        self._width = 0
        self._lock = threading.Lock()
        self._plain = None if is_terminal(self.out) else PlainLines(self.out)

    def __call__(self, step: Step) -> None:
        """Redraw the line (clear it at the work's end)."""
        if self._plain is not None:
            self._plain(step)
            return
        with self._lock:
            now = time.monotonic()
            if not step.final and step.fraction != 1.0 and now - self._last < self.interval:
                return
            self._last = now
            line = "" if step.final else step.text()
            self.out.write("\r" + line.ljust(self._width) + ("\r" if step.final else ""))
            self._width = len(line) if not step.final else 0
            self.out.flush()


class PlainLines:
    """Steps as whole lines, for logs (a CI job, a Binder build).

    A line when the work starts or changes, then at most every ``every`` seconds, and one
    when it ends.
    """

    def __init__(self, out: TextIO | None = None, every: float = 15.0) -> None:
        self.out = out or sys.stderr
        self.every = every
        self._last = 0.0
        self._what = ""
        self._lock = threading.Lock()

    def __call__(self, step: Step) -> None:
        """Write a line if one is due."""
        with self._lock:
            now = time.monotonic()
            if step.final and not step.what:  # a bar cleared: nothing to say
                return
            if step.final:
                line = f"{step.what}: done in {step.elapsed:.0f} s"
            elif step.what != self._what or now - self._last >= self.every:
                line = step.text()
            else:
                return
            self._what, self._last = step.what, now
            self.out.write(line + "\n")
            self.out.flush()


_default: Callable[[], Reporter] | None = None


def set_default(factory: Callable[[], Reporter] | None) -> None:
    """Make ``factory()`` the reporter of work given none (the notebook extension does)."""
    global _default
    _default = factory


def default_reporter() -> Reporter:
    """The reporter for work started now: see the module's doc."""
    if _default is not None:
        return _default()
    return TerminalLine() if is_terminal(sys.stderr) else silent


def resolve(progress: Reporter | bool | None) -> Reporter:
    """``progress`` as given: None or True for the default, False for none."""
    if progress is None or progress is True:
        return default_reporter()
    if progress is False:
        return silent
    return progress


class Task:
    """One piece of long work that reports its steps (a context manager).

    ``tick`` > 0 re-reports every ``tick`` seconds from a helper thread while nothing else
    does (the elapsed time moves on during a native call that says nothing); ``log_after``:
    a work that took longer is logged at INFO when it ends.
    """

    def __init__(self, reporter: Reporter, what: str, why: str = "", total: float = 0.0,
                 unit: str = "", tick: float = 0.0, log_after: float = 1.0) -> None:
        self.reporter = reporter
        self.step = Step(what, why, 0.0, total, unit)
        self.tick = tick
        self.log_after = log_after
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ended = False

    def __enter__(self) -> Task:
        self._t0 = time.monotonic()
        self._report()
        if self.tick > 0:
            self._thread = threading.Thread(target=self._ticker, name="nbkv-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end()

    @property
    def elapsed(self) -> float:
        """Seconds since the work started."""
        return time.monotonic() - self._t0

    def update(self, done: float | None = None, *, total: float | None = None,
               what: str | None = None, why: str | None = None) -> None:
        """Move on: the new ``done`` (and, if they changed, ``total``, ``what``, ``why``)."""
        with self._lock:
            s = self.step
            self.step = replace(s, done=s.done if done is None else done,
                                total=s.total if total is None else total,
                                what=s.what if what is None else what,
                                why=s.why if why is None else why)
        self._report()

    def advance(self, n: float = 1.0) -> None:
        """``done += n``."""
        self.update(self.step.done + n)

    def end(self) -> None:
        """The work ended (also on an error): the reporter clears its bar; once."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        step = replace(self.step, elapsed=self.elapsed, final=True)
        if step.elapsed >= self.log_after:
            log.info("%s: took %.1f s", step.what, step.elapsed)
        self._call(step)

    def _report(self) -> None:
        with self._lock:
            if self._ended:
                return
            step = replace(self.step, elapsed=self.elapsed)
        self._call(step)

    def _call(self, step: Step) -> None:
        try:
            self.reporter(step)
        except Exception:  # noqa: BLE001 - a display must not break the work
            log.debug("a progress reporter failed", exc_info=True)

    def _ticker(self) -> None:
        while not self._stop.wait(self.tick):
            self._report()
