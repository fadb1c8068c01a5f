"""What nbkv holds is closed when the process is told to end: SIGTERM and SIGHUP.

SIGINT raises ``KeyboardInterrupt`` and the interpreter exits through its ``atexit`` hooks,
which close open engines (spilling their parked conversations to disk) and stop the servers
nbkv started. SIGTERM (what ``kill``, docker, systemd and a Jupyter kernel manager send) and
SIGHUP (a closed terminal) end the process without them. :func:`close_on_signal` registers
an object whose ``close()`` must run first; while any is registered, a handler for those
signals closes them all, newest first, then lets the signal take its usual course: the
handler that was there before is called (a kernel's or an application's own), or, where
there was none, the default action is taken again, so the process ends by that signal as
it would have. A signal that is ignored (``nohup``) or handled outside Python is left
alone.

The handlers are installed from the main thread only (Python's rule), once per process,
and the ones found are restored when the last registered object is :func:`released
<release>` (unless someone replaced ours meanwhile). An object registered from another
thread is still closed at exit, but not on these signals until one is registered from the
main thread.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

log = logging.getLogger("nbkv")

#: the signals that end a process whose owner wants it to end cleanly
SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Closable(Protocol):
    """Anything with a ``close()``."""

    def close(self) -> None:
        """Release what it holds."""


_held: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_lock = threading.RLock()
_count = 0  # registration order: closed newest first
_previous: dict[int, Handler] = {}  # the handlers ours replaced, per signal
_ending = False  # a signal is being handled: a second one waits for the first


def close_on_signal(obj: Closable) -> None:
    """Close ``obj`` (held weakly) before SIGTERM or SIGHUP ends the process."""
    global _count
    with _lock:
        _count += 1
        _held[_count] = obj
        _install()


def release(obj: Closable) -> None:
    """Forget ``obj`` (it closed); the last one released restores the previous handlers."""
    with _lock:
        for k, v in list(_held.items()):
            if v is obj:
                del _held[k]
        if not _held:
            _uninstall()


def installed() -> tuple[int, ...]:
    """The signals whose handler is nbkv's right now."""
    return tuple(s for s in _previous if signal.getsignal(s) is _handle)


def _install() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        if sig in _previous:
            continue
        current = signal.getsignal(sig)
        # ignored on purpose (nohup), or handled by C code we could not call again
        if current is signal.SIG_IGN or current is None:
            continue
        try:
            signal.signal(sig, _handle)
        except (ValueError, OSError) as e:  # not the main interpreter, or refused
            log.debug("could not handle %s: %s", sig.name, e)
            continue
        _previous[sig] = current


def _uninstall() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # Python allows it only there: ours stays, and does nothing but chain
    for sig, prev in list(_previous.items()):
        if signal.getsignal(sig) is _handle:
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        del _previous[sig]


def close_all() -> None:
    """Close every registered object, newest first; a failure is logged, not raised."""
    with _lock:
        objs = [_held.get(k) for k in sorted(_held, reverse=True)]
    for obj in objs:
        if obj is None:
            continue
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - the process is ending: close the rest
            log.exception("closing %s on a signal failed", type(obj).__name__)


def _handle(signum: int, frame: FrameType | None) -> None:
    """Close what is held, then the signal's usual course (see the module doc)."""
    global _ending
    if _ending:
        return  # the first one is closing; it ends the process when done
    _ending = True
    prev = _previous.get(signum, signal.SIG_DFL)  # (the last release restores it meanwhile)
    try:
        log.info("%s: closing what nbkv holds before the process ends",
                 signal.Signals(signum).name)
        close_all()
    finally:
        _ending = False
    if callable(prev):
        prev(signum, frame)
        return
    if prev is signal.SIG_IGN:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the default action: the process ends by this signal
