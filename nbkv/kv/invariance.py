"""Batch invariance: how prompt rows must be grouped for cached KV to equal a fresh prefill.

llama.cpp's CPU kernels compute a row of a matrix product differently depending on how many
rows its batch holds and where the row sits in it (a one-row decode takes a vector kernel,
K-quant weights a tiled one from 8 rows on, ...; :mod:`nbkv.kv.calibrate` measures the rule
of *this* model and build). A cached slot and a from-scratch decode give the same KV only if
every row is computed by the same kernel in both, so every prefill follows one *canonical*
grouping, a pure function of the positions:

- a *text run* is the text between two images (or the prompt's start and end);
- inside a run, chunks start at a multiple of ``align`` rows from the run's start, every
  chunk but the run's last holds a multiple of ``align`` rows, and every chunk holds at least
  ``threshold`` rows (a run shorter than that is one chunk);
- an image is decoded as the projector decodes it, the same way everywhere.

Under such a rule a row's kernel depends only on whether it lies before the run's last
multiple of ``align`` (a *block* row) or after it (a *remainder* row). Block rows never
change class when the run grows: they are *settled*. Remainder rows are exact for this very
prompt, but the next turn computes them again (at most ``align - 1`` rows, plus enough
settled rows to give the new chunk ``threshold`` rows). Generated tokens are one-row
decodes: exact when :attr:`PrefillRule.single_row` holds, else rewritten in idle time, or
while the reply is generated, in a *shadow* sequence that receives its settled rows in
chunks (:func:`block_chunk`) between generation decodes (:attr:`PrefillRule.mixed`).
:func:`plan_step` plans what one scheduler step decodes, keeping prompt chunks whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrefillRule:
    """The grouping that keeps prefill rows batch-invariant on one model and build."""

    threshold: int = 2  # fewest rows a prompt chunk may hold
    align: int = 1  # chunks start this many rows apart (counted from their text run's start)
    exact: bool = True  # the rule was proven on this model and build
    single_row: bool = False  # a one-row decode computes a row as a batched prefill does
    gen_rows: int = 0  # most sequences one generation decode may hold (0: no limit found)
    mixed: bool = False  # a shadow sequence's chunks between generation decodes stay exact
    reason: str = ""  # why not exact, in plain words
    table: tuple[tuple[int, bool], ...] = field(default=(), compare=False)  # rows -> equal
    seconds: float = field(default=0.0, compare=False)  # how long the calibration took

    @property
    def min_chunk(self) -> int:
        """The smallest chunk that keeps every row canonical: ``threshold`` rounded up."""
        return -(-self.threshold // self.align) * self.align

    def describe(self) -> str:
        """One line for status tables, e.g. ``exact: yes, prefill in 4-aligned chunks of 8+``."""
        if not self.exact:
            return f"exact: no ({self.reason})"
        if self.align > 1:
            how = f"prefill in {self.align}-aligned chunks of {self.threshold}+ rows"
        else:
            how = f"prefill in chunks of {self.threshold}+ rows"
        if self.single_row:
            reply = "replies need no rewrite"
        else:
            reply = ("replies rewritten as a batch; mixed steps: "
                     + ("yes" if self.mixed else "no"))
        return f"exact: yes, {how}; {reply}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (for the calibration cache)."""
        d = asdict(self)
        d["table"] = [list(t) for t in self.table]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrefillRule:
        """The inverse of :meth:`to_json`."""
        d = dict(d)
        d["table"] = tuple((int(k), bool(v)) for k, v in d.get("table", ()))
        return cls(**d)


def derive(table: Mapping[int, bool]) -> tuple[int, int] | None:
    """The ``(threshold, align)`` rule explaining a measured table, or None.

    A chunk of k rows is exact iff ``k >= threshold`` and ``k % align == 0``, consistent
    with every measured ``k -> equal`` of ``table``. The smallest alignment wins; the
    threshold is the smallest size measured equal (never a size that was not measured).
    """
    trues = sorted(k for k, ok in table.items() if ok)
    if not trues:
        return None
    align = 1
    while align <= max(table):
        if all(k % align == 0 for k in trues):
            threshold = trues[0]
            if all(not (k >= threshold and k % align == 0) for k, ok in table.items() if not ok):
                return threshold, align
        align *= 2
    return None


# -- canonical chunking: pure functions of the positions ------------------------------------


def _text(u: Any) -> bool:
    return isinstance(u, int)


def _all_text(units: Sequence[Any], lo: int, hi: int) -> bool:
    """``units[lo:hi]`` holds text tokens only (a scan in C: prompts are long, images rare)."""
    return set(map(type, units[lo:hi])) <= {int}


def run_start(units: Sequence[Any], pos: int, text: bool = False) -> int:
    """First position of the text run holding ``pos`` (just after the previous image).

    ``text``: the caller knows ``units`` holds no image (no scan then).
    """
    if text or _all_text(units, 0, pos):
        return 0
    i = pos
    while i > 0 and _text(units[i - 1]):
        i -= 1
    return i


def run_end(units: Sequence[Any], pos: int, text: bool = False) -> int:
    """End of the text run from ``pos``: the next image position at or after it, or the end."""
    i, n = pos, len(units)
    if text or _all_text(units, pos, n):
        return n
    while i < n and _text(units[i]):
        i += 1
    return i


def valid_start(units: Sequence[Any], want: int, rule: PrefillRule) -> int:
    """The largest position ``<= want`` where a canonical prefill of ``units`` may begin.

    A run's start (the prompt's start, just after an image) always qualifies; inside a run,
    a multiple of ``align`` from its start that leaves the run ``threshold`` rows or more.
    An image is kept or dropped whole.
    """
    n = len(units)
    want = max(0, min(want, n))
    if want < n and not _text(units[want]):
        want -= units[want].offset  # an image's first position
    if want == 0 or not _text(units[want - 1]):
        return want  # the start, or just after an image
    start = run_start(units, want - 1)
    end = run_end(units, want)
    a = rule.align
    r = start + (want - start) // a * a
    while r > start and end - r < rule.threshold:
        r -= a
    return max(r, start)


def stable_end(units: Sequence[Any], end: int, rule: PrefillRule, text: bool = False) -> int:
    """Positions before ``end`` whose KV stays exact whatever follows (its *settled* prefix).

    ``units[:end]`` must have been prefilled canonically: every chunk's block rows are
    settled; the remainder rows of the last run are not (the run may still grow). ``text``:
    ``units`` holds no image (known to the caller: no scan for one).
    """
    if end <= 0:
        return 0
    if not _text(units[end - 1]):
        return end
    start = run_start(units, end - 1, text)
    if end - start < rule.threshold:
        return start
    return start + (end - start) // rule.align * rule.align


def next_chunk(units: Sequence[Any], pos: int, rule: PrefillRule, cap: int,
               stops: Iterable[int] = (), text: bool = False) -> int:
    """Rows the next canonical prefill chunk of ``units`` takes from ``pos``.

    ``pos`` is a valid start (:func:`valid_start`) or where a previous chunk ended, and
    ``units[pos]`` is text. ``cap``: the batch size. ``stops``: positions where a chunk
    should end (checkpoints, the system-prompt capture); honoured where the grouping allows
    (a multiple of ``align`` from the run's start, ``threshold`` rows on both sides).
    ``text``: ``units`` holds no image (no scan for one).
    """
    a, t = rule.align, rule.threshold
    start = run_start(units, pos, text)
    end = run_end(units, pos, text)
    left = end - pos
    if left <= cap:
        n = left
    else:
        n = max(cap // a * a, a)
        if left - n < t:  # leave the run's last chunk threshold rows
            n = max((left - t) // a * a, a)
    for s in sorted(stops):
        if pos < s < pos + n and s - pos >= t and end - s >= t and (s - start) % a == 0:
            n = s - pos
            break
    return n


def block_chunk(units: Sequence[Any], pos: int, rule: PrefillRule, cap: int) -> int:
    """Rows a chunk from ``pos`` may take now, of a run that is still growing (0: not yet).

    The run is a reply being generated. ``pos`` is a multiple of ``align`` from its run's
    start (a settled position). The chunk holds a multiple of ``align`` rows, at least
    ``threshold`` and at most ``cap``, so that every row of it is a block row, settled
    whatever the run grows into: a canonical prefill of the finished run computes each of
    them exactly so.
    """
    if pos >= len(units) or not _text(units[pos]):
        return 0
    a = rule.align
    if (pos - run_start(units, pos)) % a:
        raise ValueError(f"position {pos} is not on its run's {a}-row grid")
    n = min(run_end(units, pos) - pos, cap) // a * a
    return n if n >= rule.threshold else 0


def chunks(units: Sequence[Any], start: int, end: int, rule: PrefillRule, cap: int
           ) -> list[tuple[int, int]]:
    """The canonical text chunks ``(from, to)`` of ``units[start:end]`` (images skipped).

    ``start`` must be a valid start; ``end`` the end of ``units`` or an image's start. This
    is how the oracle decodes from scratch; the engine reaches the same chunks one step at a
    time with :func:`next_chunk`.
    """
    out = []
    pos = start
    while pos < end:
        if not _text(units[pos]):
            pos += units[pos].key.n_pos - units[pos].offset
            continue
        n = min(next_chunk(units, pos, rule, cap), end - pos)
        out.append((pos, pos + n))
        pos += n
    return out


def checkpoint_stops(units: Sequence[Any], wanted: Iterable[int], rule: PrefillRule
                     ) -> tuple[int, ...]:
    """Where checkpoints can go near ``wanted`` positions (deduplicated, ascending).

    Each is moved down to a settled position; if a chunk cannot end there (too few rows
    would follow it in ``units``), the nearest position below where one can is added too.
    A checkpoint at the end of ``units`` serves a longer prompt, which may resume there.
    """
    out = set()
    n = len(units)
    for w in wanted:
        if 0 < w <= n:
            s = stable_end(units, w, rule)
            if s > 0:
                out.add(s)
            if s < n and run_end(units, s) - s < rule.threshold:
                v = valid_start(units, s, rule)
                if v > 0 and stable_end(units, v, rule) == v:
                    out.add(v)
    return tuple(sorted(out))


def lean(rule: PrefillRule, reason: str = "") -> PrefillRule:
    """The grouping of the lean path: as few decodes as the batch allows, nothing proven.

    Where exactness cannot be proven (no exact grouping, a GPU build) or is not asked for,
    every chunk takes as many rows as fit (threshold 1, alignment 1), nothing is rewritten and
    no cached position is cut back. ``rule``'s table and timing are kept for the status line;
    ``reason`` says why (else ``rule``'s own reason).
    """
    return PrefillRule(threshold=1, align=1, exact=False, reason=reason or rule.reason,
                       table=rule.table, seconds=rule.seconds)


# -- what each scheduler step decodes (plan_step) ------------------------------------------


@dataclass(frozen=True)
class Prefilling:
    """A request with prompt positions still to decode."""

    key: int  # the request's id (also breaks ties: first come first served)
    remaining: int  # positions left to prefill
    ready: bool = True  # False while its next image is being encoded
    image_next: bool = False  # the next position starts an image
    take: int = 0  # rows its next text chunk holds (next_chunk)


@dataclass(frozen=True)
class StepPlan:
    """One scheduler step."""

    prefill: int | None = None  # key of the request whose prompt advances
    take: int = 0  # prompt positions it decodes (0 for an image: the projector decides)
    image: bool = False  # the prefill decodes an image
    generate: bool = False  # run the generation decode

    @property
    def idle(self) -> bool:
        """Nothing to decode."""
        return self.prefill is None and not self.generate


def plan_step(prefilling: Sequence[Prefilling], generating: int) -> StepPlan:
    """Plan one step given the prompts in progress and the number of generating requests.

    A step is at most two ``llama_decode`` calls:

    - a *generation* decode with the next token of every generating request (one row per
      sequence, plus a guess where speculative decoding is on), in increasing sequence-id
      order so that llama.cpp evaluates them as one micro-batch;
    - a *prefill* decode of one chunk of one prompt, shortest remaining prompt first (the
      least mean time to first token: a chat turn does not wait behind a long document).

    They are separate calls because llama.cpp's micro-batch split (``split_equal``) gives
    every sequence of a mixed batch the same number of rows: a prompt chunk decoded beside
    one generated token would lose its first token to a one-row micro-batch, which rounds
    differently from a batched prefill. A chunk that finishes a prompt runs alone, so its
    first token waits for nobody. How many rows a chunk takes is the canonical grouping's
    (:func:`next_chunk`), passed in :attr:`Prefilling.take`.
    """
    ready = [p for p in prefilling if p.ready and p.remaining > 0]
    if not ready:
        return StepPlan(generate=generating > 0)
    job = min(ready, key=lambda p: (p.remaining, p.key))
    if job.image_next:
        return StepPlan(job.key, 0, True, generating > 0)
    take = min(job.take, job.remaining)
    last = take >= job.remaining
    return StepPlan(job.key, take, False, generating > 0 and not last)
