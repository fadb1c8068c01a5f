"""Engine events to widget redraws, without ever slowing the engine or blocking the kernel.

The engine calls :meth:`Feed._on_event` on its scheduler thread: it only queues the event.
A render thread applies queued events to a :class:`LiveState` and redraws the attached
views at most once per ``interval`` seconds, always once more after the last event (so the
final state of a request is shown). While a prompt is being read, redraws wait for its
first token, and a long prefill is redrawn at most once per ``hold`` seconds; a request's
end is drawn after ``quiet`` seconds, or, if the next request has started by then, after its
first token: a redraw (and the browser's, which shares the cores) would otherwise compete
with the prefill, and with the rewrite of the reply just ended (docs/concepts/exactness.md).
A view that fails shows its error; nothing is raised.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from nbkv.core.events import Progress, RequestFinished, RequestRecord, RequestStarted, SlotsChanged
from nbkv.ui.palette import ERROR
from nbkv.ui.widgets.snapshot import INTERVAL, Displayed, close_parts, register

log = logging.getLogger("nbkv.ui.widgets")


@dataclass
class Running:
    """A request in flight: its plan and how far it got."""

    record: RequestRecord
    phase: str = ""
    done: int = 0
    total: int = 0
    since: float = 0.0  # time.monotonic() when the feed learned of it

    @property
    def reading(self) -> bool:
        """True until the first reply token: the prompt is being read (or its image encoded)."""
        return self.phase != "generate"

    @property
    def prefilled(self) -> int:
        """Prompt tokens prefilled so far."""
        if self.phase == "generate":
            return self.record.prefilled_tokens
        return self.done if self.phase in ("rebuild", "extend") else 0

    @property
    def generated(self) -> int:
        """Tokens generated so far (as last reported)."""
        return self.done if self.phase == "generate" else 0


@dataclass
class LiveState:
    """What the events said: requests in flight, the last finished request of each slot."""

    running: dict[int, Running] = field(default_factory=dict)
    last_by_slot: dict[int, RequestRecord] = field(default_factory=dict)
    events: int = 0
    closed: bool = False
    finished_at: float = 0.0  # time.monotonic() when the latest request ended

    def apply(self, event: Any, at: float | None = None) -> None:
        """Update from one engine event, published at ``at`` (``time.monotonic()``)."""
        at = time.monotonic() if at is None else at
        self.events += 1
        if isinstance(event, RequestStarted):
            self.running[event.record.id] = Running(event.record, since=at)
        elif isinstance(event, Progress):
            run = self.running.get(event.request_id)
            if run is not None:
                run.phase, run.done, run.total = event.phase, event.done, event.total
        elif isinstance(event, RequestFinished):
            self.running.pop(event.record.id, None)
            self.last_by_slot[event.record.slot] = event.record
            self.finished_at = at
        elif isinstance(event, SlotsChanged):
            if event.reason == "closed":
                self.closed = True
                self.running.clear()
            if event.reason in ("cleared", "closed", "restored"):
                self.last_by_slot.clear()

    def running_on(self, slot: int) -> Running | None:
        """The request in flight on ``slot``, if any."""
        for run in self.running.values():
            if run.record.slot == slot:
                return run
        return None


class View(Protocol):
    """What a feed redraws."""

    def render(self, state: LiveState) -> None:
        """Redraw from the engine's snapshot and ``state``."""

    def show_error(self, message: str) -> None:
        """Show that a redraw failed."""


class Feed:
    """Subscribes to an engine and redraws views, throttled, on its own thread."""

    def __init__(self, engine: Any, interval: float = 0.25, live: bool = True,
                 hold: float = 1.0, quiet: float = 0.4) -> None:
        self.engine = engine
        self.interval = interval
        self.hold = hold
        self.quiet = quiet
        self.live = live
        #: the displayed views' static snapshots (nbkv.ui.widgets.snapshot), refreshed at
        #: most every ``snapshot_interval`` s, once no request has run for ``snapshot_quiet``
        self.snapshots: list[Any] = []
        self.snapshot_interval = INTERVAL
        self.snapshot_quiet = 1.0
        self._due = False  # something happened since the snapshots were refreshed
        self.state = LiveState()
        self.renders = 0
        self.render_cpu_s = 0.0  # CPU time the redraws took (this feed's thread)
        self._views: list[View] = []
        self._queue: list[tuple[float, Any]] = []  # (when published, event)
        self._lock = threading.Lock()
        self._render_lock = threading.RLock()
        self._refresh_lock = threading.Lock()  # one snapshot refresh at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last = 0.0
        self._unsubscribe = engine.subscribe(self._on_event)
        # a view made after some requests starts from the latest one on each slot
        slots = {s.index: s.last_request for s in engine.slots()}
        for r in engine.history:
            if slots.get(r.slot) == r.id:
                self.state.last_by_slot[r.slot] = r
        self._thread: threading.Thread | None = None
        if live:
            self._thread = threading.Thread(target=self._run, name="nbkv-widgets", daemon=True)
            self._thread.start()

    def attach(self, view: View) -> None:
        """Redraw ``view`` from now on (and once right away)."""
        self._views.append(view)
        self._draw(view)

    def push(self, event: Any) -> None:
        """Queue an event from another source (a session store) for the next redraw."""
        if not self._stop.is_set():  # a closed feed keeps nothing
            self._on_event(event)

    def _on_event(self, event: Any) -> None:  # engine thread: queue and return
        with self._lock:
            self._queue.append((time.monotonic(), event))
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wake.wait(self._snapshot_in()):  # no event: the snapshots' turn
                if not self._stop.is_set():
                    self.refresh_snapshots()
                continue
            delay = self._last + self.interval - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            if self._stop.is_set():
                break
            self._wake.clear()
            held = self._held()
            while held > 0 and not self._stop.is_set():  # a prompt is being read
                if self._wake.wait(held):
                    self._wake.clear()
                held = self._held()
            if not self._stop.is_set():
                self.flush()

    def snapshot(self) -> LiveState:
        """A copy of the state now, safe to read on another thread while the feed runs.

        The events queued so far are applied first: a view shown right after a request
        draws that request.
        """
        self._apply()
        with self._render_lock:
            st = self.state
            return LiveState({k: replace(v) for k, v in st.running.items()},
                             dict(st.last_by_slot), st.events, st.closed)

    def _apply(self) -> None:
        with self._lock:
            events, self._queue = self._queue, []
        with self._render_lock:
            for at, ev in events:
                self.state.apply(ev, at)
            if events and not self.state.closed:
                self._due = True

    def _snapshot_in(self) -> float | None:
        """Seconds until the snapshots may be refreshed (None: nothing to refresh)."""
        if not (self._due and self.snapshots) or self._stop.is_set():
            return None
        self._apply()
        if self.state.running or self.state.closed:
            return None  # after the request: its end is an event, which wakes the thread
        last = max((s.last for s in self.snapshots), default=0.0)
        return max(self.state.finished_at + self.snapshot_quiet - time.monotonic(),
                   last + self.snapshot_interval - time.monotonic(), 0.0)

    def refresh_snapshots(self) -> int:
        """Show the cache as it is now in the displayed views' snapshots; how many changed.

        The feed does it on its own (throttled, never while a request runs); call it to have
        a notebook's snapshots final now (``make notebooks`` does, before it saves). One
        refresh at a time: a call while the feed's own is drawing waits for it to have sent
        everything, then sends only what changed since.
        """
        with self._refresh_lock:  # one under way (the feed thread's) ends first
            self._apply()
            if self.state.closed:  # a closed engine: the snapshots keep its last requests
                return 0
            self._due = False
            return sum(1 for snap in list(self.snapshots) if snap.refresh())

    def _held(self) -> float:
        """Seconds the next redraw should wait, so as not to compete with a prefill (0: none).

        While prompts are being read: until the first token (at most ``hold`` seconds, then
        once per ``hold``). Right after a request ended, with nothing running: ``quiet``
        seconds, for the next cell's request may follow at once (its prompt, and the rewrite
        of the reply that just ended, come first; the redraw then waits for its first token).
        """
        self._apply()
        now = time.monotonic()
        reading = [run.since for run in self.state.running.values() if run.reading]
        if reading:
            return max(min(reading) + self.hold, self._last + self.hold) - now
        if not self.state.running and not self.state.closed:
            return self.state.finished_at + self.quiet - now
        return 0.0

    def flush(self) -> None:
        """Apply the queued events and redraw every view now."""
        self._apply()
        with self._render_lock:
            cpu = time.thread_time()
            self._last = time.monotonic()
            for view in list(self._views):
                self._draw(view)
            self.renders += 1
            self.render_cpu_s += time.thread_time() - cpu
        if self.state.closed:
            self.close()

    def _draw(self, view: View) -> None:
        with self._render_lock:
            try:
                view.render(self.state)
            except Exception as e:  # noqa: BLE001 - a broken view must not stop the others
                log.exception("nbkv widget redraw failed")
                try:
                    view.show_error(f"redraw failed: {type(e).__name__}: {e}")
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        """Stop listening to the engine and stop the render thread."""
        self._unsubscribe()
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2)


def with_static(bundle: dict[str, Any], static_html: Any) -> dict[str, Any]:
    """A widget's display data plus ``text/html``: the static fallback of a saved notebook.

    Front ends with the widget manager show the live view; GitHub, nbviewer, nbconvert and
    a notebook opened before its kernel starts show the HTML (inline SVG, no script).
    """
    try:
        bundle["text/html"] = static_html()
    except Exception:  # noqa: BLE001 - the live view must still show
        log.exception("nbkv: the static fallback failed")
    return bundle


class FeedView(Displayed):
    """Mixin of the dashboard pieces: an error note, a static snapshot, closing what they own.

    ``hider`` (an empty ``ipywidgets.HTML`` first among the piece's children) carries the
    style rule with which the live view hides its snapshot (:mod:`nbkv.ui.widgets.snapshot`).
    """

    note: Any  # an ipywidgets.HTML under the piece
    feed: Feed
    _own_feed: bool

    def render(self, state: LiveState) -> None:
        """Redraw the piece from ``state`` (each piece draws its own)."""
        raise NotImplementedError

    def follow(self, engine: Any, feed: Feed | None) -> None:
        """Draw from ``feed`` (one of its own when None) and join the kernel's views."""
        self._own_feed = feed is None
        self.feed = feed or Feed(engine)
        self.feed.attach(self)
        register(self)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return with_static(super()._repr_mimebundle_(**kwargs),  # type: ignore[misc]
                           self.static_html)

    def show_error(self, message: str) -> None:
        """Show a redraw failure under the piece (never raised into the engine)."""
        self.note.value = f'<span style="color:{ERROR}">{html.escape(message)}</span>'

    def close(self) -> None:
        """Close the piece, every part of it (:func:`close_parts`), and its own feed."""
        if self._own_feed:
            self.feed.close()
        super().close()  # type: ignore[misc]
        close_parts(self)
