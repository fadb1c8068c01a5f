"""The conversation view: each session's turns in cell order, live or stale, and its branches.

A session's turns are listed in the order their cells first ran, each with its cell's
execution count (``[7]``), what was asked and answered, and how its request was served
(a bar of reused against newly read prompt tokens, in the palette's colours). A *stale*
turn (answered before an earlier turn was re-run) is greyed out; a turn whose re-run left
later turns stale is a branch point (⎇). A fork is drawn under the turn it branched from,
so the turns both share, and the KV prefix both slots hold, appear once.

Static HTML and text, from a session store and a slot snapshot; nothing here imports Jupyter.
The dashboard's :class:`~nbkv.ui.widgets.Conversations` redraws it live.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from nbkv.core.events import common_prefix
from nbkv.core.messages import preview
from nbkv.ui import vocabulary as vocab
from nbkv.ui.display import reuse_bar
from nbkv.ui.palette import (
    BRANCH_COLOR,
    FREE,
    MUTED,
    NEUTRAL,
    ROLE_COLORS,
    STALE_COLOR,
    TEXT,
    TRACK,
)


class Turn(Protocol):
    """A turn as the view reads it (:class:`nbkv.notebook.turns.Turn`)."""

    cell: Any  # the cell that sent it (``label``), or None
    live: bool
    state: str
    source: str | None  # a fork's turn: the session it was copied from
    user: Any  # the user's message
    reply: str
    record: Any  # its request's record, or None
    stale_since: Any
    runs: int

    @property
    def question(self) -> str:
        """The user's message as text."""


class Session(Protocol):
    """A session as the view reads it (:class:`nbkv.notebook.sessions.Session`)."""

    name: str
    parent: tuple[str, int] | None  # (session, turn) it was forked from
    system: Any

    @property
    def turns(self) -> Sequence[Any]:
        """Its turns (each a :class:`Turn`), in cell order."""

LEGEND = ("Each session's turns in the order their cells first ran; [n] is the cell's "
          "execution count. A stale turn was answered before an earlier turn was re-run: "
          "the model no longer sees it, until its cell runs again. ⎇ marks a branch: a "
          "re-run turn, or a session forked from another (the turns they share are shown "
          "once). Bars: prompt tokens reused from the cache (green) and read new (orange).")


def families(sessions: Iterable[Session]) -> tuple[list[Session],
                                                   dict[str, dict[int, list[Session]]]]:
    """The sessions as trees: the roots, and each session's forks by the turn they follow.

    A fork hangs after the last turn it still shares with its parent (see
    :func:`branch_point`). A fork whose parent is not among ``sessions`` (or whose ancestry
    loops) is a root.
    """
    sessions = list(sessions)
    by_name = {s.name: s for s in sessions}
    forks: dict[str, dict[int, list[Session]]] = {}
    roots = []
    for s in sessions:
        seen, p = {s.name}, s.parent
        while p is not None and p[0] in by_name and p[0] not in seen:
            seen.add(p[0])
            p = by_name[p[0]].parent
        looped = p is not None and p[0] in seen
        if s.parent is not None and s.parent[0] in by_name and not looped:
            at = branch_point(by_name[s.parent[0]], s)[1]
            forks.setdefault(s.parent[0], {}).setdefault(at, []).append(s)
        else:
            roots.append(s)
    return roots, forks


def branch_point(parent: Session, fork: Session) -> tuple[int, int]:
    """How many of ``fork``'s first turns ``parent`` still has, and where they end.

    Returns (the number of the fork's leading copied turns equal to the parent's live
    turns, the parent's turn number after which they part; 0: the system prompt). A turn
    of the parent re-run after the fork was made moves the branch point up.
    """
    if parent.system != fork.system:
        return 0, 0
    live = [(i, t) for i, t in enumerate(parent.turns, start=1) if t.live]
    n, at = 0, 0
    for (i, mine), theirs in zip(live, fork.turns):
        if theirs.source is None or mine.messages != theirs.messages:
            break
        n, at = n + 1, i
    return n, at


def _slot_of(slots: Sequence[Any], name: str) -> Any:
    """The slot holding session ``name``'s conversation (most recently used), or None."""
    own = [s for s in slots if s.session == name and s.tokens]
    return max(own, key=lambda s: s.last_used) if own else None


def shared_kv(slots: Sequence[Any], a: str, b: str) -> int:
    """Leading KV positions that the slots of sessions ``a`` and ``b`` hold alike."""
    sa, sb = _slot_of(slots, a), _slot_of(slots, b)
    if sa is None or sb is None or sa.index == sb.index:
        return 0
    return common_prefix(tuple(sa.tokens), tuple(sb.tokens))


def _branches(session: Session) -> dict[int, list[int]]:
    """Turn number -> the turns its re-run left stale (the branch points of a session)."""
    out: dict[int, list[int]] = {}
    for i, t in enumerate(session.turns, start=1):
        if not t.live and t.stale_since:
            out.setdefault(t.stale_since, []).append(i)
    return out


def _span(numbers: Sequence[int]) -> str:
    n = sorted(numbers)
    if len(n) > 1 and n == list(range(n[0], n[-1] + 1)):
        return f"turns {n[0]}–{n[-1]}"
    return ("turn " if len(n) == 1 else "turns ") + ", ".join(map(str, n))


# ---------------------------------------------------------------- HTML

_ROW = "display:flex;align-items:baseline;gap:6px;padding:2px 4px;margin:1px 0"


def _bar(turn: Turn) -> str:
    r = turn.record
    if r is None or not r.prompt_tokens:
        return (f'<span style="display:inline-block;width:60px;color:{FREE}" '
                'title="no request in this kernel (restored or copied)">–</span>')
    tip = html.escape(f"prompt {r.prompt_tokens} tokens: reused {r.reused_tokens} from the "
                      f"cache, read {r.prefilled_tokens} new (request #{r.id}, slot {r.slot})",
                      quote=True)
    return (f'<span class="nbkv-turn-bar" title="{tip}" style="display:inline-block;'
            f'width:60px;flex:none;white-space:nowrap;background:{TRACK};line-height:0">'
            f"{reuse_bar(r, 60)}</span>"
            f'<span style="color:{MUTED};min-width:76px;white-space:nowrap">'
            f"{r.salvage_pct:.0f}% reused</span>")


def _request(turn: Turn) -> str:
    """``#5``: the request the turn's cell sent, as the charts number it (``#5 [3]``)."""
    r = turn.record
    if r is None:
        return ""
    return (f'<span class="nbkv-request-id" title="request #{r.id} on the timeline and in '
            f'%kvcache history" style="font:11px monospace;color:{MUTED};min-width:30px">'
            f"#{r.id}</span>")


def _turn_html(session: Session, i: int, turn: Turn, branches: dict[int, list[int]]) -> str:
    live = turn.live
    count = turn.cell.label if turn.cell is not None and turn.cell.count is not None else (
        "cell" if turn.cell is not None else "py")
    count_tip = ("the cell's execution count" if turn.cell is not None and turn.cell.count
                 is not None else "sent by a cell with no execution count" if turn.cell
                 else "sent from Python or a terminal (no cell)")
    q = html.escape(preview(turn.user or {"content": turn.question}, 70))
    a = html.escape(preview({"content": turn.reply}, 70))
    badge = ""
    if not live:
        why = (f"answered before turn {turn.stale_since} was re-run: left out of what the "
               f"model sees; run its cell again to refresh it" if turn.stale_since
               else "left out of what the model sees; run its cell again to refresh it")
        badge = (f'<span class="nbkv-stale" title="{html.escape(why, quote=True)}" '
                 f'style="border:1px dashed {STALE_COLOR};color:{STALE_COLOR};'
                 f'border-radius:3px;padding:0 3px;cursor:help">stale</span>')
    branch = ""
    if i in branches:
        tip = (f"branch point: this turn was re-run after {_span(branches[i])} had been "
               f"answered on its earlier version")
        branch = (f'<span class="nbkv-branch" title="{html.escape(tip, quote=True)}" '
                  f'style="color:{BRANCH_COLOR};font-weight:bold;cursor:help">⎇ re-run: '
                  f'{_span(branches[i])} answered on its earlier version</span>')
    runs = (f'<span style="color:{MUTED}" title="times its cell has run">×{turn.runs}</span>'
            if turn.runs > 1 else "")
    if turn.source is not None:
        runs += (f'<span style="color:{FREE}" title="copied when this session was forked">'
                 f"from {html.escape(turn.source)}</span>")
    style = _ROW + ("" if live else f";opacity:0.55;text-decoration:line-through "
                                    f"{STALE_COLOR}")
    return (
        f'<div class="nbkv-turn" data-session="{html.escape(session.name, quote=True)}" '
        f'data-turn="{i}" data-state="{turn.state}" style="{style}">'
        f'<span title="{count_tip}" style="font:11px monospace;color:{NEUTRAL};min-width:34px">'
        f"{html.escape(count)}</span>{_request(turn)}"
        f'<span style="min-width:46px">turn {i}</span>{_bar(turn)}'
        f'<span style="border-left:3px solid {ROLE_COLORS["user"]};padding-left:4px">{q}'
        f"</span><span>→</span>"
        f'<span style="border-left:3px solid {ROLE_COLORS["assistant"]};padding-left:4px;'
        f'color:{TEXT}">{a}</span>{runs}{badge}{branch}</div>'
    )


def _where(slots: Sequence[Any], parked: Sequence[Any], name: str) -> str:
    """Where a session's conversation is: its slot, parked (RAM or disk), or nowhere."""
    slot = _slot_of(slots, name)
    if slot is not None:
        return f"slot {slot.index}: {slot.n_tokens} tokens in KV"
    entry = next((p for p in parked if p.session == name), None)
    if entry is not None:
        tier = vocab.tier_words(entry.tier)
        place = f"on {tier}" if entry.tier == "disk" else f"in {tier}"
        return f"parked {place}: {entry.n_tokens} tokens (its next turn restores them)"
    return "not in KV now (its next turn rebuilds it)"


def _session_html(s: Session, forks: dict[str, dict[int, list[Session]]],
                  slots: Sequence[Any], parked: Sequence[Any] = (),
                  shared_from: Session | None = None) -> str:
    turns = s.turns
    stale = sum(1 for t in turns if not t.live)
    where = _where(slots, parked, s.name)
    head = (f"<b>{html.escape(s.name)}</b> · {len(turns)} turn{'s' if len(turns) != 1 else ''}"
            + (f" ({stale} stale)" if stale else "") + f" · {html.escape(where)}")
    rows = []
    if shared_from is None and s.system is not None:
        rows.append(f'<div class="nbkv-system" style="{_ROW};color:{NEUTRAL}">'
                    f'<span style="border-left:3px solid {ROLE_COLORS["system"]};'
                    f'padding-left:4px">system: '
                    f"{html.escape(preview({'content': s.system}, 90))}</span></div>")
    branches, own_forks = _branches(s), forks.get(s.name, {})
    shared = branch_point(shared_from, s)[0] if shared_from is not None else 0
    for i, t in enumerate(turns, start=1):
        if i <= shared:
            continue  # shown once, in the session it was forked from
        rows.append(_turn_html(s, i, t, branches))
        for kid in own_forks.get(i, []):
            rows.append(_fork_html(s, i, kid, slots, forks, parked))
    for k, kids in own_forks.items():  # forked after turn 0, or after turns since removed
        if not 1 <= k <= len(turns):
            rows.extend(_fork_html(s, k, kid, slots, forks, parked) for kid in kids)
    if not turns:
        rows.append(f'<div style="{_ROW};color:{FREE}">no turn yet</div>')
    return (f'<div class="nbkv-conversation" data-session="{html.escape(s.name, quote=True)}" '
            f'style="margin:4px 0"><div style="margin-bottom:2px">{head}</div>'
            + "".join(rows) + "</div>")


def _fork_html(parent: Session, at: int, kid: Session, slots: Sequence[Any],
               forks: dict[str, dict[int, list[Session]]], parked: Sequence[Any] = ()) -> str:
    n = shared_kv(slots, parent.name, kid.name)
    kv = (f"; their slots hold the same first {n} tokens of KV (copied once, not recomputed)"
          if n else "")
    what = f"shares turns 1–{at} with {parent.name}" if at > 1 else (
        f"shares turn 1 with {parent.name}" if at == 1 else
        f"shares {parent.name}'s system prompt" if parent.system is not None
        and parent.system == kid.system else f"shares nothing with {parent.name} now")
    shared = branch_point(parent, kid)[0]
    copied = sum(1 for t in kid.turns if t.source is not None)
    if copied > shared:
        what += (f"; its turn{'s' if copied - shared > 1 else ''} "
                 f"{shared + 1}{f'–{copied}' if copied - shared > 1 else ''} came from an "
                 f"earlier version of {parent.name}'s")
    inner = _session_html(kid, forks, slots, parked, shared_from=parent)
    return (f'<div class="nbkv-fork" data-session="{html.escape(kid.name, quote=True)}" '
            f'style="margin-left:40px;padding-left:8px;border-left:2px solid {BRANCH_COLOR}">'
            f'<div style="color:{BRANCH_COLOR}">⎇ <b>{html.escape(kid.name)}</b> forked after '
            f"turn {at}: {html.escape(what + kv)}</div>{inner}</div>")


def conversation_html(sessions: Iterable[Session], slots: Sequence[Any] = (),
                      parked: Sequence[Any] = ()) -> str:
    """Every session's conversation as HTML (forks under the turn they branched from).

    ``slots`` and ``parked`` (the engine's parked conversations) say where each one is.
    """
    roots, forks = families(sessions)
    body = "".join(_session_html(s, forks, slots, parked) for s in roots) or (
        f'<div style="color:{FREE}">no conversation yet</div>')
    return (f'<div class="nbkv-conversations" style="font:12px sans-serif;line-height:1.5">'
            f'<div style="font-size:14px;margin:4px 0 2px">conversations: one turn per '
            f"<code>%%chat</code> cell</div>"
            f'<div class="nbkv-conversations-legend" style="color:{MUTED};font-size:11px;'
            f'margin-bottom:4px">{html.escape(LEGEND)}</div>{body}</div>')


def session_html(session: Any) -> str:
    """A session's conversation view, with its forks, and where each one sits in the cache.

    What a notebook shows for a session (``nbkv.session("alice")`` as a cell's value): the
    notebook layer registers it as IPython's HTML formatter for sessions.
    """
    engine = session.store.engine if session.store is not None else None
    if engine is None:
        return conversation_html([session, *session.forks()])
    return conversation_html([session, *session.forks()], engine.slots(),
                             getattr(engine, "parked", tuple)())


# ---------------------------------------------------------------- text

def conversation_text(sessions: Iterable[Session], slots: Sequence[Any] = (),
                      parked: Sequence[Any] = ()) -> str:
    """Every session's conversation as plain text (terminals)."""
    lines: list[str] = []
    for s in sessions:
        where = _where(slots, parked, s.name)
        origin = f", forked from {s.parent[0]} after turn {s.parent[1]}" if s.parent else ""
        lines.append(f"{s.name} ({len(s.turns)} turns, {where}{origin})")
        branches = _branches(s)
        for i, t in enumerate(s.turns, start=1):
            count = t.cell.label if t.cell is not None else "py"
            mark = " [stale]" if not t.live else ""
            fork = f" (from {t.source})" if t.source else ""
            branch = (f"  ⎇ re-run: {_span(branches[i])} answered on its earlier version"
                      if i in branches else "")
            lines.append(f"  {count:>6} turn {i}{mark}{fork}: {preview(t.user or {}, 50)} → "
                         f"{preview({'content': t.reply}, 40)}{branch}")
    return "\n".join(lines) or "no conversation yet"
