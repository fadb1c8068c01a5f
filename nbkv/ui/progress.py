"""Long work in a notebook: one progress bar in the running cell, with its line as text.

:class:`ProgressBar` is a reporter (:mod:`nbkv.core.progress`): it shows each
:class:`~nbkv.core.progress.Step` as an HTML ``<progress>`` bar and the step's line ("checking
which prefill groupings are exact on this CPU (once per model, llama.cpp build and CPU): 3
of 8"), and as the same line in ``text/plain``, which a terminal, a saved notebook and
nbconvert show. In a terminal it is one line on stderr, rewritten in place. The output is
made when the bar is (in the caller's thread, so in the running cell) and updated in place
from whichever thread reports; a finished work leaves it empty, or :meth:`done` replaces it
with a summary.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from nbkv.core.progress import Step, TerminalLine
from nbkv.ui.display import Message, progress_html


class ProgressBar:
    """Steps of long work as a bar in the running cell (notebook) or a line (terminal)."""

    def __init__(self, notebook: bool, out: TextIO | None = None, interval: float = 0.2,
                 label: str = "") -> None:
        self.notebook = notebook
        self.interval = interval
        self._lock = threading.Lock()
        self._last = 0.0
        self._handle: Any = None
        self._line = TerminalLine(out or sys.stderr)
        if notebook:
            from IPython.display import display

            first = {"text/plain": label} if label else {"text/plain": ""}
            self._handle = display(first, raw=True, display_id=True)

    def __call__(self, step: Step) -> None:
        """Show ``step`` (at most every ``interval`` s; its end and 100% always)."""
        if self._handle is None:
            self._line(step)
            return
        with self._lock:
            now = time.monotonic()
            if self._last == float("inf"):  # done(): the summary stays
                return
            if not step.final and step.fraction != 1.0 and now - self._last < self.interval:
                return
            self._last = now
            if step.final:
                self._handle.update({"text/plain": ""}, raw=True)
            else:
                frac = step.fraction
                html = progress_html(step.text(), "" if frac is None else f"{frac:.3f}")
                self._handle.update({"text/html": html, "text/plain": step.text()}, raw=True)

    def done(self, summary: Any, note: str | None = None) -> None:
        """Replace the bar with ``summary`` (a displayable), then show ``note`` if any."""
        if self._handle is not None:
            with self._lock:
                self._handle.update(summary)
                self._last = float("inf")  # a late step (a helper thread's) draws nothing
            if note:
                from IPython.display import display

                display(Message(note))
        else:
            self._line(Step("", final=True))
            if note:
                self._line.out.write(note + "\n")
                self._line.out.flush()
