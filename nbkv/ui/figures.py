"""What a request did, in plain words: the figures line under a reply, and ``explain``.

Every phrase comes from :mod:`nbkv.ui.vocabulary` (keyed by :mod:`nbkv.kv.admission`' codes), as
on the other surfaces; colours from :mod:`nbkv.ui.palette`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbkv.core.events import CONTINUED, RESTORED
from nbkv.ui import vocabulary as vocab
from nbkv.ui.display import reuse_bar, swatch
from nbkv.ui.palette import (
    COLORS,
    FAINT,
    INK,
    NEUTRAL,
    PAPER,
    PREFILLED_TINT,
    REUSED_TINT,
    RULE,
    TEXT,
    TRACK,
    TRIMMED_TINT,
)

if TYPE_CHECKING:
    from nbkv.core.events import RequestRecord
    from nbkv.kv.admission import Explanation


def ttft_parts(r: RequestRecord) -> list[tuple[str, float]]:
    """The first-token time in parts that add up to it, in plain words."""
    # what a request waits for is a free slot, or the scheduler's step in progress: with
    # no pause between cells, the rewrite of the previous reply (docs/concepts/exactness.md)
    waited = ("waited (for a free slot, or the step in progress: e.g. the rewrite of the "
              "previous reply)" if r.wait_s >= 0.02 else "waited")
    parts = [(waited, r.wait_s), ("restored", r.restore_s)]
    if r.rewrite_absorbed:
        parts.append((f"re-read the previous reply ({r.rewrite_absorbed} tokens, "
                      "its rewrite had not run yet)", r.rewrite_absorbed_s))
    n = r.prefilled_tokens - r.rewrite_absorbed
    parts += [(f"read the prompt ({n} new tokens)", r.read_s),
              ("first token", r.first_decode_s)]
    rest = r.ttft_s - sum(s for _, s in parts)  # a remote engine times less of it
    if rest > 0.0005:
        parts.append(("elsewhere (a server's queue, HTTP)", rest))
    return parts


def whole_ms(total_s: float, parts: list[float]) -> list[int]:
    """``parts`` (seconds) in whole milliseconds that add up to ``total_s``'s, as written.

    Each part is rounded where the running sum falls, not on its own (three parts of 4.6 ms
    are 5 + 4 + 5 = 14, never 15 under a total of 14), and the last one ends at the total.
    """
    end, at, out = round(total_s * 1000), 0, []
    cum = 0.0
    for i, s in enumerate(parts):
        cum += s * 1000
        b = end if i == len(parts) - 1 else min(max(round(cum), at), end)
        out.append(b - at)
        at = b
    return out


def ttft_text(r: RequestRecord) -> str:
    """``first token 95 ms = waited 2 ms + restored 0 ms + read ... + first token 1 ms``.

    The parts written add up to the total written (:func:`whole_ms`).
    """
    parts = ttft_parts(r)
    ms = whole_ms(r.ttft_s, [s for _, s in parts])
    split = " + ".join(f"{what} {n} ms" for (what, _), n in zip(parts, ms, strict=True))
    return (f"time from the request to the first reply token: {round(r.ttft_s * 1000)} ms"
            f" = {split}")


def actions(r: RequestRecord) -> list[tuple[str, str]]:
    """What happened, as ``(text, explanation)`` pairs in plain words (the figures line).

    The words come from :mod:`nbkv.ui.vocabulary`, as on every other surface.
    """
    out: list[tuple[str, str]] = []
    event = vocab.event(r)
    what = event.words
    copied = vocab.EVENTS["copied"].words
    donor = ""
    if r.donor_slot is not None:
        who = f"{r.donor_session}'s" if r.donor_session else f"slot {r.donor_slot}'s"
        donor = f"{copied} from {who} slot"
        if r.reason == "copied":
            what, donor = donor, ""
    restored = vocab.restored(r)
    if restored and r.reason == RESTORED:
        what, restored = restored, ""
    where = f"slot {r.slot}: " if r.slot >= 0 else ""  # -1: a server's own cache
    out.append((f"{where}{what}", vocab.reason_line(r)))
    if restored:
        out.append((restored, vocab.EVENTS[RESTORED].tip))
    if donor:
        out.append((donor, vocab.EVENTS["copied"].tip))
    took = vocab.took(r)
    if took:
        out.append((took, f"{r.evicted_session}'s cached conversation was "
                          + ("parked to make room (it is restored when it comes back)"
                             if r.evicted_parked else "dropped to make room")))
    out.append((f"reused {r.reused_tokens}/{r.prompt_tokens} ({r.salvage_pct:.0f}%)",
                "prompt tokens whose KV was already in the slot: not computed again"))
    out.append((f"read {r.prefilled_tokens} new", vocab.STATES["prefilled"].tip))
    if r.encoder_runs:
        out.append(("image encoded" if r.encoder_runs == 1
                    else f"{r.encoder_runs} images encoded",
                    "the vision encoder ran on a picture it had not seen"))
    elif r.embedding_cache_hits:
        out.append(("image from cache",
                    "the picture's embeddings were cached: no encoder run"))
    if r.reprefilled_tokens and r.reason != "checkpoint":
        out.append((f"re-read {r.reprefilled_tokens}",
                    "matched tokens read again: prompt tokens are read in groups that "
                    "give the same numbers as a fresh start, or the memory cannot be cut "
                    "exactly there"))
    out.append((f"first token {r.ttft_s * 1000:.0f} ms", ttft_text(r)))
    if r.generated_tokens > 1:
        out.append((f"{r.decode_tps:.0f} tok/s", "reply tokens per second"))
    if r.replayed_tokens:
        out.append((f"{r.replayed_tokens} tokens from the cache",
                    "the reply's tokens, given again as the cache held them: nothing was "
                    "decoded"))
    if r.rewrite_mixed:
        out.append((f"rewrote {r.rewrite_mixed} while replying",
                    "reply tokens recomputed as a batch during generation (exact mode, "
                    "requests back to back): the next turn need not read them again"))
    if r.draft_tokens:
        out.append((f"guessed {r.draft_accepted}/{r.draft_tokens} ahead",
                    "speculative guesses of the next token that proved right"))
    if not r.verified:
        out.append(("not verified", r.note or "the server's figures differ from nbkv's"))
    if not r.exact:
        out.append((f"not proven exact: {r.exact_note}" if r.exact_note
                    else "not proven exact",
                    "nbkv could not prove on this model and build that a reply from "
                    "cache equals one computed from scratch (%kvcache status says why)"))
    ending = vocab.ending(r)
    if ending:
        out.append((ending, r.error or vocab.ENDINGS[r.finish_reason].tip))
    return out


def summary(r: RequestRecord) -> str:
    """The one-line figures shown after a reply (the notebook view and the terminal)."""
    return " · ".join(text for text, _ in actions(r))


@dataclass(frozen=True)
class Figures:
    """What a request did, in plain words, shown under its reply.

    One line: where it went and what it reused, read, and cost. When the reuse is less than
    continuing the conversation would give, a second line says why (the record's reason).
    In HTML every field explains itself in a tooltip, and a bar shows reused (green) against
    newly read (orange) prompt tokens.
    """

    record: RequestRecord

    def text(self) -> str:
        """The figures line, and the reason line when there is one to give."""
        why = self.why()
        return summary(self.record) + (f"\n  why: {why}" if why else "")

    def ttft(self) -> str:
        """The first-token time in parts that add up to it (:func:`ttft_text`)."""
        return ttft_text(self.record)

    def __str__(self) -> str:
        return self.text()

    def why(self) -> str:
        """The reason in plain words, unless the request simply continued its conversation."""
        r = self.record
        return r.reason_text if r.reason and r.reason != CONTINUED else ""

    def _repr_html_(self) -> str:
        r = self.record
        # each field stays whole (nowrap); a long line wraps only at the separators
        fields = " · ".join(
            f'<span class="nbkv-field" title="{html.escape(tip)}" '
            f'style="cursor:help;white-space:nowrap">{html.escape(text)}</span>'
            for text, tip in actions(r))
        why = self.why()
        reused, read = vocab.STATES["reused"].words, vocab.STATES["prefilled"].words
        # the bar on the left, the fields and the why line in a column beside it
        return (f'<div class="nbkv-figures" style="font:12px monospace;color:{NEUTRAL};'
                f'display:flex;align-items:flex-start">'
                f'<span title="prompt tokens: {reused} (green), {read} (orange)" '
                f'style="flex:none;display:inline-block;width:80px;background:{TRACK};'
                f'margin:4px 6px 0 0;line-height:0">{reuse_bar(r, 80)}</span>'
                '<div style="min-width:0">'
                f"{fields}"
                + (f'<div class="nbkv-why">why: {html.escape(why)}</div>' if why else "")
                + "</div></div>")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


#: ``%kvcache explain`` highlights: the cached side's tail is trimmed (hatched red, struck
#: through), the new side's is read new (solid yellow-orange): never alike (test_vocabulary)
EXPLAIN_TRIMMED = (f"background:repeating-linear-gradient(135deg,{TRIMMED_TINT} 0 5px,{PAPER} 5px "
                   f"7px);text-decoration:line-through {COLORS['trimmed']};")
EXPLAIN_READ = f"background:{PREFILLED_TINT};"
#: a replayed request's cached tail: its reply given again and the later turns kept (reused)
EXPLAIN_REUSED = f"background:{REUSED_TINT};"


@dataclass(frozen=True)
class ExplainReport:
    """``%kvcache explain``: a request's reason and both renderings, side by side.

    The cached and the new rendering are split where they part: the shared part greyed, the
    differing parts highlighted.
    """

    explanation: Explanation
    width: int = 600  # characters shown on each side of the divergence

    def _parts(self) -> tuple[str, str, str, str]:
        x, w = self.explanation, self.width
        clip = lambda s: ("…" + s[-w:]) if len(s) > w else s  # noqa: E731
        cut = lambda s: (s[:w] + "…") if len(s) > w else s  # noqa: E731
        return clip(x.cached_head), cut(x.cached_tail), clip(x.new_head), cut(x.new_tail)

    def header(self) -> list[str]:
        """The reason, the figures, and where the prompt diverged, one line each."""
        r = self.explanation.record
        lines = [f"request #{r.id} ({r.session or 'no session'}): {vocab.reason_line(r)}",
                 f"reused {r.reused_tokens} of {r.prompt_tokens} prompt tokens, read "
                 f"{r.prefilled_tokens} new"]
        if vocab.took(r):
            lines.append(vocab.took(r))
        if r.divergence is not None:
            d = r.divergence
            lines.append(f"the prompt left the cached conversation in message {d.message} "
                         f"({d.role}) at token {d.position}")
        return lines

    def text(self) -> str:
        """Plain text for terminals: both renderings, the divergence marked with ⟦ ⟧."""
        ch, ct, nh, nt = self._parts()
        return "\n".join([*self.header(), "", f"cached: {ch}⟦{ct}⟧", "",
                          f"new:    {nh}⟦{nt}⟧"])

    def _repr_html_(self) -> str:
        ch, ct, nh, nt = self._parts()
        esc = html.escape
        cell = ("vertical-align:top;width:50%;padding:4px 8px;white-space:pre-wrap;text-align:left;"
                f"font:11px monospace;border:1px solid {RULE}")

        def side(head: str, tail: str, style: str, label: str) -> str:
            return (f'<td style="{cell}"><b>{label}</b><br><span style="color:{FAINT}">'
                    f'{esc(head)}</span><span class="nbkv-divergence" title="'
                    f'{esc(vocab.MARKS["divergence"].words)}" '
                    f'style="border-left:3px solid {INK};margin:0 1px"></span>'
                    f'<span style="{style}">{esc(tail)}</span></td>')

        read = vocab.STATES["prefilled"]
        replayed = self.explanation.tail_state == "reused"
        tail, tint, tail_style = ((vocab.STATES["reused"], REUSED_TINT, EXPLAIN_REUSED)
                                  if replayed else
                                  (vocab.STATES["trimmed"], TRIMMED_TINT, EXPLAIN_TRIMMED))
        key = (swatch(tint, tail, tail_style)
               + swatch(PREFILLED_TINT, read, EXPLAIN_READ)
               + f'<span style="border-left:3px solid {INK};margin-right:4px"></span>'
               + esc(vocab.MARKS["divergence"].words))
        head = "".join(f"<div>{esc(line)}</div>" for line in self.header())
        return (f'<div class="nbkv-explain" style="font:12px sans-serif">{head}'
                f'<div style="font:11px sans-serif;color:{TEXT};margin-top:4px">{key}</div>'
                f'<table style="border-collapse:collapse;width:100%;margin-top:6px"><tr>'
                + side(ch, ct, tail_style, "cached (in the slot)")
                + side(nh, nt, EXPLAIN_READ, "new prompt")
                + "</tr></table></div>")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def __str__(self) -> str:
        return self.text()


@dataclass(frozen=True)
class TurnFigures(Figures):
    """The figures line of a ``%%chat`` cell that re-ran a turn.

    Its why line first says what the run did to the session's turns (``re-ran cell [3]:
    replaced turn 2 of alice · ... · turn 3 is now stale``), then the request's own reason.
    """

    note: str = ""

    def why(self) -> str:
        """The turn note, then the reason (unless the request simply continued)."""
        return " · ".join(x for x in (self.note, super().why()) if x)
