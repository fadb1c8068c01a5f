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
