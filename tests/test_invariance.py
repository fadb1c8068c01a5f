"""The canonical prefill grouping and its derivation from measured tables: pure, no model."""

from __future__ import annotations

import pytest

from nbkv.kv import invariance
from nbkv.kv.invariance import PrefillRule, chunks, derive, next_chunk, stable_end, valid_start
from nbkv.media.units import MediaKey, MediaUnit

# measured on this project's CI machine (AVX2/AVX512, llama-cpp-python 0.3.36, SmolLM2-135M
# re-quantized): chunk size -> the chunks' rows equal one batch's (nbkv.kv.calibrate)
TABLES = {
    "Q4_K_M": ({1: False, 2: False, 4: False, 8: True, 9: False, 10: False, 12: True}, (8, 4)),
    "Q6_K": ({1: False, 2: False, 4: False, 8: True, 9: True}, (8, 1)),
    "IQ4_NL": ({1: False, 2: False, 4: False, 8: True, 9: True}, (8, 1)),
    "Q4_1": ({1: False, 2: True, 3: True}, (2, 1)),
    "repack 16": ({1: False, 2: False, 4: False, 8: False, 16: True, 17: False, 18: False,
                   20: False, 24: False}, (16, 16)),
    "single rows": ({1: True}, (1, 1)),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_rules_derived_from_recorded_tables(name):
    table, expected = TABLES[name]
    assert derive(table) == expected


def test_no_rule_explains_an_inconsistent_or_empty_table():
    assert derive({1: False, 2: False, 4: False}) is None
    assert derive({}) is None
    # 8 and 12 equal but 16 not: no threshold and alignment explain it
    assert derive({8: True, 12: True, 16: False}) is None


def text(n, start=0):
    return list(range(start + 1000, start + 1000 + n))


def image(n_pos, h="img", sub=0):
    key = MediaKey(h, sub, n_pos, n_pos)
    return [MediaUnit(key, i) for i in range(n_pos)]


K = PrefillRule(8, 4)  # Q4_K_M on this machine


def classes(units, plan, rule):
    """Each text row's kernel class under a plan: (block or remainder, chunk >= threshold)."""
    out = {}
    for lo, hi in plan:
        n = hi - lo
        for r in range(lo, hi):
            out[r] = (r - lo < n // rule.align * rule.align, n >= rule.threshold)
    return out


@pytest.mark.parametrize("rule", [K, PrefillRule(2, 1), PrefillRule(8, 1), PrefillRule(16, 16)])
@pytest.mark.parametrize("cap", [64, 256])
def test_any_cached_history_computes_every_row_as_a_fresh_prefill(rule, cap):
    """A prompt extended turn after turn (each from the settled position, as a cached slot
    is) gives every row the kernel class a from-scratch prefill gives it."""
    units = text(40) + image(7) + text(3, 50) + image(5, "b") + text(300, 100)
    fresh = classes(units, chunks(units, 0, len(units), rule, cap), rule)
    for cuts in ([60, 120, 333], [41, 47, 48, 200], [52, 90, 91, 100], [10, 340]):
        rows, end = {}, 0
        for cut in [*cuts, len(units)]:
            if cut <= end:
                continue
            part = units[:cut]
            start = valid_start(part, min(stable_end(part, end, rule), cut - 1), rule)
            got = chunks(part, start, cut, rule, cap)
            assert all(n >= rule.threshold or lo == invariance.run_start(units, lo)
                       for lo, hi in got for n in [hi - lo])
            rows = {k: v for k, v in rows.items() if k < start}
            rows.update(classes(part, got, rule))
            end = cut
        for r, c in rows.items():
            assert c == fresh[r], (cuts, r)


def test_valid_starts_keep_images_whole_and_leave_threshold_rows():
    units = text(30) + image(6) + text(20, 40)
    # inside the image: back to its start, and the text before it must end in a chunk of 8+
    assert valid_start(units, 33, K) == valid_start(units, 30, K) == 20
    assert valid_start(units, 36, K) == 36  # just after an image
    assert valid_start(units, 47, K) == 44  # 8 from the run's start, 12 rows left
    assert valid_start(units, 55, K) == 48  # 8 rows left, aligned from the run's start
    assert valid_start(text(5), 4, K) == 0  # a run shorter than the threshold


def test_settled_positions_are_the_block_rows():
    units = text(30) + image(6) + text(21, 40)
    assert stable_end(units, 30, K) == 28
    assert stable_end(units, 36, K) == 36
    assert stable_end(units, 40, K) == 36  # a short run: nothing settles yet
    assert stable_end(units, 57, K) == 56


def test_next_chunk_leaves_the_last_chunk_threshold_rows_and_honours_stops():
    units = text(300)
    assert next_chunk(units, 0, K, 256) == 256  # 44 rows left: enough
    assert next_chunk(units, 0, K, 296) == 292  # 4 left would be too few: 8 left
    assert next_chunk(text(260), 0, K, 256) == 252
    assert next_chunk(units, 0, K, 256, stops=(100,)) == 100
    assert next_chunk(units, 0, K, 256, stops=(6, 102)) == 256  # too short / off the grid
    assert next_chunk(units, 0, K, 512, stops=(296,)) == 300  # it would leave 4 rows
    assert next_chunk(units, 4, K, 512) == 296  # from a valid start to the end


@pytest.mark.parametrize("rule", [K, PrefillRule(2, 1), PrefillRule(8, 1), PrefillRule(16, 16)])
@pytest.mark.parametrize("cap", [8, 16, 32])
def test_a_reply_rewritten_in_block_chunks_while_it_grows_is_a_fresh_prefill(rule, cap):
    """Mixed steps: the shadow takes block chunks of the reply as it grows one row per step
    (nbkv.engine.rewrite), then the rest is prefilled from a valid start as the next request
    would: every row gets the kernel class a from-scratch prefill of the finished reply
    gives it, and every row a block chunk took is settled in the end."""
    cap = max(cap, rule.min_chunk)
    prompt = text(20) + image(6) + text(37, 40)
    for reply in (1, 5, cap, cap + 1, 3 * cap + 5, 70):
        final = prompt + text(reply, 200)
        fresh = classes(final, chunks(final, 0, len(final), rule, 256), rule)
        pos = stable_end(prompt, len(prompt), rule)
        taken = []
        for n in range(len(prompt) + 1, len(final) + 1):  # one generated row per step
            take = invariance.block_chunk(final[:n], pos, rule, cap)
            assert take % rule.align == 0 and (take == 0 or rule.threshold <= take <= cap)
            if take == cap:
                taken.append((pos, pos + take))
                pos += take
        keep = valid_start(final, pos, rule)  # the shadow is cut back there, the rest read
        assert keep <= pos
        rows = {r: c for r, c in classes(final, taken, rule).items() if r < keep}
        rows.update(classes(final, chunks(final, keep, len(final), rule, 256), rule))
        for r in range(min(keep, stable_end(prompt, len(prompt), rule)), len(final)):
            assert rows[r] == fresh[r], (reply, r)
        assert min(keep, pos) <= stable_end(final, len(final), rule)


def test_block_chunks_wait_for_enough_rows_and_stay_on_the_grid():
    units = text(30) + image(6) + text(21, 40)
    assert invariance.block_chunk(units, 36, K, 16) == 16
    assert invariance.block_chunk(units, 52, K, 16) == 0  # 5 rows: fewer than the threshold
    assert invariance.block_chunk(units, 44, K, 16) == 12  # 13 rows: 12 on the 4-grid
    assert invariance.block_chunk(units, 28, K, 16) == 0  # an image follows 2 rows on
    assert invariance.block_chunk(units, 30, K, 16) == 0  # an image's position
    assert invariance.block_chunk(units, 57, K, 16) == 0  # the end
    with pytest.raises(ValueError, match="grid"):
        invariance.block_chunk(units, 38, K, 16)
