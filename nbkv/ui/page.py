"""``nbkv.report(engine)``: the cache on one self-contained page (``%kvcache report FILE``).

The dashboard (slot cards, KV map, timeline) as inline SVG, the request history, the
statistics, and the story of the last requests (``%kvcache explain``), in one HTML file with
no script and nothing fetched from elsewhere: it opens offline, in any browser, and can be
attached to a bug report or a lesson. In a notebook (``%kvcache report`` with no file) the
charts are outputs of their own after the page, one plotly figure and PNG each, as
everywhere in a notebook: an untrusted notebook strips inline SVG. Nothing here imports
Jupyter at import time.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbkv.core.errors import NbkvError
from nbkv.ui import static
from nbkv.ui.display import history_table, stats_table
from nbkv.ui.figures import ExplainReport
from nbkv.ui.palette import INK, MUTED, PAPER, TEXT


@dataclass
class Report:
    """A snapshot of an engine's cache, rendered as HTML when shown or written."""

    engine: Any
    explain_last: int = 3  # the latest requests whose renderings are shown side by side
    title: str = "nbkv: what the KV cache did"

    def body(self, charts: bool = True) -> str:
        """The page's content (no ``<html>`` around it).

        ``charts=False``: without the KV map and the timeline (a notebook shows them as
        outputs of their own).
        """
        e = self.engine
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        parts = [f'<h2 style="font:bold 16px sans-serif;color:{INK};margin:4px 0">'
                 f"{html.escape(self.title)}</h2>"
                 f'<div style="color:{MUTED};font-size:12px">snapshot of {when}</div>',
                 static.dashboard_html(e, caption=False, charts=charts),
                 history_table(e.history, last=0)._repr_html_(), stats_table(e)._repr_html_()]
        stories = []
        for rec in list(e.history)[-self.explain_last:] if self.explain_last else []:
            try:
                stories.append(ExplainReport(e.explain(rec.id))._repr_html_())
            except NbkvError:  # too old, or an engine that cannot explain
                continue
        if stories:
            parts += [_section(f"the last {len(stories)} requests, explained"), *stories]
        return f'<div class="nbkv-report">{"".join(parts)}</div>'

    def html(self) -> str:
        """A whole HTML document: no script, no stylesheet or font from elsewhere."""
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><meta name=\"viewport\" "
                "content=\"width=device-width\"></head>"
                f'<body style="margin:16px;background:{PAPER};color:{TEXT};'
                f'font:13px sans-serif">{self.body()}</body></html>\n')

    def to_html(self, path: str | Path) -> Path:
        """Write the page to ``path`` (UTF-8); returns the path."""
        p = Path(path).expanduser()
        p.write_text(self.html(), encoding="utf-8")
        return p

    def _repr_html_(self) -> str:
        return self.body()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        from nbkv.ui.chartfig import history_chart, slots_chart

        e = self.engine
        display({"text/html": self.body(charts=False), "text/plain": self.title}, raw=True)
        for chart in (slots_chart(None, e), history_chart(None, e.history, 50)):
            display(chart.bundle(), raw=True)


def _section(title: str) -> str:
    return (f'<h3 style="font:bold 14px sans-serif;color:{INK};margin:14px 0 4px">'
            f"{html.escape(title)}</h3>")


def report(engine: Any, explain_last: int = 3) -> Report:
    """The cache of ``engine`` as a page: ``.to_html(path)``.

    ``nbkv.report()`` finds the loaded engine when none is given.
    """
    return Report(engine, explain_last)
