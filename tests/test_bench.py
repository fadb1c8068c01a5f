"""The benchmark runs end to end (quick mode) and reports what it claims to measure."""

from __future__ import annotations

import json

import pytest

from nbkv import bench


@pytest.mark.slow
def test_quick_bench_decode_subagents_and_speculative(tmp_path, model_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--scenario", "decode", "--scenario", "speculative",
                       "--scenario", "subagents", "--scenario", "dashboard",
                       "--model", model_path, "--out", str(out)]) == 0
    report = json.loads(out.read_text())

    dec = report["decode"]
    for style in bench.DECODE_PROMPTS:
        res = dec[style]
        # greedy single-token decode: nbkv exact, nbkv inexact and Llama reply alike
        assert res["replies_identical"]["exact_inexact_llama"]
        assert res["replies_identical"]["deterministic"]
        assert res["turn2_equals_scratch"]["exact"]  # a cached second turn, from scratch
        for variant in ("exact", "guesses", "inexact", "llama"):
            assert res[variant]["decode_tokens_per_s"] > 0
            assert len(res[variant]["generated_tokens"]) == 2  # A B B A: each variant twice
        assert res["exact"]["rewrite_positions"] > 0 and res["exact"]["rewrite_s"] > 0
        assert res["inexact"]["rewrite_positions"] == 0  # exact=False: nothing rewritten
        assert res["exact"]["turn2_rewrite_absorbed"] == 0  # settled before the second turn
        assert res["guesses"]["guesses"] > 0
    assert {"exact_over_inexact_decode", "exact_over_llama_decode",
            "guesses_over_exact_decode"} <= set(dec["ratios"])

    spec = report["speculative"]
    assert spec["replies_deterministic"]
    assert 0 < spec["ratios"]["tasks_guess_acceptance"] <= 1
    assert spec["tasks"]["plain"]["guesses"] == 0 < spec["tasks"]["guesses"]["guesses"]
    assert set(spec["guesses_pay_off"]) == {"questions", "tasks"}

    sub = report["subagents"]
    assert sub["sequential"]["runs"] == sub["batched"]["runs"] == 2
    # batched and sequential replies are bit-identical
    assert sub["replies_identical"]
    assert sub["batched"]["generated_tokens"] == sub["sequential"]["generated_tokens"]
    assert sub["decode_step_ceiling"]["tokens_per_s_ratio"] > 0
    assert {t["ratio"] for t in report["targets"]} >= {
        "batched_over_sequential_tokens_per_s", "batched_ttft_over_single_session_ttft"}

    dash = report["dashboard"]  # the live dashboard's cost to prefill, measured headless
    assert dash["dashboard"]["renders"] > 0 and dash["dashboard"]["comm_bytes"] > 0
    assert dash["bare"]["prefilled"] > 0 and dash["bare"]["renders"] == 0
    assert dash["ratios"]["dashboard_over_bare_prefill_tokens_per_s"] > 0
    assert "dashboard_over_bare_prefill_tokens_per_s" in {t["ratio"] for t in report["targets"]}


def test_costs_per_request_split_wall_cpu_and_idle_host_time():
    """The realistic scenario's costs: per request, host time as wall time by part and as CPU
    time, idle-time work apart (no model: two counter snapshots)."""
    from types import SimpleNamespace

    from nbkv.bench.lean import _costs

    zero = {"decode_calls": 0, "rows": 0, "padded_rows": 0, "bytes_moved": 0, "host_s": {},
            "host_cpu_s": 0.0, "idle_host_s": {}}
    now = {"path": "lean", "decode_calls": 10, "rows": 40, "padded_rows": 0, "bytes_moved": 0,
           "host_s": {"placement": 0.004, "sampling": 0.002},
           "host_cpu_s": 0.003,
           "idle_host_s": {"rewrite": 0.006, "gc": 0.002}}
    runner = SimpleNamespace(engine=SimpleNamespace(counters=lambda: now))
    c = _costs(runner, zero, 2)
    assert c["decode_calls"] == 5 and c["rows"] == 20
    assert c["host_s"] == pytest.approx(0.003) and c["host_cpu_s"] == pytest.approx(0.0015)
    assert c["host_s_by_part"] == pytest.approx({"placement": 0.002, "sampling": 0.001})
    assert c["idle_host_s_by_part"] == pytest.approx({"rewrite": 0.003, "gc": 0.001})
