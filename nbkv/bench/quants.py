"""The chat, interleaving and decode scenarios on re-quantized weights, against Q4_1."""

from __future__ import annotations

import os
from typing import Any

from nbkv.bench.conversations import mean
from nbkv.bench.decode import scenario_decode
from nbkv.bench.registry import scenario
from nbkv.bench.text import scenario_interleaved, scenario_single
from nbkv.engine.facade import Engine

QUANTS = ("Q4_K_M", "Q6_K", "Q8_0")  # against the embedded Q4_1


@scenario("quants")
def scenario_quants(path: str, quick: bool) -> dict[str, Any]:
    """The 12-turn chat, the 4-session interleaving and single-session decoding on SmolLM2
    re-quantized to K-quants and Q8_0, against the embedded Q4_1 in the same run.

    Every weight type prefills in its own calibrated grouping (nbkv.kv.invariance): the extra
    tokens it costs per turn (prefilled over the minimum), first-token times against
    llama-cpp-python and the physical floor, and decode speed against ``Llama.generate``.
    Targets: each type's ratios within 5% of Q4_1's.
    """
    from nbkv.fixtures import quantized

    models = {"Q4_1": path, **{q: str(quantized(path, q)) for q in QUANTS}}
    per: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        single = scenario_single(model, quick)
        inter = scenario_interleaved(model, quick)
        dec = scenario_decode(model, True)
        with Engine(model, n_slots=1, n_ctx=1024) as e:
            rule = e.prefill_rule
        extra = [p - m for p, m in zip(single["imc_prefilled_per_turn"],
                                        single["minimum_per_turn"])]
        per[name] = {
            "rule": rule.describe(), "gen_rows": rule.gen_rows,
            "calibration_table": dict(rule.table),
            "extra_prefill_tokens_per_turn": mean(extra),
            "ratios": {
                "imc_prefilled_over_minimum": single["ratios"]["imc_prefilled_over_minimum"],
                "imc_over_limit_ttft": single["ratios"]["imc_over_limit_ttft"],
                "single_imc_vs_llama_cpp_ttft": single["ratios"]["imc_vs_llama_cpp_ttft"],
                "interleaved_imc_vs_llama_cpp_ttft":
                    inter["ratios"]["imc_vs_llama_cpp_ttft"],
                "exact_over_llama_decode": dec["ratios"]["exact_over_llama_decode"],
            },
            "replies_identical_to_llama": dec["replies_identical"],
        }
    base = per["Q4_1"]["ratios"]
    ratios: dict[str, float] = {}
    for q in QUANTS:
        for key, v in per[q]["ratios"].items():
            ratios[f"{q}_{key}"] = v
            # lower is better for the first two, higher for the rest: the quotient says how
            # this type fares against Q4_1 (1.0 = the same; > 1 worse for the first two)
            ratios[f"{q}_{key}_vs_Q4_1"] = v / base[key]
        ratios[f"{q}_extra_prefill_tokens_per_turn"] = per[q]["extra_prefill_tokens_per_turn"]
    return {"models": {k: os.path.basename(v) for k, v in models.items()}, **per,
            "ratios": ratios}
