"""Static reports: HTML in notebooks (``_repr_html_``), plain text in terminals.

The tables of ``%kvcache`` (status, slots, stats, history), the KV strip and the figures line
under a reply. Nothing here touches IPython; the live views are :mod:`nbkv.ui.views`.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbkv.core.events import counted
from nbkv.core.protocol import ServerBacked, ServerCacheRows
from nbkv.ui import vocabulary as vocab
from nbkv.ui.palette import (
    COLORS,
    INK,
    MEDIA_COLOR,
    MUTED,
    NEUTRAL,
    ROLE_COLORS,
    RULE,
    STRIP_BACKGROUND,
    STRIPE,
    TEXT,
)

if TYPE_CHECKING:
    from nbkv.core.events import RequestRecord
    from nbkv.core.protocol import EngineLike
    from nbkv.engine.facade import Engine, SlotInfo

_CELL = f"padding:2px 8px;text-align:left;border-bottom:1px solid {RULE}"


@dataclass(frozen=True)
class Cell:
    """A table cell with its own HTML and text renderings."""

    html: str
    text: str

    def __str__(self) -> str:
        return self.text


def _html(v: Any) -> str:
    return v.html if isinstance(v, Cell) else html.escape(str(v))


def _rows_html(rows: Iterable[Sequence[Any]]) -> str:
    return "".join("<tr>" + "".join(f'<td style="{_CELL}">{_html(v)}</td>' for v in r)
                   + "</tr>" for r in rows)


def esc(text: Any) -> str:
    """HTML-escaped text, quotes included (safe in attributes)."""
    return html.escape(str(text), quote=True)


def tip(text: str, body: str, cls: str = "") -> str:
    """``body`` with ``text`` as its tooltip."""
    c = f' class="{cls}"' if cls else ""
    return f'<span{c} title="{esc(text)}" style="cursor:help">{body}</span>'


def reuse_bar(r: RequestRecord, width: int) -> str:
    """A prompt's tokens in ``width`` px: reused (green), then read new (orange)."""
    total = max(r.prompt_tokens, 1)
    return "".join(
        f'<span style="display:inline-block;height:8px;width:{width * n / total:.1f}px;'
        f'background:{COLORS[k]}"></span>'
        for k, n in (("reused", r.reused_tokens), ("prefilled", r.prefilled_tokens)) if n)


def lru_ranks(slots: Sequence[Any]) -> tuple[dict[int, int], int]:
    """Each used slot's LRU rank (1 = most recently used) and the number of used slots."""
    order = sorted((s for s in slots if not s.empty), key=lambda s: -s.last_used)
    return {s.index: i + 1 for i, s in enumerate(order)}, len(order)


def strip_span(slots: Sequence[Any]) -> int:
    """Positions a table's KV strips cover: those in use plus a quarter, at least cap / 8."""
    cap = max((s.capacity for s in slots), default=1) or 1
    return min(cap, max(max((s.n_tokens for s in slots), default=0) * 5 // 4, cap // 8, 1))


@dataclass(frozen=True)
class Table:
    """A small titled table."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    note: str = ""  # under the table, in both renderings
    html_note: str = ""  # HTML shown instead of ``note`` in notebooks (e.g. a colour legend)
    details: tuple[tuple[Any, ...], ...] = ()  # rows shown only on demand ("details")

    def _repr_html_(self) -> str:
        head = "".join(f'<th style="{_CELL}">{html.escape(c)}</th>' for c in self.columns)
        head = f"<thead><tr>{head}</tr></thead>" if any(self.columns) else ""
        body = _rows_html(self.rows)
        note = self.html_note or (
            f'<div style="color:{MUTED};font-size:90%">{html.escape(self.note)}</div>'
            if self.note else "")
        more = ""
        if self.details:
            more = (f'<details><summary style="cursor:pointer;color:{MUTED};font-size:90%">'
                    f'details</summary><table style="border-collapse:collapse;font-size:90%">'
                    f"<tbody>{_rows_html(self.details)}</tbody></table></details>")
        return (f'<div class="nbkv-table"><b>{html.escape(self.title)}</b>'
                f'<table style="border-collapse:collapse;font-size:90%">{head}'
                f"<tbody>{body}</tbody></table>{more}{note}</div>")

    def text(self) -> str:
        """Plain-text rendering with aligned columns."""
        header = any(self.columns)
        cells = ([tuple(self.columns)] if header else []) + [
            tuple(str(v) for v in r) for r in self.rows + self.details]
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


LEGEND_STATES = tuple((k, vocab.STATES[k].words) for k in ("reused", "prefilled", "generated",
                                                              "trimmed"))
LEGEND_ROLES = tuple((k, vocab.ROLES[k].words) for k in ("system", "user", "assistant"))
#: how a slot strip shades its spans by what the latest request did (the colour is the role)
STRIP_SHADES = {"reused": "", "prefilled": "opacity:0.6;",
                "generated": f"background-image:repeating-linear-gradient(45deg,transparent 0 "
                             f"3px,{STRIPE} 3px 6px);"}
_STRIP_SHADE_WORDS = {"reused": "solid", "prefilled": "pale", "generated": "striped"}


def swatch(color: str, term: vocab.Term, style: str = "", label: str = "") -> str:
    """A small colour square and the term's words, its tooltip on hover."""
    return (f'<span title="{html.escape(term.tip, quote=True)}" style="white-space:nowrap;'
            f'margin-right:10px;cursor:help"><span style="display:inline-block;width:10px;'
            f'height:10px;background:{color};{style}margin-right:3px;vertical-align:-1px">'
            f"</span>{html.escape(label or term.words)}</span>")


def _marks(divergence: bool = True) -> str:
    m = vocab.MARKS
    return (f'<span title="{html.escape(m["checkpoint-mark"].tip, quote=True)}" '
            f'style="margin-right:10px;cursor:help">▏ {m["checkpoint-mark"].words}</span>'
            + (f'<span title="{html.escape(m["divergence"].tip, quote=True)}" '
               f'style="cursor:help">▼ {m["divergence"].words}</span>' if divergence else ""))


def legend_html(kind: str = "dashboard") -> str:
    """The one legend: what each colour and mark means, in the words of :mod:`nbkv.ui.vocabulary`.

    ``"dashboard"``: the request rows, bars and figures line (what the latest request did)
    and the message rows (who wrote it). ``"strips"``: the ``%kvcache slots`` strips, which
    are coloured by who wrote each message and shaded by what the latest request did.
    """
    roles = "".join(swatch(ROLE_COLORS[k], vocab.ROLES[k]) for k, _ in LEGEND_ROLES)
    roles += swatch(MEDIA_COLOR, vocab.ROLES["image"])
    box = f'<div class="nbkv-legend" style="font:11px sans-serif;color:{TEXT};margin:4px 0">'
    if kind == "strips":
        sample = ROLE_COLORS["user"]
        shades = "".join(
            swatch(sample, vocab.STATES[k], STRIP_SHADES[k],
                   f"{_STRIP_SHADE_WORDS[k]} = {vocab.STATES[k].words}")
            for k in STRIP_SHADES)
        return (f"{box}<div><b>who wrote it</b> (the colour of each span): {roles}</div>"
                f"<div><b>what the latest request did</b> (its shading): {shades}"
                f"{_marks(divergence=False)}</div></div>")
    states = "".join(swatch(COLORS[k], vocab.STATES[k]) for k, _ in LEGEND_STATES)
    return (f"{box}<div><b>what the latest request did</b> (request rows, bars, figures): "
            f"{states}</div><div><b>who wrote it</b> (message rows, slot strips): {roles}"
            f"{_marks()}</div></div>")


LEGEND_TEXT = ("KV map letters: s/u/a = system/user/assistant, i = image; UPPER CASE = reused "
               "by the latest request")


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


def progress_text(phase: str, done: int, total: int) -> str:
    """``rebuild: prefilled 800/2000 tokens (40%)``."""
    pct = 100 * done / total if total else 100
    what = "rebuilding the cache" if phase == "rebuild" else "extending the cache"
    return f"{what}: prefilled {done}/{total} tokens ({pct:.0f}%)"


def progress_html(text: str, value: str = "", top: str = "1") -> str:
    """A progress bar (indeterminate without ``value``) and its line of ``text``."""
    at = f'value="{value}" max="{top}" ' if value else ""
    return (f'<div class="nbkv-progress" style="font:12px monospace;color:{NEUTRAL}">'
            f'<progress {at}style="width:200px"></progress> {html.escape(text)}</div>')


# ---------------------------------------------------------------- tables of engine state

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
        color = MEDIA_COLOR if seg.is_media else ROLE_COLORS.get(seg.role, ROLE_COLORS["other"])
        style = STRIP_SHADES.get(seg.state, "")
        what = f"image {seg.image_name}" if seg.is_media and seg.image_name else seg.preview
        where = f"tokens {seg.start}–{seg.end}"
        if seg.is_media and seg.embeddings and seg.embeddings != seg.length:  # M-RoPE
            where = f"positions {seg.start}–{seg.end} ({seg.embeddings} image tokens)"
        state = vocab.STATES[seg.state].words if seg.state in vocab.STATES else seg.state
        hover = esc(f"message {seg.message} · {seg.role} · {where} · {state}: {what}")
        spans.append(f'<span title="{hover}" style="display:inline-block;height:12px;'
                     f"width:{100 * seg.length / cap:.2f}%;background:{color};{style}"
                     f'border-right:1px solid white;box-sizing:border-box"></span>')
        c = "i" if seg.is_media else _ROLE_CHARS.get(seg.role, "?")
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
                     f'margin-left:-1px;width:2px;height:12px;background:{INK}"></span>')
    return Cell(
        f'<div class="nbkv-kvstrip" style="position:relative;width:240px;'
        f'background:{STRIP_BACKGROUND};'
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


def engine_label(engine: Any) -> str:
    """What the engine runs: the model's name, and the server for a remote engine."""
    if isinstance(engine, ServerBacked):
        return f"{engine.kind} {engine.model_name} at {engine.url}"
    return engine.model.name


def slots_label(engine: Any) -> str:
    """``4 slots x 2048 tokens``, or who manages them."""
    if not engine.n_slots:
        return "slots managed by the server"
    return f"{engine.n_slots} slots x {engine.n_ctx} tokens"


def status_table(engine: EngineLike | None, sessions: Iterable[Any] = ()) -> Table | Message:
    """Model, slots, cache mode, totals."""
    if engine is None:
        return Message("no engine loaded: run %kvcache load (the embedded SmolLM2-135M) "
                       "or %kvcache load PATH.gguf")
    s = engine.stats()
    names = [x.name for x in sessions]
    if isinstance(engine, ServerBacked):
        unverified = s.get("not_verified")
        return Table("nbkv remote engine", ("", ""), (
            *engine.describe(),
            ("requests", f"{s['requests']} ({_events(s)})"),
            ("served from cache", f"{s['reused_tokens']}/{s['prompt_tokens']} prompt tokens "
                                  f"({s['salvage_pct']:.0f}%)"),
            *((("not verified", f"{counted(unverified, 'request')}: the server's figures differed "
                                f"from nbkv's slot table"),) if unverified else ()),
            ("sessions", ", ".join(names) or "none"),
            *persist_rows(engine),
        ), note=s.get("advice") or "")
    from nbkv.engine.facade import Engine

    if not isinstance(engine, Engine):
        raise TypeError(f"no status for {type(engine).__name__}: neither nbkv's Engine nor "
                        "a server-backed engine")
    used = sum(x.n_tokens for x in engine.slots())
    rows = (
        ("model", f"{engine.model.name} · {engine.model.path.name}"),
        *((("vision", f"{engine.projector.info.projector_type} projector · "
                      f"{engine.projector.path.name}"),) if engine.projector else ()),
        ("memory", engine.memory.describe()),
        ("exact", _exactness(engine)),
        *hardware_rows(engine),
        ("slots", f"{engine.n_slots} x {engine.n_ctx} tokens"),
        ("cache", f"{engine.cache} (min {engine.cache_min_tokens} tokens)"),
        ("KV in use", f"{used}/{engine.n_slots * engine.n_ctx} tokens"),
        ("requests", f"{s['requests']} ({_events(s)})"),
        ("served from cache", f"{s['reused_tokens']}/{s['prompt_tokens']} prompt tokens "
                              f"({s['salvage_pct']:.0f}%)"),
        ("guessed tokens", f"{s['draft_accepted']}/{s['draft_tokens']} right "
                           f"({s['draft_acceptance_pct']:.0f}%): each a token for free"
         if s["draft_tokens"] else "none yet" if engine.speculative else "off"),
        ("sessions", ", ".join(names) or "none"),
        *persist_rows(engine),
    )
    return Table("nbkv engine", ("", ""), rows, note=s.get("advice") or "")


def _exactness(engine: Any) -> str:
    """The status row on exactness: the calibrated grouping, or why nothing is claimed."""
    text = engine.model.exactness.removeprefix("exact: ")
    if not engine.exact:
        return f"off (exact=False: replies are not rewritten); calibration: {text}"
    return text


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


def hardware_rows(engine: Engine) -> tuple[tuple[str, str], ...]:
    """Where the engine runs and what its KV takes: devices, offload, KV types, bytes."""
    from nbkv.llama.hardware import describe_devices, devices, gpu_offload

    hw, plan = getattr(engine, "hardware", None), getattr(engine, "plan", None)
    if hw is None or plan is None:
        return ()
    layers = engine.model.params.n_gpu_layers
    offload = (f"{'all' if layers < 0 else layers} layers on the GPU" if gpu_offload()
               else "none: this llama.cpp build has no GPU backend")
    actual = engine.ctx.kv_buffer_bytes
    return (
        ("devices", describe_devices(devices())),
        *((("threads", threads_text(engine.n_threads)),) if hasattr(engine, "n_threads")
          else ()),
        ("offload", offload),
        ("KV cache", f"K {hw.type_k}, V {hw.type_v}, flash attention {engine.flash_attn}"),
        ("KV memory", f"{plan.per_slot / 2**20:.1f} MiB per slot, "
                      f"{plan.kv_bytes_per_token / 1024:.1f} KiB per token, "
                      f"{plan.total / 2**20:.1f} MiB in all"
                      + (f" (llama.cpp allocated {actual / 2**20:.1f} MiB)" if actual else "")),
    )


def threads_text(n_threads: int) -> str:
    """The engine's threads and why that many: ``1 (a CPU quota of 0.5 of the 16 cores, ...)``."""
    from nbkv.llama.cpus import cpu_budget

    budget = cpu_budget()
    if n_threads == budget.threads:
        return budget.describe()
    return f"{n_threads} (n_threads; this process may use {budget.describe()})"


def slots_table(engine: EngineLike) -> Table:
    """One row per slot: session, messages, tokens, LRU rank, pending, images, checkpoints."""
    slots = engine.slots()
    rank, n_used = lru_ranks(slots)
    span = strip_span(slots)
    memory = getattr(engine, "memory", None)
    used = bool(getattr(memory, "takes_checkpoints", False))
    server = {x.get("id"): x for x in getattr(engine, "server_slots", None) or ()}

    def lru(s: Any) -> Any:
        r = rank.get(s.index)
        return "-" if r is None else Cell(tip(vocab.lru_tip(r, n_used), str(r)), str(r))

    rows = tuple(
        (s.index, (s.session or "-") + ("" if s.verified else f" (not verified: {s.note})"),
         s.n_messages, f"{s.n_tokens}/{s.capacity}",
         *((_server_slot(server.get(s.index)),) if server else ()),
         lru(s), "yes" if s.pending else "", s.n_media,
         checkpoints_text(s, used), kv_strip(s, span=span))
        for s in slots
    )
    if not slots:
        return server_sessions_table(engine)
    return Table("slots", ("slot", "session", "messages", "tokens",
                           *(("server holds (/slots)",) if server else ()), "LRU", "pending",
                           "images", "checkpoints", f"KV map (positions 0–{span})"), rows,
                 note="LRU 1 = most recently used, evicted last. " + LEGEND_TEXT
                      + ("; | = checkpoint" if used else ""),
                 html_note=f'<div style="color:{MUTED};font-size:90%">LRU 1 = most recently '
                           "used, evicted last. KV map: one span per message.</div>"
                           + legend_html("strips"))


def server_sessions_table(engine: Any) -> Table:
    """A server that keeps its own cache (vLLM): per session, what its latest request left."""
    rows = engine.cache_rows() if isinstance(engine, ServerCacheRows) else ()
    note = "slots are managed by the server: nbkv sees its sessions and what each request reused"
    if not rows:
        return Table("slots", ("",), (), note=note)
    block = getattr(engine, "block_size", None)
    span = strip_span(rows)
    live = any(s.server_cached is not None for s in rows)
    out = tuple(
        (s.session or "-", len(s.msg_ends) or "?", s.n_tokens,
         *((s.server_cached if s.server_cached is not None else "-",) if live else ()),
         kv_strip(s, span=span)) for s in rows)
    held = f"{vocab.MARKS['server-held'].words} (KV events)"
    note += (f"; the server caches whole blocks of {block} tokens" if block else "")
    return Table("sessions on the server", ("session", "messages", "tokens its latest request "
                 "left", *((held,) if live else ()), f"KV map (positions 0–{span})"), out,
                 note=note + ". " + LEGEND_TEXT)


def _server_slot(info: dict[str, Any] | None) -> str:
    """What llama-server's ``/slots`` said of a slot at the last poll."""
    if info is None:
        return "-"
    busy = " (busy)" if info.get("is_processing") else ""
    return f"{info.get('n_prompt_tokens', '?')} tokens{busy}"


_PARKED = vocab.PARKING["parked"].words
#: the parking figures of ``engine.stats()`` (nbkv.store.parking.parking_stats, and the records')
PARKING_STATS = {
    "restored_requests": f"requests served by a restore ({vocab.EVENTS['restored'].words})",
    "restored_tokens": "tokens restored",
    "parks": f"conversations {_PARKED}",
    "restores": f"{_PARKED} conversations restored",
    "spills": vocab.PARKING["spilled"].words,
    "parking_drops": f"{_PARKED} conversations dropped (over the budgets)",
    "parked_skipped_corrupt": f"{_PARKED} entries skipped (corrupt or from another engine)",
    "parked_ram_entries": f"{_PARKED} now in {vocab.tier_words('ram')}",
    "parked_ram_bytes": f"{_PARKED} bytes in {vocab.tier_words('ram')}",
    "parked_writing_bytes": f"of which being written to {vocab.tier_words('disk')}",
    "parked_disk_entries": f"{_PARKED} now on {vocab.tier_words('disk')}",
    "parked_disk_bytes": f"{_PARKED} bytes on {vocab.tier_words('disk')}",
}


def stats_table(engine: EngineLike) -> Table:
    """Totals over the request history; internals only when relevant, under "details"."""
    s = engine.stats()
    main = ("requests", "prompt_tokens", "reused_tokens", "prefilled_tokens", "salvage_pct",
            "events", "evictions", "generated_tokens", "mean_ttft_s", "not_verified",
            *PARKING_STATS)
    labels = {"requests": "requests", "prompt_tokens": "prompt tokens",
              "reused_tokens": "reused from cache",
              "prefilled_tokens": vocab.STATES["prefilled"].words,
              "salvage_pct": "served from cache (%)", "events": "how requests were served",
              "evictions": vocab.MARKS["took-slot"].words,
              "generated_tokens": "reply tokens", "mean_ttft_s": "mean first-token time (s)",
              "not_verified": "requests not verified (remote)", **PARKING_STATS}

    def fmt(v: Any) -> Any:
        return (", ".join(f"{k} {n}" for k, n in v.items()) or "-" if isinstance(v, dict)
                else f"{v:.1f}" if isinstance(v, float) else v)

    # the parking rows when there is something to say (an engine that parks nothing: none)
    s = {k: size_text(v) if k.endswith("_bytes") and k in PARKING_STATS else v
         for k, v in s.items() if not (k in PARKING_STATS and not v)}
    if isinstance(s.get("events"), dict):  # by reason code: in words
        s["events"] = vocab.counts(s["events"])
    rows = tuple((labels.get(k, k), fmt(s[k])) for k in main if k in s)
    # "strategies" are how the policy found the slot: the events above say it in words
    hidden = {"advice", "thrashing", "returning_misses", "active_sessions", "strategies"}
    if not getattr(engine, "speculative", False):
        hidden |= {k for k in s if k.startswith("draft")}
    details = tuple((k, fmt(v)) for k, v in s.items() if k not in main and k not in hidden)
    return Table("cache statistics", ("", ""), rows, note=s.get("advice") or "",
                 details=details)


def history_table(records: Sequence[RequestRecord], last: int = 20,
                  cell_of: Callable[[RequestRecord], Any] | None = None) -> Table:
    """The most recent request records, each event in the words of :mod:`nbkv.ui.vocabulary`.

    With ``cell_of``, a column names each request's notebook cell (``cell_of(record)``: a
    :class:`~nbkv.notebook.sessions.CellRef`, or None for a request not sent by a cell).
    """
    recs = list(records)[-last:] if last else list(records)

    def cell(r: RequestRecord) -> tuple[str, ...]:
        if cell_of is None:
            return ()
        ref = cell_of(r)
        return (ref.label if ref is not None else "-",)

    def event(r: RequestRecord) -> Cell:
        words = vocab.event(r).words
        return Cell(tip(vocab.reason_line(r), html.escape(words)), words)

    def took(r: RequestRecord) -> str:
        return (r.evicted_session or "") if vocab.took(r) else ""

    rows = tuple(
        (r.id, r.session or "-", *cell(r), event(r), r.slot, r.prompt_tokens,
         f"{r.reused_tokens} ({r.salvage_pct:.0f}%)", r.prefilled_tokens, r.trimmed_tokens,
         r.generated_tokens, f"{r.ttft_s * 1000:.0f}", f"{r.decode_tps:.1f}",
         vocab.ending(r), took(r))
        for r in recs
    )
    cols = ("id", "session", *(("cell",) if cell_of is not None else ()), "event", "slot",
            "prompt", "reused", vocab.STATES["prefilled"].words, vocab.STATES["trimmed"].words,
            "generated", "first token ms", "tok/s", "ended", "took the slot of")
    return Table(f"last {len(rows)} requests", cols, rows)


def _events(stats: dict[str, Any]) -> str:
    """``continued 3, new conversation 2``: requests per event, in words."""
    return ", ".join(f"{k} {v}" for k, v in stats.get("events", {}).items()) or "-"
