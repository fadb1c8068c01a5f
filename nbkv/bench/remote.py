"""llama-server slots: nbkv pinning them, the server choosing, and the in-kernel engine."""

from __future__ import annotations

import os
from typing import Any

from nbkv.bench.conversations import mean, paragraph, run_conversations, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import NbkvRunner, RemoteRunner


@scenario("remote")
def scenario_remote(path: str, quick: bool) -> dict[str, Any]:
    """Four sessions interleaved on llama-server with 2 and 4 slots: nbkv pinning its slots,
    the same client leaving the choice to the server, and the in-kernel engine."""
    from nbkv.remote.server import LlamaServer, binary

    if binary() is None:
        return {"skipped": "no llama-server binary: run `make llama-server`", "ratios": {}}
    rounds = 2 if quick else 4
    names = ["Ada", "Brook", "Cyd", "Dale"]
    convs = {n: [{"role": "system", "content": system_prompt(n, 14)}] for n in names}
    turns = [(n, paragraph(r * 4 + i, 1)) for r in range(rounds) for i, n in enumerate(names)]
    n_ctx = 2048
    out: dict[str, Any] = {"sessions": len(names), "rounds": rounds}
    ratios: dict[str, float] = {}
    replies = None
    for slots in (4, 2):
        results: dict[str, list] = {}
        kernel = NbkvRunner(path, "imc", slots, n_ctx)
        results["kernel"] = run_conversations(kernel, convs, turns, replies)
        kernel.close()
        if replies is None:
            replies = [r["text"] for r in results["kernel"]]
        with LlamaServer(path, slots=slots, ctx=n_ctx, threads=os.cpu_count(), batch=256,
                         ubatch=256, flash_attn="off") as srv:
            for name, pin in (("pinned", True), ("unpinned", False)):
                runner = RemoteRunner(srv.url, pin)
                results[name] = run_conversations(runner, convs, turns, replies)
                runner.close()
        later = slice(len(names), None)
        ttft = {v: mean([r["ttft"] for r in rs[later]]) for v, rs in results.items()}
        reused = {v: mean([r["reused"] for r in rs[later]]) for v, rs in results.items()}
        out[f"{slots}_slots"] = {
            "mean_ttft_s_rounds_2_on": ttft,
            "mean_reused_tokens_rounds_2_on": reused,
            "reused_per_turn": {v: [r["reused"] for r in rs] for v, rs in results.items()},
            "server_slot_per_turn": {v: [r["slot"] for r in rs]
                                     for v, rs in results.items() if v != "kernel"},
            "pinned_not_verified": sum(1 for r in results["pinned"] if not r["verified"]),
            # what the HTTP path adds: first-token time not spent in the server's prefill
            # (render, tokenize over HTTP, the request, the first streamed event)
            "overhead_ms_per_request": 1000 * (
                mean([r["ttft"] - r["server_prefill_s"] for r in results["pinned"][later]])),
        }
        ratios[f"pinned_over_kernel_ttft_{slots}_slots"] = ttft["pinned"] / ttft["kernel"]
        ratios[f"pinned_over_kernel_reused_{slots}_slots"] = reused["pinned"] / max(
            reused["kernel"], 1)
        ratios[f"unpinned_over_pinned_ttft_{slots}_slots"] = ttft["unpinned"] / ttft["pinned"]
    out["mean_ttft_s_rounds_2_on"] = out["4_slots"]["mean_ttft_s_rounds_2_on"]
    out["ratios"] = ratios
    return out


@scenario("remote-exact")
def scenario_remote_exact(path: str, quick: bool) -> dict[str, Any]:
    """What exact replies cost per turn on llama-server against the in-kernel exact mode.

    A 10-turn chat (one session, ~370-token system prompt), run as A B B A pairs in one
    process on one server: the in-kernel engine (exact, its rewrite in idle time), the
    remote engine steered for exact replies (its rewrite in idle time too), and both with
    ``exact=False``; and the remote engine exact with no idle time between turns (an
    agent loop: the next turn reads the reply itself). First-token times of turns 2 on.
    """
    from nbkv.bench.runners import NbkvRunner, RemoteRunner
    from nbkv.remote.server import LlamaServer, binary

    if binary() is None:
        return {"skipped": "no llama-server binary: run `make llama-server`", "ratios": {}}
    turns_n = 6 if quick else 10
    convs = {"Ada": [{"role": "system", "content": system_prompt("Ada", 14)}]}
    turns = [("Ada", paragraph(i, 1)) for i in range(turns_n)]
    n_ctx = 2048
    out: dict[str, Any] = {"turns": turns_n}
    runs: dict[str, list[list[dict]]] = {}
    with LlamaServer(path, slots=1, ctx=n_ctx, threads=os.cpu_count(), cache_ram=0) as srv:
        makers = {
            "kernel exact": lambda: NbkvRunner(path, "imc", 1, n_ctx),
            "remote exact": lambda: RemoteRunner(srv.url, True),
            "kernel exact=False": lambda: NbkvRunner(path, "imc", 1, n_ctx, exact=False),
            "remote exact=False": lambda: RemoteRunner(srv.url, True, exact=False),
            "remote exact, no idle time": lambda: RemoteRunner(srv.url, True, settle=False),
        }
        order = list(makers) + list(reversed(makers))  # A B ... B A
        replies = None
        for name in order:
            runner = makers[name]()
            res = run_conversations(runner, convs, turns, replies)
            runner.close()
            if replies is None:
                replies = [r["text"] for r in res]
            runs.setdefault(name, []).append(res)
    later = slice(1, None)
    ttft = {v: mean([r["ttft"] for rs in runs_ for r in rs[later]])
            for v, runs_ in runs.items()}
    spread = {v: [mean([r["ttft"] for r in rs[later]]) for rs in runs_]
              for v, runs_ in runs.items()}
    first = {v: runs_[0] for v, runs_ in runs.items()}
    out["mean_ttft_s_turns_2_on"] = ttft
    out["mean_ttft_s_per_pass"] = spread
    out["prefilled_per_turn"] = {v: [r["prefilled"] for r in rs] for v, rs in first.items()}
    out["exact_records"] = {v: sum(1 for r in rs if r.get("exact", True))
                            for v, rs in first.items() if v.startswith("remote")}
    out["steer_ms_per_turn"] = {v: 1000 * mean([r.get("steer_s", 0.0) for r in rs[later]])
                                for v, rs in first.items() if v.startswith("remote")}
    out["settle_ms_per_turn"] = {v: 1000 * mean([r.get("settle_s", 0.0) for r in rs[later]])
                                 for v, rs in first.items()}
    k, r = ttft["kernel exact"], ttft["remote exact"]
    out["ratios"] = {
        "remote_exact_over_kernel_exact_ttft": r / k,
        "remote_exact_over_remote_inexact_ttft": r / ttft["remote exact=False"],
        "kernel_exact_over_kernel_inexact_ttft": k / ttft["kernel exact=False"],
        "remote_back_to_back_over_remote_exact_ttft": ttft["remote exact, no idle time"] / r,
    }
    return out
