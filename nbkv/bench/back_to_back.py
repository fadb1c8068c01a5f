"""An agent loop with no idle time between turns: what exact mode's rewrite costs then."""

from __future__ import annotations

import os
from typing import Any

from nbkv.bench.conversations import mean, mirrored, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import NbkvRunner

#: the engines compared, by name: keyword arguments, or None for cache="off"
B2B_VARIANTS: dict[str, dict[str, Any] | None] = {
    "exact": {},  # the default: rewrite="auto" (mixed steps when requests come back to back)
    "exact-idle": {"rewrite": "idle"},  # the reply rewritten only in idle time, or re-read
    "guesses": {"speculative": True},  # exact, a guess beside every token (two-row steps)
    "inexact": {"exact": False},
    "off": None,
}
B2B_TYPES = ("Q4_1", "Q4_K_M")  # the embedded weights and SmolLM2 re-quantized to Q4_K_M


def _decode_tps(log: list[dict]) -> float:
    decoded = sum(max(r["generated"] - 1, 0) for r in log)
    seconds = sum(r["decode_s"] for r in log)
    return decoded / seconds if seconds > 0 else float("nan")


def agent_loop(path: str, quick: bool) -> dict[str, Any]:
    """The loop on one model: every variant twice, in A B C D E E D C B A order."""
    n_turns = 5 if quick else 10
    sys_prompt = system_prompt("Agent", 12)
    asks = [f"Step {t}: name one file to check next." for t in range(n_turns)]
    runs: dict[str, list[list[dict]]] = {v: [] for v in B2B_VARIANTS}
    for name in mirrored(B2B_VARIANTS):
        kw = B2B_VARIANTS[name]
        runner = NbkvRunner(path, "off" if kw is None else "imc", 1, 4096, settle=False,
                            max_tokens=32, **(kw or {}))
        msgs = [{"role": "system", "content": sys_prompt}]
        log = []
        for a in asks:
            msgs.append({"role": "user", "content": a})
            r = runner.turn(msgs, "agent")
            msgs.append({"role": "assistant", "content": r["text"]})
            log.append(r)
        runner.close()
        runs[name].append(log)
    later = {v: [r for log in logs for r in log[1:]] for v, logs in runs.items()}
    ttft = {v: mean([r["ttft"] for r in rs]) for v, rs in later.items()}
    tps = {v: _decode_tps([r for log in logs for r in log]) for v, logs in runs.items()}
    replies = {v: [r["text"] for r in logs[0]] for v, logs in runs.items()}
    ratios = {f"{v}_over_inexact_ttft": ttft[v] / ttft["inexact"]
              for v in B2B_VARIANTS if v not in ("inexact", "off")}
    ratios.update({f"{v}_over_inexact_decode": tps[v] / tps["inexact"]
                   for v in B2B_VARIANTS if v not in ("inexact", "off")})
    ratios["off_over_exact_ttft"] = ttft["off"] / ttft["exact"]
    return {
        "turns": n_turns, "mean_ttft_s_turns_2_on": ttft, "decode_tokens_per_s": tps,
        "mean_wait_s_turns_2_on": {v: mean([r["wait_s"] for r in rs]) for v, rs in later.items()},
        "mean_rewrite_absorbed_tokens": {v: mean([r["rewrite_absorbed"] for r in rs])
                                         for v, rs in later.items()},
        "mean_rewrite_mixed_tokens": {v: mean([r["rewrite_mixed"] for r in rs])
                                      for v, rs in later.items()},
        "replies_identical_to_off": {v: replies[v] == replies["off"] for v in B2B_VARIANTS
                                     if v != "off"},
        "ratios": ratios,
    }


@scenario("back-to-back")
def scenario_back_to_back(path: str, quick: bool) -> dict[str, Any]:
    """An agent loop: short turns over a long system prompt, the next request sent the
    moment a reply ends, so the exact mode has no idle time to rewrite the reply first.

    On the embedded Q4_1 and on Q4_K_M: the default engine (exact, rewrite="auto": it
    rewrites a reply while generating it when requests come back to back), exact with the
    rewrite in idle time only (what exact mode did before), exact with guesses (two-row
    steps), exact=False and cache="off". Figures: the mean first-token time of turns 2+,
    and decoding speed (target: exact within 1.3x of exact=False on both types).
    """
    from nbkv.fixtures import quantized

    models = {q: path if q == "Q4_1" else str(quantized(path, q)) for q in B2B_TYPES}
    per = {q: agent_loop(m, quick) for q, m in models.items()}
    ratios: dict[str, float] = {}
    for q, res in per.items():
        ratios.update({f"{q}_{k}": v for k, v in res["ratios"].items()})
    # the headline: the worse of the two types
    ratios["exact_over_inexact_ttft"] = max(r["ratios"]["exact_over_inexact_ttft"]
                                            for r in per.values())
    return {"models": {q: os.path.basename(m) for q, m in models.items()}, **per,
            # flat, for the report's table of first-token times
            "mean_ttft_s_turns_2_on": {f"{q}/{v}": t for q, r in per.items()
                                       for v, t in r["mean_ttft_s_turns_2_on"].items()},
            "ratios": ratios}
