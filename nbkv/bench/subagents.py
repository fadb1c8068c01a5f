"""Sub-agents: the same agents one request at a time against all at once (batched decode)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from nbkv.bench.conversations import (
    mean,
    mirrored,
    paragraph,
    run_conversations,
    system_prompt,
)
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
    agents = _Agents(4, 2 if quick else 8, 32)
    out: dict[str, Any] = {}
    runs: dict[str, list[tuple[float, list, dict]]] = {"sequential": [], "batched": []}
    # A B B A: timings on shared machines drift, and this order cancels a steady drift
    for mode in mirrored(runs):
        runs[mode].append(agents.run(path, mode))
    depth = 0
    replies: dict[str, list] = {}
    for mode, triples in runs.items():
        out[mode] = _mode_figures(triples)
        depth = max(depth, max(r["prompt"] for _, lg, _ in triples for r in lg))
        replies[mode] = [sorted((r["session"], r["agent_turn"], r["text"]) for r in lg)
                         for _, lg, _ in triples]
    # llama-cpp-python's Llama serving the agents one by one (one sequence: no reuse across them)
    llm = LlamaCppRunner(path, 2048, agents.max_tokens)
    t0 = time.perf_counter()
    log = run_conversations(llm, agents.convs, agents.in_turns(), None)
    out["llama-cpp"] = {"wall_s": time.perf_counter() - t0,
                        "mean_ttft_s": mean([r["ttft"] for r in log])}
    llm.close()
    ceiling = batching_ceiling(path, agents.n, depth // 2)
    seq, bat = out["sequential"], out["batched"]
    speedup = bat["tokens_per_s"] / seq["tokens_per_s"]
    every = replies["sequential"] + replies["batched"]
    return {
        "agents": agents.n, "turns": agents.turns, "max_tokens": agents.max_tokens, **out,
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


class _Agents:
    """The sub-agents: their system prompts and tasks, played one by one or all at once."""

    def __init__(self, n: int, turns: int, max_tokens: int) -> None:
        self.n, self.turns, self.max_tokens = n, turns, max_tokens
        self.names = ["Ada", "Brook", "Cyd", "Dale"][:n]
        self.convs = {a: [{"role": "system", "content": system_prompt(a, 8)}]
                      for a in self.names}
        self.tasks = {a: [f"{a}, task {t}: " + paragraph(t + len(a), 1) for t in range(turns)]
                      for a in self.names}

    def in_turns(self) -> list[tuple[str, str]]:
        """One request at a time, the agents taking turns."""
        return [(a, self.tasks[a][t]) for t in range(self.turns) for a in self.names]

    def run(self, path: str, mode: str) -> tuple[float, list[dict], dict]:
        """(wall time, every request's record, the idle rewrites) of one run in ``mode``."""
        runner = NbkvRunner(path, "imc", self.n, 2048, max_tokens=self.max_tokens,
                            settle=False)
        t0 = time.perf_counter()
        if mode == "sequential":
            log = run_conversations(runner, self.convs, self.in_turns(), None)
        else:
            log = self._all_at_once(runner)
        wall = time.perf_counter() - t0
        rewrites = runner.rewrite_summary()
        runner.close()
        for r in log:  # each agent's own turn number
            r["agent_turn"] = r["turn"] // self.n if mode == "sequential" else r["turn"]
        return wall, log, rewrites

    def _all_at_once(self, runner: NbkvRunner) -> list[dict]:
        """Every agent on its own thread, all at once."""
        import threading

        per_agent: dict[str, list] = {}

        def play(a: str) -> None:
            per_agent[a] = run_conversations(runner, {a: self.convs[a]},
                                             [(a, x) for x in self.tasks[a]], None)

        threads = [threading.Thread(target=play, args=(a,)) for a in self.names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [r for a in self.names for r in per_agent[a]]


def _mode_figures(triples: list[tuple[float, list, dict]]) -> dict[str, Any]:
    """One mode's figures over its runs: wall time, tokens/s, first-token times, rewrites."""
    log = [r for _, lg, _ in triples for r in lg]
    wall = sum(w for w, _, _ in triples)
    gen = sum(r["generated"] for r in log)
    return {
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
