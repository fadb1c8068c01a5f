"""Serving engines: llama-server's slots (nbkv pinning them, or the server choosing), vLLM's
prefix cache, and the in-kernel engine, on the same conversations in one run."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

from nbkv.bench.conversations import (
    NAMES,
    four_sessions,
    mean,
    mirrored,
    paragraph,
    played,
    run_conversations,
    system_prompt,
)
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
    convs, turns = four_sessions(rounds)
    n_ctx = 2048
    out: dict[str, Any] = {"sessions": len(NAMES), "rounds": rounds}
    ratios: dict[str, float] = {}
    replies = None
    by_slots = {}
    vllm: dict[str, Any] = {}
    for slots in (4, 2):
        results: dict[str, list] = {}
        results["kernel"] = played(NbkvRunner(path, "imc", slots, n_ctx), convs, turns, replies)
        if replies is None:
            replies = [r["text"] for r in results["kernel"]]
            # vLLM has no slots: one run, on the 4-slot kernel's conversation, right after it
            vllm = run_vllm(path, convs, turns, replies, n_ctx)
        with LlamaServer(path, slots=slots, ctx=n_ctx, threads=os.cpu_count(), batch=256,
                         ubatch=256, flash_attn="off") as srv:
            for name, pin in (("pinned", True), ("unpinned", False)):
                results[name] = played(RemoteRunner(srv.url, pin), convs, turns, replies)
        by_slots[slots] = results
    out["vllm"] = {k: v for k, v in vllm.items() if k != "results"}
    if "results" in vllm:  # the same prompts, token for token (the same tokenizer)
        out["vllm"]["same_prompt_tokens_as_kernel"] = [r["prompt"] for r in vllm["results"]] == [
            r["prompt"] for r in by_slots[4]["kernel"]]
    for slots, results in by_slots.items():
        if "results" in vllm:
            results["vllm"] = vllm["results"]
        later = slice(len(NAMES), None)
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
    # eager: torch.compile's warm-up of this model is far longer than the run on a CPU
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


@scenario("remote-exact")
def scenario_remote_exact(path: str, quick: bool) -> dict[str, Any]:
    """What exact replies cost per turn on llama-server against the in-kernel exact mode.

    A 10-turn chat (one session, ~370-token system prompt), run as A B B A pairs in one
    process on one server: the in-kernel engine (exact, its rewrite in idle time), the
    remote engine steered for exact replies (its rewrite in idle time too), and both with
    ``exact=False``; and the remote engine exact with no idle time between turns (an
    agent loop: the next turn reads the reply itself). First-token times of turns 2 on.
    """
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
        makers: dict[str, Callable[[], NbkvRunner | RemoteRunner]] = {
            "kernel exact": lambda: NbkvRunner(path, "imc", 1, n_ctx),
            "remote exact": lambda: RemoteRunner(srv.url, True),
            "kernel exact=False": lambda: NbkvRunner(path, "imc", 1, n_ctx, exact=False),
            "remote exact=False": lambda: RemoteRunner(srv.url, True, exact=False),
            "remote exact, no idle time": lambda: RemoteRunner(srv.url, True, settle=False),
        }
        # A B ... B A (--quick: once; else twice, 4 passes per variant): one pass's mean
        # moves by up to 2x on a shared machine; the median of the passes is reported,
        # with each pass and each adjacent remote/kernel pair's own ratio
        order = (1 if quick else 2) * mirrored(makers)
        replies = None
        for name in order:
            res = played(makers[name](), convs, turns, replies)
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
    out["median_of_passes_s"] = {v: statistics.median(ps) for v, ps in spread.items()}
    out["prefilled_per_turn"] = {v: [r["prefilled"] for r in rs] for v, rs in first.items()}
    out["exact_records"] = {v: sum(1 for r in rs if r.get("exact", True))
                            for v, rs in first.items() if v.startswith("remote")}
    out["steer_ms_per_turn"] = {v: 1000 * mean([r.get("steer_s", 0.0) for r in rs[later]])
                                for v, rs in first.items() if v.startswith("remote")}
    out["settle_ms_per_turn"] = {v: 1000 * mean([r.get("settle_s", 0.0) for r in rs[later]])
                                 for v, rs in first.items()}
    # ratios of the pass medians, and each A/B pair's own ratio (run next to each other)
    ttft = out["median_of_passes_s"]
    pairs = list(zip(spread["remote exact"], spread["kernel exact"]))
    out["remote_over_kernel_exact_per_pass"] = [a / b for a, b in pairs]
    k, r = ttft["kernel exact"], ttft["remote exact"]
    out["ratios"] = {
        "remote_exact_over_kernel_exact_ttft": r / k,
        "remote_exact_over_remote_inexact_ttft": r / ttft["remote exact=False"],
        "kernel_exact_over_kernel_inexact_ttft": k / ttft["kernel exact=False"],
        "remote_back_to_back_over_remote_exact_ttft": ttft["remote exact, no idle time"] / r,
    }
    return out
