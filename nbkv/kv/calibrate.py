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
   generating sequences one decode may hold.

The result is cached by model fingerprint, llama.cpp build, CPU features and context
settings (``$NBKV_CACHE_DIR``, default ``~/.cache/nbkv``, ``calibration.json``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from nbkv.kv import invariance
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.backend import Batch, Context, Model, system_info
from nbkv.llama.gguf_header import gguf_fingerprint

log = logging.getLogger("nbkv")

PREFIX = 32  # rows decoded first, as one chunk, so that tested rows attend to many keys
TESTED = 32  # rows decoded in the chunk size under test (two chunks at least)
FOLLOW = 16  # rows decoded after them, as one chunk: they read the tested KV
N_ROWS = PREFIX + 2 * 32 + FOLLOW  # thresholds and alignments up to 32
POWERS = (1, 2, 4, 8, 16, 32)
GEN_PREFIX = PREFIX  # rows each sequence holds before the generation test
GEN_MAX = 8  # generation batches of more sequences than this are not measured
FILE = "calibration.json"
VERSION = 1  # of the measurement: a change invalidates cached results


def cache_dir() -> Path:
    """Where generated and measured files live: ``$NBKV_CACHE_DIR`` or ``~/.cache/nbkv``."""
    env = os.environ.get("NBKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nbkv"


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


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def measure(ctx: Context, batch: Batch, n_vocab: int, *, n_seq: int = 1,
            can_trim: bool = True) -> PrefillRule:
    """Measure this context's batch-invariance rule on its sequences ``0..n_seq-1``.

    Leaves every sequence it used empty. Needs a batch of :data:`N_ROWS` rows or more.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(1234)
    lo, hi = min(100, n_vocab // 4), max(n_vocab - 100, n_vocab // 2)
    tokens = [int(t) for t in rng.integers(lo, hi, N_ROWS)]
    probe = _Probe(ctx, batch, tokens, 0)
    try:
        rule = _grouping(probe, can_trim)
        if rule.exact and n_seq > 1:
            rule = _with_gen_rows(rule, ctx, batch, tokens, n_seq)
    finally:
        for s in range(max(n_seq, 1)):
            ctx.try_seq_rm(s, -1, -1)
    return replace(rule, seconds=round(time.perf_counter() - t0, 3))


def _grouping(probe: _Probe, can_trim: bool) -> PrefillRule:
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
        rows = probe.run(chunks, keep=p) if can_trim else probe.run([(0, p), *chunks])[p:]
        table[k] = _equal(rows, ref[: end - p])
        return table[k]

    threshold = next((k for k in POWERS if test(k)), None)
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
    items = tuple(sorted(table.items()))
    full = probe.run([(0, n)])
    while align <= POWERS[-1]:
        rule = PrefillRule(threshold, align, single_row=table.get(1, False) and align == 1,
                           table=items)
        if _proves(probe, full, rule, can_trim):
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
    if not _equal(probe.run(smallest), ref):
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
                   n_seq: int) -> PrefillRule:
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
    limit = 0 if n_seq <= GEN_MAX else GEN_MAX
    for m in range(2, min(n_seq, GEN_MAX) + 1):
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


def calibrate(model: Model, *, n_seq: int, can_trim: bool, settings: dict[str, Any],
              cache: bool = True) -> PrefillRule:
    """The rule of ``model`` in contexts with these ``settings``, measured or cached.

    It is measured in a temporary context with ``settings`` (:class:`~nbkv.llama.backend.Context`
    keywords: threads, KV types, flash attention); ``cache=False`` measures again (and
    stores the new result).
    """
    n_seq = max(1, min(n_seq, GEN_MAX + 1))
    key = cache_key(gguf_fingerprint(model.path),
                    {**settings, "n_seq": n_seq, "can_trim": can_trim, "gpu_layers":
                     model.params.n_gpu_layers, "version": VERSION})
    if cache:
        rule = cached(key)
        if rule is not None:
            return rule
    ctx = Context(model, 256 * n_seq, n_seq, N_ROWS, **settings)
    batch = Batch(N_ROWS)
    try:
        rule = measure(ctx, batch, model.n_vocab, n_seq=n_seq, can_trim=can_trim)
    finally:
        batch.close()
        ctx.close()
    log.info("calibrated %s in %.1f s: %s", model.path.name, rule.seconds, rule.describe())
    store(key, rule)
    return rule


# -- the cache -------------------------------------------------------------------------------


def cache_key(fingerprint: str, settings: dict[str, Any]) -> str:
    """The key a measurement is cached under: model, build, CPU features, settings."""
    from nbkv.llama import backend

    body = {"model": fingerprint, "build": backend.llama_cpp_version(),
            "system": system_info(), **settings}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached(key: str, path: Path | None = None) -> PrefillRule | None:
    """The rule cached under ``key``, if any."""
    entry = _read(path or cache_dir() / FILE).get(key)
    if not isinstance(entry, dict):
        return None
    try:
        return PrefillRule.from_json(entry)
    except (TypeError, ValueError):
        return None


def store(key: str, rule: PrefillRule, path: Path | None = None) -> None:
    """Cache ``rule`` under ``key`` (atomically; a failure to write is only logged)."""
    path = path or cache_dir() / FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = rule.to_json()
        fd, tmp = tempfile.mkstemp(prefix=FILE + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the calibration in %s: %s", path, e)
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)
