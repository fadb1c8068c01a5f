"""Sub-agents: the same agents one request at a time against all at once (batched decode)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from nbkv.bench.conversations import mean, paragraph, run_conversations, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import LlamaCppRunner, NbkvRunner
from nbkv.llama.backend import Batch, Context, Model


def batching_ceiling(path: str, n_streams: int, depth: int, reps: int = 9) -> dict[str, float]:
    """What batching can buy on this machine: one decode step of ``n_streams`` sequences
    against one step of a single sequence, one token (one row) per sequence as the engine
    generates, on a raw context at ``depth`` tokens; the best case for the tokens/s ratio is
    ``n * t1 / tn``."""
    model = Model(path)
    ctx = Context(model, 2048 * n_streams, n_streams, 256, flash_attn=0)
    batch = Batch(256)
    try:
        filler = [model.tokenize(paragraph(i, 6)) for i in range(n_streams)]
        for s in range(n_streams):
            toks = (filler[s] * (depth // len(filler[s]) + 1))[:depth]
            for i in range(0, depth, 256):
                batch.clear()
                batch.add_run(toks[i : i + 256], i, s, False)
                ctx.decode(batch)
        times: dict[int, list[float]] = {1: [], n_streams: []}
        for _ in range(reps):  # alternate, so both see the same machine load
            for n in times:
                batch.clear()
                for s in range(n):  # increasing sequence ids: one micro-batch, as the engine
                    batch.add(filler[s][0], depth, s, True)
                t0 = time.perf_counter()
                ctx.decode(batch)
                times[n].append(time.perf_counter() - t0)
                for s in range(n):
                    ctx.seq_rm(s, depth, -1)
        t1, tn = statistics.median(times[1]), statistics.median(times[n_streams])
        return {"depth": depth, "step_ms_1": 1000 * t1, f"step_ms_{n_streams}": 1000 * tn,
                "tokens_per_s_ratio": n_streams * t1 / tn}
    finally:
        batch.close()
        ctx.close()
        model.close()


@scenario("subagents")
def scenario_subagents(path: str, quick: bool) -> dict[str, Any]:
    """Four sub-agents with distinct system prompts, 8 turns each: batched vs. one by one.

    Agents send their next request as soon as a reply ends (no reading time): a reply's
    rewrite runs when the scheduler has nothing else to do, or the next request of that
    agent absorbs it; both are counted.
    """
    import threading

    n_agents, n_turns, max_tokens = 4, (2 if quick else 8), 32
    names = ["Ada", "Brook", "Cyd", "Dale"][:n_agents]
    convs = {n: [{"role": "system", "content": system_prompt(n, 8)}] for n in names}
    tasks = {n: [f"{n}, task {t}: " + paragraph(t + len(n), 1) for t in range(n_turns)]
             for n in names}
    # one request at a time, agents taking turns
    in_turns = [(n, tasks[n][t]) for t in range(n_turns) for n in names]

    def run(mode: str) -> tuple[float, list[dict], dict]:
        runner = NbkvRunner(path, "imc", n_agents, 2048, max_tokens=max_tokens, settle=False)
        t0 = time.perf_counter()
        if mode == "sequential":
            log = run_conversations(runner, convs, in_turns, None)
        else:  # every agent on its own thread, all at once
            per_agent: dict[str, list] = {}

            def play(n: str) -> None:
                per_agent[n] = run_conversations(runner, {n: convs[n]},
                                                 [(n, x) for x in tasks[n]], None)

            threads = [threading.Thread(target=play, args=(n,)) for n in names]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            log = [r for n in names for r in per_agent[n]]
        wall = time.perf_counter() - t0
        rewrites = runner.rewrite_summary()
        runner.close()
        for r in log:  # each agent's own turn number
            r["agent_turn"] = r["turn"] // n_agents if mode == "sequential" else r["turn"]
        return wall, log, rewrites

    out: dict[str, Any] = {}
    runs: dict[str, list[tuple[float, list, dict]]] = {"sequential": [], "batched": []}
    # A B B A: timings on shared machines drift, and this order cancels a steady drift
    for mode in ("sequential", "batched", "batched", "sequential"):
        runs[mode].append(run(mode))
    depth = 0
    replies: dict[str, list] = {}
    for mode, triples in runs.items():
        log = [r for _, lg, _ in triples for r in lg]
        wall = sum(w for w, _, _ in triples)
        gen = sum(r["generated"] for r in log)
        depth = max(depth, max(r["prompt"] for r in log))
        replies[mode] = [sorted((r["session"], r["agent_turn"], r["text"]) for r in lg)
                         for _, lg, _ in triples]
        out[mode] = {
            "runs": len(triples), "wall_s": wall, "walls_s": [w for w, _, _ in triples],
            "generated_tokens": gen, "tokens_per_s": gen / wall,
            "mean_ttft_s": mean([r["ttft"] for r in log]),
            "mean_ttft_s_turns_2_on": mean([r["ttft"] for r in log if r["agent_turn"] > 0]),
            "first_turn_ttft_s": sorted(r["ttft"] for r in log if r["agent_turn"] == 0),
            "max_ttft_s": max(r["ttft"] for r in log),
            "idle_rewrites": sum(rw["rewrites"] for _, _, rw in triples),
            "idle_rewrite_s": sum(rw["seconds"] for _, _, rw in triples),
            "rewrite_absorbed_tokens": sum(r["rewrite_absorbed"] for r in log),
        }
    # llama-cpp-python's Llama serving the agents one by one (one sequence: no reuse across them)
    llm = LlamaCppRunner(path, 2048, max_tokens)
    t0 = time.perf_counter()
    log = run_conversations(llm, convs, in_turns, None)
    out["llama-cpp"] = {"wall_s": time.perf_counter() - t0,
                        "mean_ttft_s": mean([r["ttft"] for r in log])}
    llm.close()
    ceiling = batching_ceiling(path, n_agents, depth // 2)
    seq, bat = out["sequential"], out["batched"]
    speedup = bat["tokens_per_s"] / seq["tokens_per_s"]
    every = replies["sequential"] + replies["batched"]
    return {
        "agents": n_agents, "turns": n_turns, "max_tokens": max_tokens, **out,
        "mean_ttft_s": {k: v["mean_ttft_s"] for k, v in out.items()},
        "decode_step_ceiling": ceiling,
        # batched replies equal one-at-a-time replies (docs/concepts/slots-imc.md)
        "replies_identical": all(r == every[0] for r in every),
        "ratios": {
            "batched_over_sequential_tokens_per_s": speedup,
            "decode_batching_ceiling": ceiling["tokens_per_s_ratio"],
            "batched_speedup_over_ceiling": speedup / ceiling["tokens_per_s_ratio"],
            "batched_ttft_over_single_session_ttft": bat["mean_ttft_s"] / seq["mean_ttft_s"],
            "batched_ttft_over_single_session_ttft_turns_2_on":
                bat["mean_ttft_s_turns_2_on"] / seq["mean_ttft_s_turns_2_on"],
            "batched_vs_llama_cpp_wall":
                out["llama-cpp"]["wall_s"] / (bat["wall_s"] / bat["runs"]),
        },
    }
