"""Load-time calibration: which prefill grouping is batch-invariant for this model and build.

A short random sequence is decoded under a few chunkings and the logits of every row are
compared bit for bit with one batch of all rows (:mod:`nbkv.kv.invariance` explains why this
matters and what the rule means):

1. chunks of 1, 2, 4, 8, 16, 32 rows until one size reproduces the batch: the *threshold*;
2. chunks of threshold + 1, + 2, + 4, ... rows until one does: the *alignment*;
3. the derived rule is then *proven*: the sequence decoded in the smallest chunks the rule
   allows, and a shorter prefix extended the way a cached slot is (cut back to a settled
   position, the rest prefilled), must both give the batch's logits;
4. one-row decodes of several sequences in one batch against each decoded alone: how many
   generating sequences one decode may hold;
5. *mixed steps*: a sequence generating one row per step while a shadow copy of it
   (``seq_cp``, then cut back to its settled prefix) receives the generated rows in
   canonical chunks between those decodes, as the engine rewrites a reply while it is being
   generated: the generating rows must equal those decoded alone, and the shadow, finished
   as the next request would, must hold exactly a from-scratch prefill's KV.

The result is cached by model fingerprint, llama.cpp build, CPU features and the settings
that select other kernels (:func:`key_settings`), not by ``n_ctx``, threads or slot count
(:mod:`nbkv.kv.calibration_file`: signed, and checked when read). It costs 8-10
CPU-seconds on SmolLM2 (1 or 2 slots; 14 for any number), once: ``python -m nbkv.kv.calibrate``
does it ahead of time (Binder's postBuild).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np

from nbkv.core.progress import Reporter, Task, silent
from nbkv.kv import invariance
from nbkv.kv.calibration_file import (  # noqa: F401 - the cache's names, also read here
    FILE,
    _read,
    cache_dir,
    cache_key,
    cached,
    cached_entry,
    store,
)
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.backend import Batch, Context, Model
from nbkv.llama.gguf_header import gguf_fingerprint

log = logging.getLogger("nbkv")

PREFIX = 32  # rows decoded first, as one chunk, so that tested rows attend to many keys
TESTED = 32  # rows decoded in the chunk size under test (two chunks at least)
FOLLOW = 16  # rows decoded after them, as one chunk: they read the tested KV
N_ROWS = PREFIX + 2 * 32 + FOLLOW  # thresholds and alignments up to 32
POWERS = (1, 2, 4, 8, 16, 32)
GEN_PREFIX = PREFIX  # rows each sequence holds before the generation test
GEN_MAX = 8  # generation batches of more sequences than this are not measured
MIX_CHUNK = 8  # rows of a shadow chunk in the mixed-step proof (rounded up to the rule's)
VERSION = 3  # of the measurement and its key: a change invalidates cached results


class _Probe:
    """Decodes token runs into one sequence and reads every row's logits."""

    def __init__(self, ctx: Context, batch: Batch, tokens: Sequence[int], seq: int) -> None:
        self.ctx, self.batch, self.tokens, self.seq = ctx, batch, list(tokens), seq

    def run(self, chunks: Sequence[tuple[int, int]], *, keep: int | None = 0) -> np.ndarray:
        """Decode ``chunks`` (from, to); returns every decoded row's logits, stacked.

        The sequence is first trimmed to ``keep`` positions (``None``: continued as it is).
        """
        ctx, b, seq = self.ctx, self.batch, self.seq
        if keep is not None and not ctx.try_seq_rm(seq, keep if keep else -1, -1):
            raise RuntimeError("calibration: could not trim the sequence")
        rows: list[Any] = []
        for lo, hi in chunks:
            b.clear()
            for p in range(lo, hi):
                b.add(self.tokens[p], p, seq, True)
            ctx.decode(b)
            rows.extend(np.array(ctx.logits(i)) for i in range(hi - lo))
        return np.stack(rows)

    def matches(self, chunks: Sequence[tuple[int, int]], ref: np.ndarray, *,
                keep: int | None = 0) -> bool:
        """Whether decoding ``chunks`` (as :meth:`run`) gives ``ref``'s rows, in order.

        Stops at the first chunk whose rows differ: a grouping that is not exact usually
        differs from its first chunk on, so a "no" costs one decode instead of dozens. A
        "yes" still needs every row of every chunk equal.
        """
        ctx, b, seq = self.ctx, self.batch, self.seq
        if keep is not None and not ctx.try_seq_rm(seq, keep if keep else -1, -1):
            raise RuntimeError("calibration: could not trim the sequence")
        at = 0
        for lo, hi in chunks:
            b.clear()
            for p in range(lo, hi):
                b.add(self.tokens[p], p, seq, True)
            ctx.decode(b)
            rows = np.stack([np.array(ctx.logits(i)) for i in range(hi - lo)])
            if not _equal(rows, ref[at : at + hi - lo]):
                return False
            at += hi - lo
        return at == len(ref)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


WHAT = "checking which prefill groupings are exact on this CPU"
WHY = "once per model, llama.cpp build and CPU"


def steps(n_seq: int) -> int:
    """The steps :func:`measure` reports: chunk sizes, alignment, proof, generation batches."""
    return len(POWERS) + 2 + (min(n_seq, GEN_MAX) if n_seq > 1 else 0)


def measure(ctx: Context, batch: Batch, n_vocab: int, *, n_seq: int = 1,
            can_trim: bool = True, task: Task | None = None,
            grouping: PrefillRule | None = None, shadow: bool = False) -> PrefillRule:
    """Measure this context's batch-invariance rule on its sequences ``0..n_seq-1``.

    Leaves every sequence it used empty. Needs a batch of :data:`N_ROWS` rows or more.
    ``task`` is told each step (:func:`steps` in all); ``grouping``: a rule already
    measured on this model and build, completed by the generation test only.
    ``shadow``: the context has one more sequence, ``n_seq``, used as the engine uses its
    shadow (mixed steps), proven with the grouping.
    """
    t0 = time.perf_counter()
    task = task or Task(silent, WHAT)
    rng = np.random.default_rng(1234)
    lo, hi = min(100, n_vocab // 4), max(n_vocab - 100, n_vocab // 2)
    tokens = [int(t) for t in rng.integers(lo, hi, N_ROWS)]
    probe = _Probe(ctx, batch, tokens, 0)
    try:
        rule = grouping if grouping is not None else _grouping(probe, can_trim, task)
        if rule.exact and n_seq > 1:
            rule = _with_gen_rows(rule, ctx, batch, tokens, n_seq, task)
        if (grouping is None and rule.exact and shadow and can_trim
                and not rule.single_row):
            rule = replace(rule, mixed=_mixed_steps(rule, ctx, batch, tokens, 0, n_seq))
    finally:
        for s in range(max(n_seq, 1) + shadow):
            ctx.try_seq_rm(s, -1, -1)
    return replace(rule, seconds=round(time.perf_counter() - t0, 3))


def _grouping(probe: _Probe, can_trim: bool, task: Task) -> PrefillRule:
    p, n = PREFIX, N_ROWS
    ref = probe.run([(0, p), (p, n)])[p:]
    table: dict[int, bool] = {}

    def test(k: int) -> bool:
        # chunks of k rows after the same prefix chunk as the reference, then one chunk that
        # reads their KV (a row's own logits can match while its stored K/V differ); many
        # rows, because two kernels' roundings now and then agree on a row by chance
        m = max(2, -(-TESTED // k))
        end = p + m * k + FOLLOW
        chunks = [(p + i * k, p + (i + 1) * k) for i in range(m)] + [(p + m * k, end)]
        if can_trim:
            table[k] = probe.matches(chunks, ref[: end - p], keep=p)
        else:
            table[k] = _equal(probe.run([(0, p), *chunks])[p:], ref[: end - p])
        if k in POWERS:
            task.advance()
        return table[k]

    threshold = next((k for k in POWERS if test(k)), None)
    task.update(len(POWERS))
    if threshold is None:
        again = probe.run([(0, p), (p, n)])[p:]
        why = ("the same batch decoded twice gave different logits (non-deterministic "
               "kernels)" if not _equal(again, ref) else
               f"no chunk size up to {POWERS[-1]} rows reproduced a {n - p}-row batch")
        return PrefillRule(2, 1, exact=False, reason=why, table=tuple(sorted(table.items())))
    align = threshold
    a = 1
    while a < threshold and max(2 * (threshold + a), TESTED + threshold + a) + FOLLOW <= n - p:
        if test(threshold + a):
            align = a
            break
        a *= 2
    derived = invariance.derive(table)
    if derived is not None:
        threshold, align = derived
    task.update(len(POWERS) + 1)
    items = tuple(sorted(table.items()))
    full = probe.run([(0, n)])
    while align <= POWERS[-1]:
        rule = PrefillRule(threshold, align, single_row=table.get(1, False) and align == 1,
                           table=items)
        if _proves(probe, full, rule, can_trim):
            task.update(len(POWERS) + 2)
            return rule
        align *= 2
        threshold = max(threshold, align)
    return PrefillRule(2, 1, exact=False, table=items,
                       reason="no grouping reproduced a one-batch prefill when extended")


def _proves(probe: _Probe, ref: np.ndarray, rule: PrefillRule, can_trim: bool) -> bool:
    """The rule's smallest chunks, and a prefix extended as a cached slot is, give ``ref``.

    Memory that cannot be cut (hybrid, recurrent) goes back through a checkpoint, a copy of
    the state at a settled position: that is a prefix decoded alone, then extended.
    """
    n = len(ref)
    units = probe.tokens
    smallest = invariance.chunks(units, 0, n, rule, max(rule.min_chunk, rule.align))
    if not probe.matches(smallest, ref):
        return False
    m = n // 2 + 5  # a prefix that does not end on the grid
    part = units[:m]
    keep = invariance.valid_start(units, invariance.stable_end(part, m, rule), rule)
    if can_trim:
        probe.run(invariance.chunks(part, 0, m, rule, n))
    else:
        probe.run(invariance.chunks(units[:keep], 0, keep, rule, n))
    rest = probe.run(invariance.chunks(units, keep, n, rule, n),
                     keep=keep if can_trim else None)
    return _equal(rest, ref[keep:])


def _with_gen_rows(rule: PrefillRule, ctx: Context, batch: Batch, tokens: Sequence[int],
                   n_seq: int, task: Task) -> PrefillRule:
    """How many sequences one generation decode may hold (one row each) and stay exact."""
    m_max = min(n_seq, GEN_MAX)
    prefix, rows = tokens[:GEN_PREFIX], tokens[GEN_PREFIX:GEN_PREFIX + m_max]

    def fill(seqs: int) -> None:
        for s in range(seqs):
            ctx.try_seq_rm(s, -1, -1)
        batch.clear()
        batch.add_run(prefix, 0, 0, False)
        ctx.decode(batch)
        for s in range(1, seqs):
            ctx.seq_cp(0, s)

    after = tokens[-1]

    def follow(s: int) -> np.ndarray:
        """The logits of one more row after sequence ``s``'s: they read its KV."""
        batch.clear()
        batch.add(after, GEN_PREFIX + 1, s, True)
        ctx.decode(batch)
        return np.array(ctx.logits(0))

    alone = []
    for r in rows:
        fill(1)
        batch.clear()
        batch.add(r, GEN_PREFIX, 0, True)
        ctx.decode(batch)
        alone.append((np.array(ctx.logits(0)), follow(0)))
    task.advance()
    limit = 0 if n_seq <= GEN_MAX else GEN_MAX
    for m in range(2, min(n_seq, GEN_MAX) + 1):
        task.advance()
        fill(m)
        batch.clear()
        for s in range(m):
            batch.add(rows[s], GEN_PREFIX, s, True)
        ctx.decode(batch)
        got = [np.array(ctx.logits(s)) for s in range(m)]
        if not all(np.array_equal(got[s], alone[s][0]) and np.array_equal(follow(s), alone[s][1])
                   for s in range(m)):
            limit = m - 1
            break
    return replace(rule, gen_rows=limit)


def _mixed_steps(rule: PrefillRule, ctx: Context, batch: Batch, tokens: Sequence[int],
                 g: int, s: int) -> bool:
    """Whether mixed steps are exact: sequence ``g`` generating, shadow ``s`` rewriting.

    ``g`` generates one row per step; between its decodes, its shadow ``s`` (a ``seq_cp``
    of it, cut back to the prompt's settled end) receives the rows in canonical chunks
    (:func:`nbkv.kv.invariance.block_chunk`), as the engine's mixed steps do. True if every
    generated row's logits equal those of ``g`` generating alone, and the shadow, finished
    as the next request finishes it, holds a from-scratch prefill's KV (the logits of rows
    that read it).
    """
    p = PREFIX  # the prompt: one canonical chunk, settled to its end (a power of 2 >= align)
    k = max(rule.min_chunk, -(-MIX_CHUNK // rule.align) * rule.align)
    n = p + min(2 * k + k // 2 + 1, N_ROWS - p - FOLLOW)  # prompt + reply: 2+ chunks, a rest
    units = list(tokens[:n])

    def rows(seq: int, lo: int, hi: int, logits: bool = False) -> np.ndarray:
        batch.clear()
        for q in range(lo, hi):
            batch.add(tokens[q], q, seq, logits)
        ctx.decode(batch)
        return np.stack([np.array(ctx.logits(i)) for i in range(hi - lo)] if logits
                        else [np.zeros(0)])

    def prompt(seq: int) -> None:
        ctx.try_seq_rm(seq, -1, -1)
        rows(seq, 0, p)

    prompt(g)
    alone = [rows(g, q, q + 1, True) for q in range(p, n)]
    ctx.try_seq_rm(s, -1, -1)
    for lo, hi in invariance.chunks(units, 0, n, rule, N_ROWS):
        rows(s, lo, hi)
    ref = rows(s, n, n + FOLLOW, True)
    prompt(g)
    ctx.try_seq_rm(s, -1, -1)
    shadow = None  # positions the shadow holds, once it exists
    for q in range(p, n):
        if not _equal(rows(g, q, q + 1, True), alone[q - p]):
            return False
        held = units[: q + 1]
        start = p if shadow is None else shadow
        take = invariance.block_chunk(held, start, rule, k)
        if take:
            if shadow is None:  # the copy is queued; it runs at the start of the next decode
                ctx.seq_cp(g, s)
                if not ctx.try_seq_rm(s, p, -1):
                    return False
            rows(s, start, start + take)
            shadow = start + take
    keep = invariance.valid_start(units, shadow or p, rule)
    if shadow is None:
        ctx.seq_cp(g, s)
    if not ctx.try_seq_rm(s, keep, -1):
        return False
    for lo, hi in invariance.chunks(units, keep, n, rule, N_ROWS):
        rows(s, lo, hi)
    return _equal(rows(s, n, n + FOLLOW, True), ref)


class _Gated:
    """A context whose every decode first calls ``gate`` (which may wait, or raise to stop)."""

    def __init__(self, ctx: Context, gate: Callable[[], None]) -> None:
        self._ctx, self._gate = ctx, gate

    def decode(self, batch: Batch) -> None:
        self._gate()
        self._ctx.decode(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def calibrate(model: Model, *, n_seq: int, can_trim: bool, settings: dict[str, Any],
              cache: bool = True, progress: Reporter = silent,
              shadow: bool = False, gate: Callable[[], None] | None = None) -> PrefillRule:
    """The rule of ``model`` in contexts with these ``settings``, measured or cached.

    It is measured in a temporary context with ``settings`` (:class:`~nbkv.llama.backend.Context`
    keywords: threads, KV types, flash attention) and ``n_seq`` sequences; ``cache=False``
    measures again (and stores the new result). A cached measurement of fewer sequences is
    completed by the generation test alone. ``progress`` is told each step. ``shadow``: also
    prove mixed steps (the engine has a shadow sequence beside its ``n_seq`` slots).
    ``gate``: called before every decode (background proving: it waits while the engine
    serves, and raises to abandon the measurement).
    """
    n_seq = max(1, min(n_seq, GEN_MAX + 1))
    key = _key(model, can_trim, settings, shadow)
    known = cached_entry(key) if cache else None
    if known is not None:
        rule = for_sequences(*known, n_seq)
        if rule is not None:
            return rule
    total = steps(n_seq) - (steps(1) if known is not None else 0)
    with Task(progress, WHAT, WHY, total=total, tick=1.0) as task:
        rows = max(N_ROWS, settings.get("fixed_rows", 0))  # fixed-shape decodes: padded rows
        ctx = Context(model, 256 * (n_seq + shadow), n_seq + shadow, rows, **settings)
        batch = Batch(rows)
        try:
            probe_ctx = ctx if gate is None else cast(Context, _Gated(ctx, gate))
            rule = measure(probe_ctx, batch, model.n_vocab, n_seq=n_seq, can_trim=can_trim,
                           task=task, grouping=known[0] if known is not None else None,
                           shadow=shadow)
        finally:
            batch.close()
            ctx.close()
    log.info("calibrated %s in %.1f s: %s", model.path.name, rule.seconds, rule.describe())
    store(key, rule, gen_tested=tested(n_seq))
    return rule


def _key(model: Model, can_trim: bool, settings: dict[str, Any], shadow: bool) -> str:
    return cache_key(gguf_fingerprint(model.path),
                     {**key_settings(settings, can_trim, model.params.n_gpu_layers),
                      "shadow": shadow})


def known(model: Model, *, n_seq: int, can_trim: bool, settings: dict[str, Any],
          shadow: bool = False) -> PrefillRule | None:
    """The rule :func:`calibrate` would return from its cache alone, or None (to measure)."""
    found = cached_entry(_key(model, can_trim, settings, shadow))
    return for_sequences(*found, max(1, min(n_seq, GEN_MAX + 1))) if found else None


def key_settings(settings: dict[str, Any], can_trim: bool, gpu_layers: int) -> dict[str, Any]:
    """What, besides the model, the build and the CPU, the answer depends on.

    Measured (``python -m nbkv.kv.calibrate --compare``; SmolLM2 Q4_1 and Gemma 3 Q4_K_M):
    the logits of every grouping are bit-identical with 1 to 8 threads, in slots of 256 or
    2048 tokens, and in contexts of 1, 2 or 9 sequences, so neither ``n_ctx`` nor the thread
    count nor the slot count is part of the key (the slot count decides only how far the
    generation test must go: :func:`for_sequences`). The KV types, flash attention and the
    layers on a GPU select other kernels, and memory that cannot be trimmed is measured
    another way. With flash attention on, llama.cpp's CPU kernel for one query over an f16
    cache splits the cache among the threads: the thread count then joins the key.
    """
    from nbkv.llama.hardware import FLASH_ATTN

    body = {"flash_attn": settings.get("flash_attn", FLASH_ATTN["off"]),
            "type_k": settings.get("type_k"), "type_v": settings.get("type_v"),
            "can_trim": can_trim, "gpu_layers": gpu_layers, "version": VERSION}
    if body["flash_attn"] != FLASH_ATTN["off"]:
        body["n_threads"] = settings.get("n_threads")
    if settings.get("fixed_rows"):  # every decode one shape: other kernels, maybe
        body["fixed_rows"] = settings["fixed_rows"]
    return body


def tested(n_seq: int) -> int:
    """How many sequences the generation test of a ``n_seq``-sequence context covers."""
    return min(n_seq, GEN_MAX) if n_seq > 1 else 1


def for_sequences(rule: PrefillRule, gen_tested: int, n_seq: int) -> PrefillRule | None:
    """``rule`` (measured with ``gen_tested`` sequences) for an engine of ``n_seq`` slots.

    None when the measurement does not tell: it passed every batch it tried, and ``n_seq``
    asks for larger ones. ``gen_rows`` is 0 (no limit) when every batch of up to ``n_seq``
    sequences was proven, else the largest proven.
    """
    if not rule.exact:
        return rule
    n_seq = max(1, min(n_seq, GEN_MAX + 1))
    if 0 < rule.gen_rows < gen_tested:  # a batch of gen_rows + 1 sequences differed
        return replace(rule, gen_rows=0 if n_seq <= rule.gen_rows else rule.gen_rows)
    if n_seq <= gen_tested:
        return replace(rule, gen_rows=0)
    if gen_tested >= GEN_MAX:
        return replace(rule, gen_rows=GEN_MAX)
    return None


# -- the command line ------------------------------------------------------------------------


def compare(model: Model, variants: Sequence[tuple[int, int, int]], rows: int = 112
            ) -> list[tuple[tuple[int, int, int], str]]:
    """The logits of one token run decoded in chunks of 1, 3, 8 and all rows, per variant.

    ``variants``: (threads, tokens per slot, sequences). Returns each variant with a digest
    of all its logits: equal digests mean the variant changes no answer of the calibration.
    """
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(min(100, model.n_vocab // 4),
                                           max(model.n_vocab - 100, model.n_vocab // 2), rows)]
    out = []
    for threads, slot, n_seq in variants:
        ctx = Context(model, slot * n_seq, n_seq, rows, threads)
        batch = Batch(rows)
        try:
            probe = _Probe(ctx, batch, tokens, 0)
            h = hashlib.sha256()
            for k in (1, 3, 8, rows):
                h.update(probe.run([(lo, min(lo + k, rows)) for lo in range(0, rows, k)],
                                   keep=None).tobytes())
                ctx.try_seq_rm(0, -1, -1)
            out.append(((threads, slot, n_seq), h.hexdigest()[:16]))
        finally:
            batch.close()
            ctx.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m nbkv.kv.calibrate [MODEL ...] [--slots N] [--fresh] [--compare]``.

    Calibrates each model (default: the embedded one) for engines of up to ``--slots``
    slots (default: any number), so that later loads find the result cached: Binder's
    ``postBuild`` runs it. ``--compare`` instead shows whether the thread count, the slot
    size or the number of sequences changes any logit (see :func:`key_settings`).
    """
    import argparse
    import sys

    from nbkv.core.progress import PlainLines, default_reporter
    from nbkv.llama.backend import default_threads
    from nbkv.llama.models import resolve_model_path

    ap = argparse.ArgumentParser(prog="python -m nbkv.kv.calibrate",
                                 description=main.__doc__.split("\n")[0] if main.__doc__ else "")
    ap.add_argument("models", nargs="*", help="GGUF files (default: the embedded model)")
    ap.add_argument("--slots", type=int, default=GEN_MAX + 1,
                    help="the most slots an engine will have (default: any number)")
    ap.add_argument("--fresh", action="store_true", help="measure again even if cached")
    ap.add_argument("--compare", action="store_true",
                    help="check that threads, slot size and sequences change no logit")
    args = ap.parse_args(argv)
    from nbkv.core.config import HardwareSettings
    from nbkv.llama.hardware import FLASH_ATTN, gpu_layers, kv_type_id

    status = 0
    for name in args.models or [None]:
        model = Model(resolve_model_path(name), gpu_layers(HardwareSettings()))
        try:
            if args.compare:
                variants = [(t, 256, 1) for t in (1, 2, 4, 8)] + [(1, 2048, 1), (1, 256, 2),
                                                                 (1, 256, GEN_MAX + 1)]
                results = compare(model, variants)
                for (threads, slot, n_seq), digest in results:
                    print(f"{model.path.name}: {threads} threads, {slot}-token slots, "
                          f"{n_seq} sequences: logits {digest}")
                same = len({d for _, d in results}) == 1
                print(f"{model.path.name}: " + ("every variant gives the same logits" if same
                                                else "the variants DIFFER"))
                status |= 0 if same else 1
                continue
            from nbkv.kv.slot_kv import PLAIN, SWA, classify, probe_memory

            ctx = Context(model, 256, 1, N_ROWS)
            batch = Batch(N_ROWS)
            try:
                can_trim = probe_memory(model, ctx, batch).can_trim
            finally:
                batch.close()
                ctx.close()
            # an Engine's defaults (its key: nbkv.engine.native.Resources.settings)
            settings = {"n_threads": default_threads(), "flash_attn": FLASH_ATTN["off"],
                        "type_k": kv_type_id("f16"), "type_v": kv_type_id("f16")}
            t0 = time.perf_counter()
            # and the shadow sequence of its default exact mode (rewrite="auto")
            shadow = classify(model) in (PLAIN, SWA)
            rule = calibrate(model, n_seq=args.slots, can_trim=can_trim, settings=settings,
                             cache=not args.fresh, shadow=shadow, progress=default_reporter()
                             if sys.stderr.isatty() else PlainLines(sys.stderr, every=5.0))
            print(f"{model.path.name}: {rule.describe()} ({time.perf_counter() - t0:.1f} s; "
                  f"cached in {cache_dir() / FILE})")
        finally:
            model.close()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
