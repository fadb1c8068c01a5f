"""What a saved notebook shows of a live view: a static snapshot that follows the cache.

A displayed nbkv widget makes two outputs: the live view (the widget), and beside it a
snapshot (:class:`Snapshot`: inline SVG and HTML, no script) that its feed refreshes while
no request runs. So GitHub, nbviewer, an export and a notebook reopened without its kernel
show the cache after the last request. A live view hides its snapshot (a style rule).

Why a separate output: updating the widget's own output (``update_display_data`` with the
widget's view and new HTML) makes JupyterLab render the widget again, and the old view is
never disposed: it keeps following the model, one more each update.

The charts (the KV map, the timeline) are outputs of their own beside it (:class:`ChartOutput`):
one MIME bundle each, a plotly figure and its PNG (:mod:`nbkv.ui.chartfig`), refreshed the
same way. They are the live charts too (JupyterLab and Notebook 7 draw the figure with
hover and zoom; the widget does not draw them again), and what an untrusted notebook,
GitHub and nbconvert show (the PNG).

The kernel's nbkv widgets are also listed here (:func:`created`, :func:`made_since`), so that
a notebook cell run again can close the views its previous run made (nothing shows them
any more; open, they would go on following the engine and be sent again on a page reload).
At exit, every view still open is closed by an ``atexit`` hook (:func:`close_all`), while
ipywidgets and the comm manager still exist: a widget left to interpreter teardown closes
itself after its module's globals are gone, and prints a traceback for every widget.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from nbkv.ui import chartfig

log = logging.getLogger("nbkv.ui.widgets")

#: seconds between two refreshes of a view's snapshot, at least
INTERVAL = 3.0
_count = itertools.count(1)
_made: list[tuple[int, weakref.ref[Any]]] = []
_lock = threading.Lock()


def register(view: Any) -> None:
    """Note a new nbkv view (see :func:`made_since`)."""
    with _lock:
        _made.append((next(_count), weakref.ref(view)))
        _made[:] = [(n, r) for n, r in _made if r() is not None]


def created() -> int:
    """How many nbkv views were made so far (a mark for :func:`made_since`)."""
    with _lock:
        return _made[-1][0] if _made else 0


def made_since(mark: int) -> list[Any]:
    """The nbkv views made after :func:`created` returned ``mark``, still alive."""
    with _lock:
        return [v for n, r in _made if n > mark and (v := r()) is not None]


def close_parts(widget: Any) -> None:
    """Close what ``widget.close()`` leaves open: its children (and theirs), layout and style.

    Every ipywidget has a ``Layout`` (and text widgets a style) of its own, a widget too: left
    open, it stays in ipywidgets' registry until teardown and closes itself then, noisily.
    """
    for child in tuple(getattr(widget, "children", ()) or ()):
        child.close()
        close_parts(child)
    for name in ("layout", "style"):
        part = getattr(widget, name, None)
        if part is not None and hasattr(part, "comm") and hasattr(part, "close"):
            part.close()


def close_all() -> int:
    """Close every nbkv view still open, newest first (at exit); how many were closed."""
    with _lock:
        views = [v for _, r in reversed(_made) if (v := r()) is not None]
    closed = 0
    for view in views:
        if getattr(view, "comm", None) is None:  # closed already (a dashboard's pieces)
            continue
        try:
            view.close()
            closed += 1
        except Exception:  # noqa: BLE001 - exiting: close the others
            log.debug("closing an nbkv view at exit failed", exc_info=True)
    return closed


atexit.register(close_all)  # every atexit hook runs before module teardown


def hide_rule(uid: str) -> str:
    """The style rule with which a live view hides its snapshot (a running notebook)."""
    sel = f'[data-nbkv-snapshot="{uid}"]'
    return (f"<style>{sel}{{display:none!important}}"
            f".jp-OutputArea-child:has({sel}){{display:none!important}}</style>")


def lost_rule(uid: str) -> str:
    """The style rule with which a snapshot hides its own view once that view is lost.

    A notebook saved and opened again with a new kernel has no widget models: the view's
    output would read "Error displaying widget: model not found" (its renderer's text, with
    no element in it) above the snapshot that stands in for it. Only that output, the one
    just before this snapshot, is hidden; a trusted notebook applies it.
    """
    out = ".jp-OutputArea-output"  # (a :has() cannot hold another: three side by side)
    return (f"<style>.jp-OutputArea-child:has(> {out}.jupyter-widgets):not(:has(> {out} > *))"
            f':has(+ .jp-OutputArea-child [data-nbkv-snapshot="{uid}"]){{display:none}}'
            "</style>")


class Snapshot:
    """A displayed view's static output, refreshed in place (``display_id``)."""

    def __init__(self, view: Any) -> None:
        from IPython.display import display

        self.view = view
        self.refreshes = 0
        self.last = 0.0
        self._shown = self.view.static_html()
        self.handle = display(self.bundle(self._shown), raw=True, display_id=True)

    def bundle(self, body: str | None = None) -> dict[str, str]:
        """The snapshot's display data: the view's static HTML, marked to be hidden live.

        ``body``: that HTML, drawn already (else drawn now).
        """
        body = self.view.static_html() if body is None else body
        uid = self.view.model_id
        return {"text/html": f'<div data-nbkv-snapshot="{uid}">{lost_rule(uid)}{body}</div>',
                "text/plain": f"nbkv {self.view.label}: the cache as last shown"}

    def refresh(self) -> bool:
        """Show the cache as it is now; False when nothing changed (nothing sent)."""
        self.last = time.monotonic()
        try:
            body = self.view.static_html()
            if body == self._shown:
                return False
            self.handle.update(self.bundle(body), raw=True)
            self._shown = body  # sent: not before (a failed update is sent again next time)
        except Exception:  # noqa: BLE001 - a snapshot must never break the feed
            log.exception("nbkv: the snapshot could not be refreshed")
            return False
        self.refreshes += 1
        return True


#: what a chart view gives its output: the figure, a function drawing its PNG, a line of text
ChartSource = Callable[[], tuple[dict[str, Any], Callable[[], bytes], str]]


class ChartOutput:
    """One chart's output beside a displayed view: plotly figure and PNG, refreshed in place.

    ``sizes`` are the bytes of every bundle sent (the first display, then each update): a
    figure that did not change is not sent again, nor its PNG drawn.
    """

    def __init__(self, source: ChartSource) -> None:
        from IPython.display import display

        self.source = source
        self.refreshes = 0
        self.last = 0.0
        self.sizes: list[int] = []
        self._figure: dict[str, Any] | None = None  # the figure last sent
        figure: dict[str, Any] | None = None
        try:
            figure, png, text = source()
            first = self._bundle(figure, png, text)
        except Exception:  # noqa: BLE001 - the live view must still show; a refresh retries
            log.exception("nbkv: the chart could not be drawn")
            first, figure = {"text/plain": "nbkv chart: not drawn (the log says why)"}, None
        self.handle = display(first, raw=True, display_id=True)
        self._figure = figure

    def _bundle(self, figure: dict[str, Any], png: Callable[[], bytes],
                text: str) -> dict[str, Any]:
        b = chartfig.bundle(figure, png(), text)
        self.sizes.append(chartfig.bundle_size(b))
        return b

    def refresh(self) -> bool:
        """Show the chart as it is now; False when it did not change (nothing sent)."""
        self.last = time.monotonic()
        try:
            figure, png, text = self.source()
            if figure == self._figure:
                return False
            shown = self._bundle(figure, png, text)
            # JupyterLab hands an update to the output's renderer, and jupyterlab-plotly's
            # ignores it once its chart went interactive (hovered): an output of another type
            # in between (as tall as the chart) makes it build a new one for the new figure
            holder = {"text/html": f'<div class="nbkv-chart-holder" style="height:'
                                   f'{int(figure.get("layout", {}).get("height") or 360)}px">'
                                   "</div>", "text/plain": text}
            self.sizes.append(chartfig.bundle_size(holder))
            self.handle.update(holder, raw=True)
            self.handle.update(shown, raw=True)
            self._figure = figure  # sent: not before (a failed update is sent again next time)
        except Exception:  # noqa: BLE001 - a chart must never break the feed
            log.exception("nbkv: the chart could not be refreshed")
            return False
        self.refreshes += 1
        return True


class Displayed:
    """Mixin of the views a notebook shows: the live view, then a :class:`Snapshot` beside it.

    ``label`` names the view in the snapshot's plain text; ``hider`` is the widget (an
    ``ipywidgets.HTML``) that carries :func:`hide_rule` in the live view. The snapshot of a
    view whose feed is not live (a picture of one moment) is never refreshed.
    """

    label = "view"
    hider: Any
    feed: Any

    def static_html(self) -> str:
        """The view as static HTML, as it is now."""
        raise NotImplementedError

    def chart_views(self) -> list[Any]:
        """The views among this one whose chart is an output of its own (a ``chart()``)."""
        return []

    def _ipython_display_(self) -> None:
        from IPython.display import display

        charts = self.chart_views()
        for view in charts:  # the charts are outputs of their own: not drawn twice
            view.svg = False
        bundle = super()._repr_mimebundle_()  # type: ignore[misc]  # the widget's view
        bundle["text/plain"] = (f"nbkv {self.label}: the live view (the snapshot beside it "
                                "shows the cache without a kernel)")
        display(bundle, raw=True)
        self.hider.value = hide_rule(self.model_id)  # type: ignore[attr-defined]
        outputs: list[Any] = [Snapshot(self)]
        outputs += [ChartOutput(view.chart) for view in charts]
        #: the outputs beside the live view (its snapshot, then its charts), refreshed in place
        self.outputs, self.chart_outputs = outputs, outputs[1:]
        if self.feed.live:
            self.feed.snapshots += outputs


def refresh_all() -> int:
    """Refresh now the snapshots of every nbkv view of this kernel; how many changed.

    The feeds do it on their own after requests (throttled); ``make notebooks`` calls this
    before it saves a notebook, so that every snapshot shows the cache after its last request.
    """
    with _lock:
        views = [v for _, r in _made if (v := r()) is not None]
    feeds = {id(v.feed): v.feed for v in views if getattr(v, "feed", None) is not None}
    return sum(feed.refresh_snapshots() for feed in feeds.values())
