"""An agent loop with no idle time between turns: what exact mode's rewrite costs then."""

from __future__ import annotations

from typing import Any

from nbkv.bench.conversations import mean, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import NbkvRunner


@scenario("back-to-back")
def scenario_back_to_back(path: str, quick: bool) -> dict[str, Any]:
    """An agent loop: short turns over a long system prompt, the next request sent the
    moment a reply ends, so the exact mode has no idle time to rewrite the reply first.

    The default engine (exact) against exact=False and cache="off", in A B C C B A order;
    the figure is the mean first-token time of turns 2+ (target: exact within 1.2x of
    exact=False).
    """
    n_turns = 5 if quick else 10
    sys_prompt = system_prompt("Agent", 12)
    asks = [f"Step {t}: name one file to check next." for t in range(n_turns)]
    variants: dict[str, dict[str, Any] | None] = {
        "exact": {}, "inexact": {"exact": False}, "off": None}
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for name in [*variants, *reversed(variants)]:
        kw = variants[name]
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
    ttft = {v: mean([r["ttft"] for log in logs for r in log[1:]]) for v, logs in runs.items()}
    absorbed = mean([r["rewrite_absorbed"] for log in runs["exact"] for r in log[1:]])
    replies = {v: [r["text"] for r in logs[0]] for v, logs in runs.items()}
    return {"turns": n_turns, "mean_ttft_s_turns_2_on": ttft,
            "exact_mean_rewrite_absorbed_tokens": absorbed,
            "replies_identical_exact_off": replies["exact"] == replies["off"],
            "ratios": {"exact_over_inexact_ttft": ttft["exact"] / ttft["inexact"],
                       "off_over_exact_ttft": ttft["off"] / ttft["exact"],
                       "off_over_inexact_ttft": ttft["off"] / ttft["inexact"]}}
