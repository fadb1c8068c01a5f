"""Saving an engine in the background after requests (``%kvcache autosave``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from nbkv.core.errors import EngineBusy, NbkvError
from nbkv.core.events import RequestFinished
from nbkv.store.persist import save

log = logging.getLogger("nbkv")


class Autosaver:
    """Saves an engine in the background after requests, at most every ``interval`` seconds.

    A save starts only when the engine is idle (nothing queued, running or being rewritten)
    and a few seconds after the last request, and gives way if a request arrives before its
    states are copied: a reply is never held up by it.
    """

    def __init__(self, engine: Any, path: str | os.PathLike | None = None,
                 sessions: Any = None, interval: float = 30.0,
                 quiet: float = 2.0) -> None:
        self.engine = engine
        self.path = path
        self.sessions = sessions
        self.interval = interval
        self.quiet = quiet
        self.saves = 0
        self.last_error: str | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._last_event = 0.0
        self._last_save = 0.0
        self._unsubscribe = engine.subscribe(self._on_event)
        self._thread = threading.Thread(target=self._run, name="nbkv-autosave", daemon=True)
        self._thread.start()

    def _on_event(self, event: Any) -> None:
        if isinstance(event, RequestFinished):
            self._last_event = time.monotonic()
            self._dirty.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._dirty.wait(0.5):
                continue
            now = time.monotonic()
            wait = max(self._last_event + self.quiet, self._last_save + self.interval) - now
            if wait > 0:
                self._stop.wait(min(wait, 1.0))
                continue
            self._dirty.clear()
            try:
                save(self.engine, self.path, self.sessions, only_if_idle=True, progress=False)
                self.saves += 1
                self._last_save = time.monotonic()
            except EngineBusy:
                self._dirty.set()
                self._last_event = time.monotonic()  # try again once it is quiet
            except NbkvError as e:
                self.last_error = str(e)
                self._last_save = time.monotonic()
                log.warning("autosave failed: %s", e)
                if "closed" in str(e):
                    return
            except Exception as e:  # noqa: BLE001 - a background thread must not die loudly
                self.last_error = f"{type(e).__name__}: {e}"
                self._last_save = time.monotonic()
                log.exception("autosave failed")

    def stop(self) -> None:
        """Stop autosaving (a save in progress finishes)."""
        self._stop.set()
        self._unsubscribe()
        self._thread.join(timeout=30)
