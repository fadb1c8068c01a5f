"""Live views: a ``%%chat`` reply as it streams, and model loading.

The only code that touches ``IPython.display`` (imported when used). A view follows one
request through the engine's events itself (:meth:`ChatView.follow`).
"""

from __future__ import annotations

import html
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from nbkv.core.events import Progress, counted
from nbkv.core.progress import is_terminal
from nbkv.ui import vocabulary as vocab
from nbkv.ui.display import progress_html, progress_text
from nbkv.ui.figures import Figures, TurnFigures
from nbkv.ui.palette import NEUTRAL
from nbkv.ui.progress import ProgressBar


class ChatView:
    """Shows one ``%%chat`` reply as it streams: prefill progress, then the text.

    :meth:`progress` may be called from the engine's thread; the rest from the cell's.
    """

    def __init__(self, refresh: float = 0.1) -> None:
        self.refresh = refresh
        self._lock = threading.Lock()
        self._streaming = False
        self._last = 0.0
        self._shown = ""

    @contextmanager
    def follow(self, subscribe: Callable[[Callable[[Any], None]], Callable[[], None]],
               request_id: int) -> Iterator[ChatView]:
        """Show the prefill progress of request ``request_id`` while the block runs.

        ``subscribe`` is the engine's :meth:`~nbkv.Engine.subscribe`.
        """
        def on_event(event: Any) -> None:
            if (isinstance(event, Progress) and event.request_id == request_id
                    and event.phase != "generate" and event.done < event.total):
                self.progress(event.phase, event.done, event.total)

        unsubscribe = subscribe(on_event)
        try:
            yield self
        finally:
            unsubscribe()

    def stream(self, turn: Any,
               subscribe: Callable[[Callable[[Any], None]], Callable[[], None]],
               show_figures: bool = True) -> tuple[Any, bool]:
        """Show ``turn`` until its reply ends: progress, text, then the figures line.

        ``turn`` is a :class:`nbkv.notebook.sessions.PendingTurn` (iterated for its text,
        then its ``reply``); the reply is returned.

        A ``KeyboardInterrupt`` stops the reply (its partial text is kept in the session).
        Returns the reply and whether it was interrupted.
        """
        interrupted = False
        self.show_user(turn.user.get("content"))
        with self.follow(subscribe, turn.stream.request_id):
            try:
                with turn:
                    for _ in turn:
                        self.delta(turn.text)
            except KeyboardInterrupt:
                interrupted = True
        reply = turn.reply
        figures = (TurnFigures(reply.record, turn.note) if show_figures and reply.record
                   else None)
        # how the reply ended is said once: on the figures line, else after the reply
        note = "" if figures is not None or reply.record is None else vocab.ending(reply.record)
        self.finish(reply.text, figures, note)
        return reply, interrupted

    def show_user(self, content: Any) -> None:
        """Show what the user sent that the cell does not (images); text views skip it."""

    def progress(self, phase: str, done: int, total: int) -> None:
        """A prefill advanced (engine thread)."""
        with self._lock:
            if not self._streaming:
                self._show_progress(phase, done, total)

    def delta(self, text: str) -> None:
        """The reply so far (``text`` is cumulative); redrawn at most every ``refresh`` s."""
        with self._lock:
            first = not self._streaming
            self._streaming = True
            now = time.monotonic()
            if first or now - self._last >= self.refresh:
                self._last = now
                self._show_text(text, first)
                self._shown = text

    def finish(self, text: str, figures: Figures | None, note: str = "") -> None:
        """The reply ended: final text, then the figures line."""
        with self._lock:
            self._streaming = True
            self._show_text(text, final=True, note=note)
            self._shown = text
        if figures is not None:
            self._show_figures(figures)

    def _show_progress(self, phase: str, done: int, total: int) -> None:
        raise NotImplementedError

    def _show_text(self, text: str, first: bool = False, final: bool = False,
                   note: str = "") -> None:
        raise NotImplementedError

    def _show_figures(self, figures: Figures) -> None:
        raise NotImplementedError


class NotebookChatView(ChatView):
    """Streams into one display as Markdown (updated in place), figures below it."""

    def __init__(self, refresh: float = 0.1) -> None:
        super().__init__(refresh)
        from IPython.display import display

        self._display = display
        self._reply: Any = None  # the reply's display, made after the thumbnails
        self._progress_shown = False

    @property
    def _handle(self) -> Any:
        """The reply's display, made on first use."""
        return self._place_reply()

    def _place_reply(self) -> Any:
        if self._reply is None:
            self._reply = self._display({"text/plain": ""}, raw=True, display_id=True)
        return self._reply

    def show_user(self, content: Any) -> None:
        """Thumbnails (and file names) of the images the message carries, above the reply."""
        thumbs = [thumbnail_html(p) for p in content
                  if isinstance(p, dict) and p.get("type") == "image_url"
                  ] if isinstance(content, list) else []
        if thumbs:
            self._display({"text/html": '<div class="nbkv-images" style="margin:2px 0">'
                                        + "".join(thumbs) + "</div>",
                           "text/plain": f"[{counted(len(thumbs), 'image')}]"}, raw=True)
        self._place_reply()  # under the thumbnails

    def _show_progress(self, phase: str, done: int, total: int) -> None:
        self._progress_shown = True
        text = progress_text(phase, done, total)
        self._handle.update({"text/html": progress_html(text, str(done), str(max(total, 1))),
                             "text/plain": text}, raw=True)

    def _show_text(self, text: str, first: bool = False, final: bool = False,
                   note: str = "") -> None:
        body = text + (f"\n\n*[{note}]*" if note else "")
        if final and not body:
            if self._progress_shown:
                self._handle.update({"text/plain": ""}, raw=True)
            return
        self._handle.update({"text/markdown": body, "text/plain": body}, raw=True)

    def _show_figures(self, figures: Figures) -> None:
        self._display({"text/html": figures._repr_html_(), "text/plain": figures.text()},
                      raw=True)


class TerminalChatView(ChatView):
    """Streams deltas to a text stream (stdout), progress on one rewritten line.

    A stream that is not a terminal (a pipe, a log) gets the reply alone: no progress line,
    whose carriage returns would stay in it.
    """

    def __init__(self, out: TextIO | None = None, refresh: float = 0.1) -> None:
        super().__init__(refresh)
        self._out = out or sys.stdout
        self._progress_len = 0
        self._tty = is_terminal(self._out)

    def _write(self, s: str) -> None:
        self._out.write(s)
        self._out.flush()

    def _clear_progress(self) -> None:
        if self._progress_len:
            self._write("\r" + " " * self._progress_len + "\r")
            self._progress_len = 0

    def _show_progress(self, phase: str, done: int, total: int) -> None:
        if not self._tty:
            return
        line = progress_text(phase, done, total)
        self._write("\r" + line.ljust(self._progress_len))
        self._progress_len = max(self._progress_len, len(line))

    def delta(self, text: str) -> None:
        """Write the new part of ``text`` at once (terminals need no throttling)."""
        with self._lock:
            self._streaming = True
            self._clear_progress()
            self._write(text[len(self._shown):])
            self._shown = text

    def _show_text(self, text: str, first: bool = False, final: bool = False,
                   note: str = "") -> None:
        self._clear_progress()
        if text.startswith(self._shown):
            self._write(text[len(self._shown):])
        if final:
            self._write((f" [{note}]" if note else "") + "\n")

    def _show_figures(self, figures: Figures) -> None:
        self._write(figures.text() + "\n")


class LoadProgress(ProgressBar):
    """Loading an engine: its long steps (model, calibration, projector), then the summary.

    A bar in notebooks; in terminals a rewritten line on ``out`` (stdout).
    """

    def __init__(self, label: str, notebook: bool, out: TextIO | None = None) -> None:
        super().__init__(notebook, out or sys.stdout, label=label)


def thumbnail_html(part: dict[str, Any], size: int = 96) -> str:
    """A small inline picture of an ``image_url`` part, captioned with its file name."""
    import base64
    import io
    from pathlib import Path

    url = part.get("image_url")
    url = url.get("url", "") if isinstance(url, dict) else str(url or "")
    name = Path(url).name if not url.startswith("data:") else "image"
    try:
        from PIL import Image as PILImage

        with PILImage.open(url) as im:
            im.thumbnail((size, size))
            buf = io.BytesIO()
            im.convert("RGB").save(buf, format="PNG")
        src = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        pic = f'<img src="{src}" alt="{html.escape(name)}" style="max-height:{size}px">'
    except Exception:  # a data URI, or no PIL: the name alone
        pic = ""
    return (f'<figure style="display:inline-block;margin:0 8px 0 0;text-align:center">{pic}'
            f'<figcaption style="font:11px sans-serif;color:{NEUTRAL}">{html.escape(name)}'
            f"</figcaption></figure>")


def chat_view(notebook: bool, refresh: float = 0.1) -> ChatView:
    """The view for a ``%%chat`` reply: Markdown updated in place, or text on stdout."""
    return NotebookChatView(refresh) if notebook else TerminalChatView(refresh=refresh)
