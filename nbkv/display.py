"""Displayable results: HTML in notebooks (``_repr_html_``), plain text in terminals.

Also the live views of a ``%%chat`` cell and of model loading. Only the notebook views touch
IPython (imported when used), so tables and figures work anywhere.
"""

from __future__ import annotations

import html
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .engine import Engine, SlotInfo
    from .events import RequestRecord

_CELL = "padding:2px 8px;text-align:left;border-bottom:1px solid #e0e0e0"
COLORS = {"reused": "#2e9e5b", "prefilled": "#f08c2e", "generated": "#8e5cc7",
          "trimmed": "#d9534f"}


@dataclass(frozen=True)
class Cell:
    """A table cell with its own HTML and text renderings."""

    html: str
    text: str

    def __str__(self) -> str:
        return self.text


def _html(v: Any) -> str:
    return v.html if isinstance(v, Cell) else html.escape(str(v))


@dataclass(frozen=True)
class Table:
    """A small titled table."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    note: str = ""

    def _repr_html_(self) -> str:
        head = "".join(f'<th style="{_CELL}">{html.escape(c)}</th>' for c in self.columns)
        head = f"<thead><tr>{head}</tr></thead>" if any(self.columns) else ""
        body = "".join(
            "<tr>" + "".join(f'<td style="{_CELL}">{_html(v)}</td>' for v in r)
            + "</tr>" for r in self.rows
        )
        note = f'<div style="color:#666;font-size:90%">{html.escape(self.note)}</div>' \
            if self.note else ""
        return (f'<div class="nbkv-table"><b>{html.escape(self.title)}</b>'
                f'<table style="border-collapse:collapse;font-size:90%">{head}'
                f"<tbody>{body}</tbody></table>{note}</div>")

    def text(self) -> str:
        """Plain-text rendering with aligned columns."""
        header = any(self.columns)
        cells = ([tuple(self.columns)] if header else []) + [
            tuple(str(v) for v in r) for r in self.rows]
        widths = [max((len(r[i]) for r in cells), default=0) for i in range(len(self.columns))]
        lines = [self.title]
        for k, r in enumerate(cells):
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
            if k == 0 and header:
                lines.append("  ".join("-" * w for w in widths))
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def __str__(self) -> str:
        return self.text()


@dataclass(frozen=True)
class Message:
    """A one-line notice."""

    text: str

    def _repr_html_(self) -> str:
        return f'<div class="nbkv-message">{html.escape(self.text)}</div>'

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Figures:
    """The line shown under a reply: prompt | reused (salvage %) | prefilled | TTFT | tok/s."""

    record: RequestRecord

    def text(self) -> str:
        """The figures as one line of text."""
        r = self.record
        parts = [
            f"{r.strategy} · slot {r.slot}"
            + (f" (prefix from slot {r.donor_slot})" if r.donor_slot is not None else ""),
            f"prompt {r.prompt_tokens}",
            f"reused {r.reused_tokens} ({r.salvage_pct:.0f}%)",
            f"prefilled {r.prefilled_tokens}",
            f"TTFT {r.ttft_s * 1000:.0f} ms",
            f"{r.decode_tps:.1f} tok/s",
        ]
        if r.trimmed_tokens:
            parts.append(f"trimmed {r.trimmed_tokens}")
        if r.evicted_session is not None or r.evicted_tokens:
            parts.append(f"evicted {r.evicted_session!s} ({r.evicted_tokens} tokens)")
        if r.checkpoint_pos is not None:
            parts.append(f"checkpoint {r.checkpoint_pos}"
                         + (f" (+{r.reprefilled_tokens} re-read)" if r.reprefilled_tokens
                            else ""))
        elif r.reprefilled_tokens:
            parts.append(f"re-read {r.reprefilled_tokens} (no checkpoint)")
        if r.rewrite_absorbed:
            parts.append(f"reply re-read {r.rewrite_absorbed}")
        if r.dropped_messages:
            parts.append(f"dropped {r.dropped_messages} oldest messages")
        if r.finish_reason not in ("stop", ""):
            parts.append(r.finish_reason)
        return " | ".join(parts)

    def _repr_html_(self) -> str:
        r = self.record
        total = max(r.prompt_tokens, 1)
        bar = "".join(
            f'<span style="display:inline-block;height:8px;width:{80 * n / total:.1f}px;'
            f'background:{COLORS[k]}"></span>'
            for k, n in (("reused", r.reused_tokens), ("prefilled", r.prefilled_tokens)) if n
        )
        return (f'<div class="nbkv-figures" style="font:12px monospace;color:#555">'
                f'<span style="display:inline-block;width:80px;background:#eee;'
                f'margin-right:6px">{bar}</span>{html.escape(self.text())}</div>')

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def progress_text(phase: str, done: int, total: int) -> str:
    """``rebuild: prefilled 800/2000 tokens (40%)``."""
    pct = 100 * done / total if total else 100
    what = "rebuilding the cache" if phase == "rebuild" else "extending the cache"
    return f"{what}: prefilled {done}/{total} tokens ({pct:.0f}%)"


def progress_html(phase: str, done: int, total: int) -> str:
    """A progress bar for a prefill."""
    return (f'<div class="nbkv-progress" style="font:12px monospace;color:#555">'
            f'<progress value="{done}" max="{max(total, 1)}" style="width:200px"></progress> '
            f"{html.escape(progress_text(phase, done, total))}</div>")


# ---------------------------------------------------------------- tables of engine state

MEDIA_COLOR = "#e377c2"


def is_media(seg: Any) -> bool:
    """True for the positions of an image (or other media) chunk."""
    return seg.kind != "text"


def media_chunks(slot: SlotInfo) -> int:
    """Media chunks (images) whose embeddings the slot holds."""
    return slot.n_media


ROLE_COLORS = {"system": "#5b6770", "user": "#3b7dd8", "assistant": "#17a2b8",
               "tool": "#a0522d"}
_ROLE_CHARS = {"system": "s", "user": "u", "assistant": "a", "tool": "t"}


def kv_strip(slot: SlotInfo, width: int = 48, span: int | None = None) -> Cell:
    """A slot's KV positions as a strip: one span per message, coloured by role.

    Reused positions are solid, prefilled ones lighter and generated ones striped (for the
    slot's latest request), images pink; the text form uses one letter per role (``i`` for
    an image), upper case if reused. Checkpoints (hybrid and recurrent models) are dark ticks,
    ``|`` in the text form at the column where their position starts. The strip covers
    positions ``0..span`` (default: the slot's capacity).
    """
    cap = max(span or slot.capacity, 1)
    spans, chars = [], []
    for seg in slot.segments:
        color = MEDIA_COLOR if is_media(seg) else ROLE_COLORS.get(seg.role, "#999")
        style = {"reused": "", "prefilled": "opacity:0.6;",
                 "generated": "background-image:repeating-linear-gradient(45deg,transparent 0 "
                              "3px,rgba(255,255,255,.5) 3px 6px);"}.get(seg.state, "")
        tip = html.escape(f"message {seg.message} · {seg.role} · tokens {seg.start}–{seg.end} "
                          f"· {seg.state}: {seg.preview}", quote=True)
        spans.append(f'<span title="{tip}" style="display:inline-block;height:12px;'
                     f"width:{100 * seg.length / cap:.2f}%;background:{color};{style}"
                     f'border-right:1px solid white;box-sizing:border-box"></span>')
        c = "i" if is_media(seg) else _ROLE_CHARS.get(seg.role, "?")
        chars.append((c.upper() if seg.state == "reused" else c, seg.start, seg.length))
    text, runs = "", []  # runs: (first position, positions, first column, columns)
    for c, start, n in chars:
        if n:
            k = max(round(n * width / cap), 1)
            runs.append((start, n, len(text), k))
            text += c * k
    text = text[:width].ljust(width, ".")
    ticks = []
    for pos in slot.checkpoints:
        if pos > cap:
            continue
        col = _column(runs, pos, width / cap)
        if col < width:
            text = text[:col] + "|" + text[col + 1:]
        ticks.append(f'<span class="nbkv-checkpoint" title="checkpoint at {pos}" '
                     f'style="position:absolute;top:0;left:{100 * pos / cap:.2f}%;'
                     f'margin-left:-1px;width:2px;height:12px;background:#222"></span>')
    return Cell(
        f'<div class="nbkv-kvstrip" style="position:relative;width:240px;background:#f0f0f0;'
        f'line-height:0;white-space:nowrap;overflow:hidden">{"".join(spans + ticks)}</div>',
        "[" + text + "]",
    )


def _column(runs: list[tuple[int, int, int, int]], pos: int, scale: float) -> int:
    """The text column where KV position ``pos`` starts, following the strip's own runs."""
    for start, n, at, k in runs:
        if pos < start + n:
            return at + round(max(pos - start, 0) * k / n)
    start, n, at, k = runs[-1] if runs else (0, 0, 0, 0)
    return at + k + round((pos - start - n) * scale)


def size_text(nbytes: int) -> str:
    """``3.2 KiB``, ``5.0 MiB``."""
    return (f"{nbytes / 1024:.1f} KiB" if nbytes < 1024 * 1024
            else f"{nbytes / (1024 * 1024):.1f} MiB")


def checkpoints_text(slot: SlotInfo, used: bool) -> str:
    """A slot's checkpoints: ``3 (3.2 KiB)``; ``-`` when the model needs none (``used``)."""
    if not used and not slot.checkpoints:
        return "-"
    n = len(slot.checkpoints)
    return f"{n} ({size_text(slot.checkpoint_bytes)})" if n else "0"


def status_table(engine: Engine | None, sessions: Iterable[Any] = ()) -> Table | Message:
    """Model, slots, cache mode, totals."""
    if engine is None:
        return Message("no engine loaded: run %kvcache load (the embedded SmolLM2-135M) "
                       "or %kvcache load PATH.gguf")
    s = engine.stats()
    used = sum(x.n_tokens for x in engine.slots())
    names = [x.name for x in sessions]
    rows = (
        ("model", engine.model.description),
        ("memory", engine.memory.describe()),
        ("slots", f"{engine.n_slots} x {engine.n_ctx} tokens"),
        ("cache", f"{engine.cache} (min {engine.cache_min_tokens} tokens)"),
        ("KV in use", f"{used}/{engine.n_slots * engine.n_ctx} tokens"),
        ("requests", f"{s['requests']} ({_strategies(s['strategies'])})"),
        ("served from cache", f"{s['reused_tokens']}/{s['prompt_tokens']} prompt tokens "
                              f"({s['salvage_pct']:.0f}%)"),
        ("guessed tokens", f"{s['draft_accepted']}/{s['draft_tokens']} right "
                           f"({s['draft_acceptance_pct']:.0f}%): each a token for free"
         if s["draft_tokens"] else "none yet" if engine.speculative else "off"),
        ("sessions", ", ".join(names) or "none"),
        *persist_rows(engine),
    )
    return Table("nbkv engine", ("", ""), rows, note=s.get("advice") or "")


def persist_rows(engine: Any) -> tuple[tuple[str, str], ...]:
    """Status rows for the latest %kvcache save and restore: when, how long, bytes per slot."""
    rows = []
    for label, rep in (("last save", getattr(engine, "last_save", None)),
                       ("last restore", getattr(engine, "last_restore", None))):
        if rep is None:
            continue
        when = time.strftime("%H:%M:%S", time.localtime(
            getattr(rep, "created", None) or getattr(rep, "saved_at", 0.0)))
        per = ", ".join(f"slot {s.index} {s.nbytes / 2**20:.1f} MiB" for s in rep.slots)
        rows.append((label, f"{rep.seconds:.2f} s, {rep.nbytes / 2**20:.1f} MiB "
                            f"({per or 'no slot'}) · {when} · {rep.path}"))
    return tuple(rows)


def slots_table(engine: Engine) -> Table:
    """One row per slot: session, messages, tokens, LRU rank, pending, media, checkpoints."""
    slots = engine.slots()
    order = sorted((s for s in slots if not s.empty), key=lambda s: -s.last_used)
    rank = {s.index: i + 1 for i, s in enumerate(order)}
    cap = max((s.capacity for s in slots), default=1)
    span = min(cap, max(max((s.n_tokens for s in slots), default=0) * 5 // 4, cap // 8, 1))
    used = engine.memory.checkpoints
    rows = tuple(
        (s.index, s.session or "-", s.n_messages, f"{s.n_tokens}/{s.capacity}",
         rank.get(s.index, "-"), "yes" if s.pending else "", media_chunks(s),
         checkpoints_text(s, used), kv_strip(s, span=span))
        for s in slots
    )
    return Table("slots", ("slot", "session", "messages", "tokens", "LRU", "pending", "media",
                           "checkpoints", f"KV map (positions 0–{span})"), rows,
                 note="LRU 1 = most recently used, evicted last. KV map: one span per message "
                      "(s/u/a = system/user/assistant, i = image; upper case = reused by the "
                      "latest request" + ("; | = checkpoint)" if used else ")"))


def stats_table(engine: Engine) -> Table:
    """Totals over the request history."""
    s = engine.stats()
    rows = tuple(
        (k, _strategies(v) if isinstance(v, dict) else
         (f"{v:.1f}" if isinstance(v, float) else v)) for k, v in s.items()
    )
    return Table("cache statistics", ("", ""), rows)


def history_table(records: Sequence[RequestRecord], last: int = 20) -> Table:
    """The most recent request records."""
    recs = list(records)[-last:] if last else list(records)
    rows = tuple(
        (r.id, r.session or "-", r.strategy, r.slot, r.prompt_tokens,
         f"{r.reused_tokens} ({r.salvage_pct:.0f}%)", r.prefilled_tokens, r.trimmed_tokens,
         r.generated_tokens, f"{r.ttft_s * 1000:.0f}", f"{r.decode_tps:.1f}",
         r.finish_reason, r.evicted_session or "")
        for r in recs
    )
    cols = ("id", "session", "strategy", "slot", "prompt", "reused", "prefilled", "trimmed",
            "generated", "TTFT ms", "tok/s", "finish", "evicted")
    return Table(f"last {len(rows)} requests", cols, rows)


def _strategies(by: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])) or "-"


# ------------------------------------------------------------------------ live views

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
        self._handle = display({"text/plain": ""}, raw=True, display_id=True)
        self._progress_shown = False

    def _show_progress(self, phase: str, done: int, total: int) -> None:
        self._progress_shown = True
        self._handle.update({"text/html": progress_html(phase, done, total),
                             "text/plain": progress_text(phase, done, total)}, raw=True)

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
    """Streams deltas to a text stream (stdout), progress on one rewritten line."""

    def __init__(self, out: TextIO | None = None, refresh: float = 0.1) -> None:
        super().__init__(refresh)
        self._out = out or sys.stdout
        self._progress_len = 0

    def _write(self, s: str) -> None:
        self._out.write(s)
        self._out.flush()

    def _clear_progress(self) -> None:
        if self._progress_len:
            self._write("\r" + " " * self._progress_len + "\r")
            self._progress_len = 0

    def _show_progress(self, phase: str, done: int, total: int) -> None:
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


class LoadProgress:
    """Model-loading progress: a bar in notebooks, a rewritten line in terminals."""

    def __init__(self, label: str, notebook: bool, out: TextIO | None = None) -> None:
        self.label = label
        self._out = out or sys.stdout
        self._handle = None
        self._last = -1.0
        if notebook:
            from IPython.display import display

            self._handle = display({"text/plain": f"{label}: 0%"}, raw=True, display_id=True)

    def __call__(self, fraction: float) -> None:
        """Report the fraction loaded (0..1); redrawn every 5%."""
        if fraction < 1.0 and fraction - self._last < 0.05:
            return
        self._last = fraction
        text = f"{self.label}: {fraction * 100:.0f}%"
        if self._handle is not None:
            self._handle.update({
                "text/html": f'<div class="nbkv-progress" style="font:12px monospace">'
                             f'<progress value="{fraction:.3f}" max="1" style="width:200px">'
                             f"</progress> {html.escape(text)}</div>",
                "text/plain": text}, raw=True)
        else:
            self._out.write("\r" + text)
            self._out.flush()

    def done(self, summary: Any) -> None:
        """Replace the bar with ``summary`` (a displayable)."""
        if self._handle is not None:
            self._handle.update(summary)
        else:
            self._out.write("\r" + " " * (len(self.label) + 6) + "\r")
            self._out.flush()
