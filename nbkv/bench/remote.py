"""Serving engines: llama-server's slots (nbkv pinning them, or the server choosing), vLLM's
prefix cache, and the in-kernel engine, on the same conversations in one run."""

from __future__ import annotations

import os
from typing import Any

from nbkv.bench.conversations import mean, paragraph, run_conversations, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import NbkvRunner, OpenAIRunner, RemoteRunner


@scenario("remote")
def scenario_remote(path: str, quick: bool) -> dict[str, Any]:
    """Four sessions interleaved on llama-server with 2 and 4 slots: nbkv pinning its slots,
    the same client leaving the choice to the server, and the in-kernel engine; and on vLLM
    (its prefix cache has no slots: one run, shown beside both slot counts), serving the
    same SmolLM2 dequantized to bfloat16 on the same cores."""
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
    by_slots = {}
    vllm: dict[str, Any] = {}
    for slots in (4, 2):
        results: dict[str, list] = {}
        kernel = NbkvRunner(path, "imc", slots, n_ctx)
        results["kernel"] = run_conversations(kernel, convs, turns, replies)
        kernel.close()
        if replies is None:
            replies = [r["text"] for r in results["kernel"]]
            # vLLM has no slots: one run, on the 4-slot kernel's conversation, right after it
            vllm = run_vllm(path, convs, turns, replies, n_ctx)
        with LlamaServer(path, slots=slots, ctx=n_ctx, threads=os.cpu_count(), batch=256,
                         ubatch=256, flash_attn="off") as srv:
            for name, pin in (("pinned", True), ("unpinned", False)):
                runner = RemoteRunner(srv.url, pin)
                results[name] = run_conversations(runner, convs, turns, replies)
                runner.close()
        by_slots[slots] = results
    out["vllm"] = {k: v for k, v in vllm.items() if k != "results"}
    if "results" in vllm:  # the same prompts, token for token (the same tokenizer)
        out["vllm"]["same_prompt_tokens_as_kernel"] = [r["prompt"] for r in vllm["results"]] == [
            r["prompt"] for r in by_slots[4]["kernel"]]
    for slots, results in by_slots.items():
        if "results" in vllm:
            results["vllm"] = vllm["results"]
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
        if "vllm" in ttft:
            ratios[f"vllm_over_kernel_ttft_{slots}_slots"] = ttft["vllm"] / ttft["kernel"]
            ratios[f"vllm_over_pinned_ttft_{slots}_slots"] = ttft["vllm"] / ttft["pinned"]
            ratios[f"vllm_over_kernel_reused_{slots}_slots"] = reused["vllm"] / max(
                reused["kernel"], 1)
    out["mean_ttft_s_rounds_2_on"] = out["4_slots"]["mean_ttft_s_rounds_2_on"]
    out["ratios"] = ratios
    return out


def run_vllm(path: str, convs: dict, turns: list, replies: list | None, n_ctx: int
             ) -> dict[str, Any]:
    """The conversations on vLLM serving the GGUF's own weights (dequantized by transformers),
    with as many compute threads as the other engines; ``results`` per turn, or ``skipped``."""
    from nbkv.remote.vllm_server import VLLMServer, vllm_python

    python = vllm_python()
    if python is None:
        return {"skipped": "no vLLM venv: run `make vllm`"}
    from nbkv.core.errors import ServerError
    from nbkv.fixtures.hf_model import SMOLLM2, hf_model

    model = hf_model(python, SMOLLM2, gguf=path)
    threads = os.cpu_count() or 1
    # eager: torch.compile's warm-up of this model took over 10 minutes on 2 shared cores
    srv = VLLMServer(model, max_model_len=n_ctx, eager=True, kv_events=False,
                     threads=threads)
    try:
        with srv:
            runner = OpenAIRunner(srv.url)
            try:
                results = run_conversations(runner, convs, turns, replies)
                block = runner.engine.block_size
            finally:
                runner.close()
    except ServerError as e:  # the other engines' figures still count
        return {"skipped": f"vLLM failed: {str(e)[:300]}"}
    return {"results": results, "start_s": srv.start_s, "block_size": block,
            "threads": threads, "eager": True,
            "prompt_tokens_per_turn": [r["prompt"] for r in results],
            "not_verified": sum(1 for r in results if not r["verified"])}
