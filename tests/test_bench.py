"""The benchmark runs end to end (quick mode) and reports what it claims to measure."""

from __future__ import annotations

import json

import pytest

from nbkv import bench


@pytest.mark.slow
def test_quick_bench_subagents_and_speculative(tmp_path, model_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--scenario", "speculative", "--scenario", "subagents",
                       "--model", model_path, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    spec = report["speculative"]
    assert spec["exact_replies_identical"]
    assert 0 < spec["ratios"]["tasks_guess_acceptance"] <= 1
    sub = report["subagents"]
    assert sub["sequential"]["runs"] == sub["batched"]["runs"] == 2
    # batched and sequential generate the same replies, so the same guesses pay off
    assert sub["batched"]["generated_tokens"] == sub["sequential"]["generated_tokens"]
    assert sub["batched"]["guesses_accepted"] == sub["sequential"]["guesses_accepted"]
    assert sub["decode_step_ceiling"]["tokens_per_s_ratio"] > 0
    assert {t["ratio"] for t in report["targets"]} >= {
        "batched_over_sequential_tokens_per_s", "batched_ttft_over_single_session_ttft"}
