"""Side-by-side benchmark: nbkv's caches against no cache and llama-cpp-python's own reuse.

``python -m nbkv.bench`` runs every scenario on the same conversations, in one process, and
prints a table plus JSON (also written to ``--out``). Timings on shared CPUs are noisy, so
the figures that matter are *ratios between variants measured in the same run*; where two
variants are timed against each other they run in A B B A order, so that a machine getting
faster or slower during the run does not pass for a difference between them.

Chat scenarios call ``engine.settle()`` after every reply: the user reads, and in that idle
time exact mode rewrites the reply's KV as a batched prefill (README, Exactness). The
rewrite's own cost is measured separately (``decode``).

Variants:
  off        nbkv with cache="off": clear the slot and prefill everything, every request
  llama-cpp  llama_cpp.Llama.create_chat_completion: one sequence, longest-common-prefix reuse
  imc        nbkv Incremental Message Cache
  spc        nbkv System Prompt Cache
  limit      (single scenario) the physical floor: only the new tokens, decoded at that
             depth on a raw context with nothing else going on
  sequential / batched   (subagents) the same agents one request at a time / all at once
  plain (speculative) or exact (decode) / guesses / inexact   the default engine (exact,
             one token per sequence per step) / speculative=True (a prompt-lookup guess
             decoded beside each token) / exact=False (no idle-time rewrite of replies)
  llama      (decode) llama_cpp.Llama.generate on the same prompt tokens, greedy

Scenarios ``decode`` (single-session generation speed, and what the rewrite costs) and
``families`` (prefill against the minimum on plain, sliding-window, hybrid and recurrent
models, with tiny generated models from ``nbkv.fixtures.make_text_model``) measure the
engine's design; the others measure the caches against their alternatives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from . import templates
from .backend import Batch, Context, Model, default_threads
from .engine import Engine
from .events import SlotRewritten
from .models import default_model_path
from .policy import common_prefix

MAX_TOKENS = 16
QUESTIONS = [
    "Why is the sky blue?", "How does a refrigerator keep food cold?",
    "What did the printing press change?", "Why do cats purr?",
    "How do vaccines train the immune system?", "What makes bread rise?",
    "Why do we have leap years?", "How do bees find flowers?",
    "What is the difference between weather and climate?", "How does a compass work?",
    "Why does ice float?", "What causes the seasons?",
]
TOPICS = [
    "caches", "compilers", "networks", "databases", "operating systems", "file systems",
    "graphics cards", "keyboards", "batteries", "satellites", "spreadsheets", "robots",
    "printers", "web browsers", "encryption", "sensors",
]


def paragraph(seed: int, sentences: int) -> str:
    """Deterministic filler text about computing, ``sentences`` sentences long."""
    out = []
    for i in range(sentences):
        a = TOPICS[(seed * 7 + i * 3) % len(TOPICS)]
        b = TOPICS[(seed * 5 + i * 11 + 1) % len(TOPICS)]
        out.append(
            f"Point {seed}.{i}: explain how {a} relate to {b}, and give one everyday example "
            f"that a beginner would recognise."
        )
    return " ".join(out)


def system_prompt(name: str, sentences: int) -> str:
    """A long system prompt, distinct per ``name``."""
    return f"You are {name}, a careful assistant. " + " ".join(
        f"Rule {i} for {name}: stay accurate about {TOPICS[(i + len(name)) % len(TOPICS)]}, "
        f"keep answers short, and say when you are unsure."
        for i in range(sentences)
    )


class NbkvRunner:
    """An nbkv engine in one cache mode.

    ``settle=True`` (default): after each reply, finish its rewrite at once
    (``engine.settle()``, timed as ``settle_s``), as the engine does in idle time while a
    user reads; the next turn then never absorbs it. ``False`` (agents that send the next
    request at once): the rewrite runs in whatever idle time there is, or the next request
    absorbs it.
    """

    def __init__(self, path: str, cache: str, slots: int, n_ctx: int, template: str | None = None,
                 max_tokens: int = MAX_TOKENS, settle: bool = True, **engine_kw: Any) -> None:
        self.max_tokens = max_tokens
        self.settle = settle
        self.engine = Engine(path, n_slots=slots, n_ctx=n_ctx, cache=cache, template=template,
                             **engine_kw)
        self.rewrites: list[SlotRewritten] = []
        self.engine.subscribe(self._on_event)

    def _on_event(self, ev: object) -> None:
        if isinstance(ev, SlotRewritten):
            self.rewrites.append(ev)

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        res = self.engine.chat(messages, session=session, max_tokens=self.max_tokens,
                               temperature=0)
        settle_s = 0.0
        if self.settle:
            t0 = time.perf_counter()
            self.engine.settle()
            settle_s = time.perf_counter() - t0
        r = res.record
        return {"ttft": r.ttft_s, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                "prefilled": r.prefilled_tokens, "generated": r.generated_tokens,
                "strategy": r.strategy, "restore_s": r.restore_s, "decode_s": r.decode_s,
                "guesses": r.draft_tokens, "accepted": r.draft_accepted, "slot": r.slot,
                "checkpoint_pos": r.checkpoint_pos, "reprefilled": r.reprefilled_tokens,
                "rewrite_absorbed": r.rewrite_absorbed, "settle_s": settle_s, "id": r.id,
                "encoder_runs": r.encoder_runs,
                "finish": r.finish_reason, "text": res.text}

    def rewrite_summary(self) -> dict[str, float]:
        """The rewrites the engine has published so far: how many, positions, seconds."""
        return {"rewrites": len(self.rewrites),
                "positions": sum(e.tokens for e in self.rewrites),
                "seconds": sum(e.seconds for e in self.rewrites)}

    def close(self) -> None:
        self.engine.close()


class LlamaCppRunner:
    """llama-cpp-python's high-level ``Llama``: one sequence, prefix reuse built in."""

    def __init__(self, path: str, n_ctx: int, max_tokens: int = MAX_TOKENS) -> None:
        from llama_cpp import Llama

        self.max_tokens = max_tokens
        self.llm = Llama(path, n_ctx=n_ctx, n_batch=256, n_ubatch=256, verbose=False,
                         flash_attn=False, n_threads=default_threads())

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        ttft, text = None, ""
        for chunk in self.llm.create_chat_completion(messages, max_tokens=self.max_tokens,
                                                     temperature=0, stream=True):
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += delta
        return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": text}

    def close(self) -> None:
        self.llm.close()


class LimitRunner:
    """The physical floor: decode only the new tokens, on a context already holding the rest."""

    def __init__(self, path: str, n_ctx: int) -> None:
        self.model = Model(path)
        self.ctx = Context(self.model, n_ctx, 1, 256, flash_attn=0)
        self.batch = Batch(256)
        self.tokens: list[int] = []

    def _decode(self, tokens: list[int]) -> int:
        last = -1
        for i in range(0, len(tokens), 255):
            chunk = tokens[i : i + 255]
            self.batch.clear()
            last = self.batch.add_run(chunk, len(self.tokens), 0, True)
            if len(chunk) == 1:  # never a lone prompt token, as in nbkv (README, Exactness)
                self.batch.add(chunk[0], len(self.tokens) + 1, 0, False)
            self.ctx.decode(self.batch)
            self.ctx.seq_rm(0, len(self.tokens) + len(chunk), -1)
            self.tokens.extend(chunk)
        return last

    def turn(self, prompt: list[int], new: int) -> float:
        keep = common_prefix(self.tokens, prompt[: len(prompt) - new])
        self.ctx.seq_rm(0, keep, -1)
        del self.tokens[keep:]
        self._decode(prompt[keep : len(prompt) - new])  # untimed: the cached part
        t0 = time.perf_counter()
        last = self._decode(prompt[len(prompt) - new :])
        max(self.ctx.logits(last))  # read the logits, as a greedy sampler would
        return time.perf_counter() - t0

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


def run_conversations(
    runner: Any, convs: dict[str, list[dict]], turns: list[tuple[str, str]], replies: dict | None
) -> list[dict[str, Any]]:
    """Play ``turns`` (session, user text) against ``runner``; replies come from ``replies``
    when given (so every variant sees the same conversation), else from the runner itself."""
    hist = {k: [dict(m) for m in v] for k, v in convs.items()}
    out = []
    for i, (session, text) in enumerate(turns):
        msgs = hist[session]
        msgs.append({"role": "user", "content": text})
        r = runner.turn(msgs, session)
        reply = replies[i] if replies is not None else r["text"]
        msgs.append({"role": "assistant", "content": reply})
        r.update(session=session, turn=i)
        out.append(r)
    return out


def baselines(path: str, slots: int, n_ctx: int, convs: dict, turns: list, replies: list
              ) -> dict[str, list]:
    """The same conversations through nbkv off, nbkv SPC and llama-cpp-python's ``Llama``."""
    out = {}
    for name, make in (("off", lambda: NbkvRunner(path, "off", slots, n_ctx)),
                       ("spc", lambda: NbkvRunner(path, "spc", slots, n_ctx)),
                       ("llama-cpp", lambda: LlamaCppRunner(path, n_ctx))):
        r = make()
        out[name] = run_conversations(r, convs, turns, replies)
        r.close()
    return out


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def scenario_single(path: str, quick: bool) -> dict[str, Any]:
    """One conversation of 12 turns growing past 2,000 tokens."""
    n_turns = 6 if quick else 12
    convs = {"solo": [{"role": "system", "content": system_prompt("Ada", 6)}]}
    turns = [("solo", paragraph(t, 6)) for t in range(n_turns)]
    imc = NbkvRunner(path, "imc", 1, 4096)
    limit = LimitRunner(path, 4096)
    # imc and the physical floor run in lockstep, turn by turn, so that both see the same
    # machine load; the floor decodes only the minimum: every token that the previous
    # prompt and the reply to it did not already hold
    hist = [dict(m) for m in convs["solo"]]
    base, floor, minimum = [], [], []
    held: list[int] = []
    for i, (_, text) in enumerate(turns):
        hist.append({"role": "user", "content": text})
        prompt = imc.engine.tokenize_prompt(hist)
        new = len(prompt) - common_prefix(held, prompt)
        r = imc.turn(hist, "solo")
        r.update(session="solo", turn=i)
        floor.append({"ttft": limit.turn(prompt, new), "prefilled": new})
        base.append(r)
        minimum.append(new)
        held = prompt + imc.engine.model.tokenize(r["text"])
        hist.append({"role": "assistant", "content": r["text"]})
    imc.close()
    limit.close()
    replies = [r["text"] for r in base]
    results: dict[str, list] = {"imc": base, "limit": floor}
    results.update(baselines(path, 1, 4096, convs, turns, replies))
    later = slice(1, None)
    summary = {v: mean([r["ttft"] for r in rs[later]]) for v, rs in results.items()}
    imc_pref = [r["prefilled"] for r in base[later]]
    return {
        "turns": n_turns,
        "final_prompt_tokens": base[-1]["prompt"],
        "mean_ttft_s_turns_2_on": summary,
        "final_turn_ttft_s": {v: rs[-1]["ttft"] for v, rs in results.items()},
        "imc_prefilled_per_turn": imc_pref,
        "minimum_per_turn": minimum[1:],
        "ratios": {
            "imc_vs_llama_cpp_ttft": summary["llama-cpp"] / summary["imc"],
            "imc_vs_off_ttft": summary["off"] / summary["imc"],
            "imc_over_limit_ttft": summary["imc"] / summary["limit"],
            "imc_prefilled_over_minimum": sum(imc_pref) / max(sum(minimum[1:]), 1),
        },
    }


def scenario_interleaved(path: str, quick: bool) -> dict[str, Any]:
    """Four sessions with distinct system prompts, round-robin, on four slots."""
    rounds = 2 if quick else 4
    names = ["Ada", "Brook", "Cyd", "Dale"]
    convs = {n: [{"role": "system", "content": system_prompt(n, 14)}] for n in names}
    turns = [(n, paragraph(r * 4 + i, 1)) for r in range(rounds) for i, n in enumerate(names)]
    imc = NbkvRunner(path, "imc", 4, 2048)
    base = run_conversations(imc, convs, turns, None)
    imc.close()
    replies = [r["text"] for r in base]
    results: dict[str, list] = {"imc": base}
    results.update(baselines(path, 4, 2048, convs, turns, replies))
    later = slice(len(names), None)
    summary = {v: mean([r["ttft"] for r in rs[later]]) for v, rs in results.items()}
    return {
        "sessions": len(names), "rounds": rounds,
        "mean_prompt_tokens": mean([r["prompt"] for r in base]),
        "mean_ttft_s_rounds_2_on": summary,
        "ratios": {"imc_vs_llama_cpp_ttft": summary["llama-cpp"] / summary["imc"],
                   "imc_vs_off_ttft": summary["off"] / summary["imc"]},
    }


def scenario_drift(path: str, quick: bool) -> dict[str, Any]:
    """A template that renders the time into the system turn: no two calls render alike."""
    n_turns = 4 if quick else 8
    clock = {"t": datetime.datetime(2026, 1, 1, 9, 0, 0)}
    saved = templates._now
    templates._now = lambda: clock["t"]
    try:
        convs = {"drift": [{"role": "system", "content": system_prompt("Eve", 8)}]}
        turns = [("drift", paragraph(t, 1)) for t in range(n_turns)]
        results: dict[str, list] = {}
        replies = None
        for variant in ("imc", "off"):
            clock["t"] = datetime.datetime(2026, 1, 1, 9, 0, 0)
            runner = NbkvRunner(path, variant, 1, 4096, template=templates.CLOCK_CHATML)
            orig = runner.turn

            def ticking(msgs, session, orig=orig):
                clock["t"] += datetime.timedelta(minutes=1, seconds=7)
                return orig(msgs, session)

            runner.turn = ticking  # type: ignore[method-assign]
            results[variant] = run_conversations(runner, convs, turns, replies)
            replies = [r["text"] for r in results["imc"]]
            runner.close()
        # the shared prefix, computed independently of the engine's records: what two
        # renderings of the same messages, a minute apart, have in common
        eng = Engine(path, n_slots=1, n_ctx=4096, cache="off", template=templates.CLOCK_CHATML)
        msgs = convs["drift"] + [{"role": "user", "content": turns[0][1]}]
        a = eng.tokenize_prompt(msgs)
        clock["t"] += datetime.timedelta(minutes=1)
        b = eng.tokenize_prompt(msgs)
        eng.close()
        shared = common_prefix(a, b)
    finally:
        templates._now = saved
    imc = results["imc"][1:]
    salvage = mean([min(r["reused"], shared) / shared for r in imc])
    summary = {v: mean([r["ttft"] for r in rs[1:]]) for v, rs in results.items()}
    return {
        "turns": n_turns, "shared_prefix_tokens": shared,
        "imc_strategies": [r["strategy"] for r in results["imc"]],
        "imc_reused_per_turn": [r["reused"] for r in imc],
        "mean_ttft_s_turns_2_on": summary,
        "ratios": {"salvage_of_shared_prefix": salvage,
                   "imc_vs_off_ttft": summary["off"] / summary["imc"]},
    }


def scenario_shared_system(path: str, quick: bool) -> dict[str, Any]:
    """A 1,000-token system prompt shared by many short one-turn chats."""
    n_chats = 4 if quick else 8
    sys_text = system_prompt("Sam", 43)  # ~1,000 tokens
    convs = {f"u{i}": [{"role": "system", "content": sys_text}] for i in range(n_chats)}
    turns = [(f"u{i}", paragraph(i, 1)) for i in range(n_chats)]
    results: dict[str, list] = {}
    for name, make in (("spc", lambda: NbkvRunner(path, "spc", 2, 2048)),
                       ("imc", lambda: NbkvRunner(path, "imc", 2, 2048)),
                       ("off", lambda: NbkvRunner(path, "off", 2, 2048)),
                       ("llama-cpp", lambda: LlamaCppRunner(path, 2048))):
        r = make()
        results[name] = run_conversations(r, convs, turns, None)
        if name == "spc":
            sys_tokens = len(r.engine.tokenize_prompt(convs["u0"])) - 3
        r.close()
    later = slice(1, None)
    summary = {v: mean([r["ttft"] for r in rs[later]]) for v, rs in results.items()}
    restores = [r["restore_s"] for r in results["spc"][later]]
    return {
        "chats": n_chats, "system_prompt_tokens": sys_tokens,
        "mean_ttft_s_chats_2_on": summary,
        "spc_restore_ms": {"mean": 1000 * mean(restores), "max": 1000 * max(restores)},
        "ratios": {"spc_vs_off_ttft": summary["off"] / summary["spc"],
                   "spc_vs_llama_cpp_ttft": summary["llama-cpp"] / summary["spc"],
                   "imc_vs_llama_cpp_ttft": summary["llama-cpp"] / summary["imc"]},
    }


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
        # batched replies equal one-at-a-time replies (README, Concurrent sessions)
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


def _decode_rate(log: list[dict]) -> float:
    """Generated tokens per second after each reply's first token (as RequestRecord.decode_tps)."""
    decoded = sum(max(r["generated"] - 1, 0) for r in log)
    seconds = sum(r["decode_s"] for r in log)
    return decoded / seconds if seconds > 0 else float("nan")


def scenario_speculative(path: str, quick: bool) -> dict[str, Any]:
    """Do prompt-lookup guesses pay off against plain single-token decode?

    Two sessions on two slots, on two kinds of chat: short open questions, and sub-agent
    tasks (whose replies tend to restate the task, which a lookup can guess). Variants: the
    default engine (plain: one row per sequence per step), ``speculative=True`` (a guess
    decoded beside each token: two rows, two tokens when it is right) and ``exact=False``
    (no rewrite: shows whether exact mode costs anything during generation). Each variant
    runs twice, in A B C C B A order.
    """
    n_turns, max_tokens = (1 if quick else 4), 48
    names = ["Ada", "Brook"]
    convs = {n: [{"role": "system", "content": system_prompt(n, 8)}] for n in names}
    styles = {"questions": lambda n, t: QUESTIONS[(t + 3 * len(n)) % len(QUESTIONS)],
              "tasks": lambda n, t: f"{n}, task {t}: " + paragraph(t + len(n), 1)}
    variants = {"plain": {}, "guesses": {"speculative": True}, "inexact": {"exact": False}}
    out: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    deterministic, same_as_plain = True, {}
    pays_off = {}
    for style, user in styles.items():
        turns = [(n, user(n, t)) for n in names for t in range(n_turns)]
        res_style: dict[str, Any] = {}
        logs: dict[str, list[list[dict]]] = {v: [] for v in variants}
        for variant in [*variants, *reversed(variants)]:
            runner = NbkvRunner(path, "imc", 2, 2048, max_tokens=max_tokens,
                                **variants[variant])
            logs[variant].append(run_conversations(runner, convs, turns, None))
            runner.close()
        texts = {v: [[r["text"] for r in lg] for lg in lgs] for v, lgs in logs.items()}
        deterministic = deterministic and all(a == b for a, b in texts.values())
        same_as_plain[style] = {v: texts[v][0] == texts["plain"][0] for v in variants
                                if v != "plain"}
        for variant, lgs in logs.items():
            log = [r for lg in lgs for r in lg]
            res_style[variant] = {
                "decode_tokens_per_s": _decode_rate(log),
                "generated_tokens": sum(r["generated"] for r in log),
                "guesses": sum(r["guesses"] for r in log),
                "guesses_accepted": sum(r["accepted"] for r in log),
                "mean_settle_s": mean([r["settle_s"] for r in log])}
        out[style] = res_style
        g, plain = res_style["guesses"], res_style["plain"]["decode_tokens_per_s"]
        ratios[f"{style}_guess_acceptance"] = g["guesses_accepted"] / max(g["guesses"], 1)
        ratios[f"{style}_guesses_over_plain_decode"] = g["decode_tokens_per_s"] / plain
        ratios[f"{style}_inexact_over_plain_decode"] = (
            res_style["inexact"]["decode_tokens_per_s"] / plain)
        pays_off[style] = ratios[f"{style}_guesses_over_plain_decode"] > 1.0
    return {"turns": len(turns), "max_tokens": max_tokens, **out,
            "guesses_pay_off": pays_off,
            # each variant's two runs reply alike; guesses decode two rows, which round
            # like a batch, so their replies may differ from plain decoding at near-ties
            "replies_deterministic": deterministic,
            "replies_same_as_plain": same_as_plain, "ratios": ratios}


DECODE_PROMPTS = {"story": "Tell me a long story about a lighthouse keeper.",
                  "list": "List twenty fruits, one per line, numbered."}
DECODE_FOLLOWUP = "Thank you. Now sum that up in one sentence."
DECODE_VARIANTS = {"exact": {}, "guesses": {"speculative": True}, "inexact": {"exact": False},
                   "llama": None}


class LlamaDecodeRunner:
    """llama-cpp-python's high-level ``Llama`` generating from prompt tokens, greedy.

    ``generate`` yields each sampled token, then decodes it alone before sampling the next:
    plain llama.cpp, one row per step. It does not stop at an end-of-generation token;
    :meth:`reply` stops there, as nbkv does (that token is neither counted nor decoded).
    """

    def __init__(self, path: str, n_ctx: int, n_threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(path, n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_threads=n_threads,
                         n_threads_batch=n_threads, flash_attn=False, verbose=False)
        self.vocab = self.llm._model.vocab

    def reply(self, prompt: list[int], max_tokens: int, fresh: bool = True) -> dict[str, Any]:
        """Generate up to ``max_tokens`` after ``prompt``. ``fresh``: prefill it all from
        position 0; else reuse the longest common prefix with what the context holds."""
        import llama_cpp

        if fresh:
            self.llm.reset()
        tokens: list[int] = []
        reason = "length"
        t0 = time.perf_counter()
        t_first = t_last = 0.0
        gen = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                t_last = time.perf_counter()
                if not t_first:
                    t_first = t_last
                if llama_cpp.llama_vocab_is_eog(self.vocab, tok):
                    reason = "stop"
                    break
                tokens.append(tok)
                if len(tokens) >= max_tokens:
                    break
        finally:
            gen.close()
        text = self.llm.detokenize(tokens).decode("utf-8", errors="replace")
        # as RequestRecord: decode_s runs from the first token to the last sampled one
        return {"ttft": t_first - t0, "decode_s": t_last - t_first, "reply_s": t_last - t0,
                "generated": len(tokens), "finish": reason, "text": text}

    def close(self) -> None:
        self.llm.close()


def scenario_decode(path: str, quick: bool) -> dict[str, Any]:
    """Single-session generation speed: exact (the default), exact with guesses, inexact, and
    llama-cpp-python's ``Llama`` on the same prompt tokens, on a story and on a list.

    Every run starts from an empty slot (a fresh prefill), generates up to ``max_tokens``
    greedily (replies stop early only at the end-of-generation token), then the reply's
    rewrite is finished and timed (``engine.settle()``, and the ``SlotRewritten`` event's
    seconds, which include the part done in idle time before the call), then a second turn
    measures its first-token time. Variants run in A B C D D C B A order per reply style.
    """
    n_gen = 48 if quick else 160
    n_turn2 = 16
    threads = os.cpu_count() or 1
    engines = {v: NbkvRunner(path, "imc", 1, 2048, max_tokens=n_gen, n_threads=threads, **kw)
               for v, kw in DECODE_VARIANTS.items() if kw is not None}
    llama = LlamaDecodeRunner(path, 2048, threads)
    names = list(DECODE_VARIANTS)
    tokenize = engines["exact"].engine.tokenize_prompt

    def nbkv_run(runner: NbkvRunner, msgs: list[dict]) -> dict[str, Any]:
        eng = runner.engine
        eng.clear()
        res = eng.chat(msgs, session="d", max_tokens=n_gen, temperature=0)
        rec = res.record
        t0 = time.perf_counter()
        eng.settle()
        settle_s = time.perf_counter() - t0
        rewrite = [e for e in runner.rewrites if e.request_id == rec.id]
        follow = [*msgs, res.message, {"role": "user", "content": DECODE_FOLLOWUP}]
        res2 = eng.chat(follow, session="d", max_tokens=n_turn2, temperature=0)
        eng.settle()
        r2 = res2.record
        return {"ttft": rec.ttft_s, "decode_s": rec.decode_s, "reply_s": rec.ttft_s + rec.decode_s,
                "generated": rec.generated_tokens, "finish": rec.finish_reason,
                "guesses": rec.draft_tokens, "accepted": rec.draft_accepted,
                "decode_tps": rec.decode_tps, "text": res.text,
                "settle_call_s": settle_s,
                "rewrite_s": sum(e.seconds for e in rewrite),
                "rewrite_positions": sum(e.tokens for e in rewrite),
                "turn2_ttft": r2.ttft_s, "turn2_prefilled": r2.prefilled_tokens,
                "turn2_reused": r2.reused_tokens, "turn2_absorbed": r2.rewrite_absorbed,
                "turn2_text": res2.text}

    def llama_run(msgs: list[dict]) -> dict[str, Any]:
        r = llama.reply(tokenize(msgs), n_gen)
        r["decode_tps"] = (r["generated"] - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0
        follow = [*msgs, {"role": "assistant", "content": r["text"]},
                  {"role": "user", "content": DECODE_FOLLOWUP}]
        r2 = llama.reply(tokenize(follow), n_turn2, fresh=False)  # Llama's own prefix reuse
        r.update(turn2_ttft=r2["ttft"], turn2_text=r2["text"])
        return r

    try:
        warm = [{"role": "user", "content": "Hello!"}]  # first decodes allocate: not timed
        for runner in engines.values():
            runner.engine.chat(warm, max_tokens=4, temperature=0)
            runner.engine.settle()
        llama.reply(tokenize(warm), 4)
        styles: dict[str, Any] = {}
        ratios: dict[str, float] = {}
        for style, question in DECODE_PROMPTS.items():
            msgs = [{"role": "user", "content": question}]
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for name in [*names, *reversed(names)]:
                runs[name].append(llama_run(msgs) if name == "llama"
                                  else nbkv_run(engines[name], msgs))
            # the second turn from scratch (plain llama.cpp, nothing reused): exact mode's
            # cached second turn must equal it; inexact's reuses token-by-token KV
            ex = runs["exact"][0]
            follow = [*msgs, {"role": "assistant", "content": ex["text"]},
                      {"role": "user", "content": DECODE_FOLLOWUP}]
            scratch2 = llama.reply(tokenize(follow), n_turn2)["text"]
            res: dict[str, Any] = {"prompt_tokens": len(tokenize(msgs))}
            for name, rs in runs.items():
                decoded = sum(max(r["generated"] - 1, 0) for r in rs)
                res[name] = {
                    "decode_tokens_per_s": decoded / sum(r["decode_s"] for r in rs),
                    "decode_tps_runs": [r["decode_tps"] for r in rs],
                    "generated_tokens": [r["generated"] for r in rs],
                    "finish": [r["finish"] for r in rs],
                    "ttft_s": mean([r["ttft"] for r in rs]),
                    "reply_s": mean([r["reply_s"] for r in rs]),
                    "turn2_ttft_s": mean([r["turn2_ttft"] for r in rs]),
                }
                if name != "llama":
                    res[name].update(
                        rewrite_s=mean([r["rewrite_s"] for r in rs]),
                        rewrite_positions=rs[0]["rewrite_positions"],
                        settle_call_s=mean([r["settle_call_s"] for r in rs]),
                        turn2_prefilled=rs[0]["turn2_prefilled"],
                        turn2_reused=rs[0]["turn2_reused"],
                        turn2_rewrite_absorbed=max(r["turn2_absorbed"] for r in rs),
                        guesses=sum(r["guesses"] for r in rs),
                        guesses_accepted=sum(r["accepted"] for r in rs))
            first = {n: rs[0]["text"] for n, rs in runs.items()}
            res["replies_identical"] = {
                "exact_inexact_llama": first["exact"] == first["inexact"] == first["llama"],
                "guesses_vs_exact": first["guesses"] == first["exact"],
                "deterministic": all(r["text"] == rs[0]["text"] for rs in runs.values()
                                     for r in rs)}
            res["turn2_equals_scratch"] = {n: rs[0]["turn2_text"] == scratch2
                                           for n, rs in runs.items()}
            res["reply_text"] = {n: rs[0]["text"] for n, rs in runs.items()}
            styles[style] = res
            tps = {n: res[n]["decode_tokens_per_s"] for n in names}
            ratios[f"{style}_exact_over_inexact_decode"] = tps["exact"] / tps["inexact"]
            ratios[f"{style}_exact_over_llama_decode"] = tps["exact"] / tps["llama"]
            ratios[f"{style}_guesses_over_exact_decode"] = tps["guesses"] / tps["exact"]
            ratios[f"{style}_exact_over_llama_reply_time"] = (
                res["exact"]["reply_s"] / res["llama"]["reply_s"])
            ratios[f"{style}_rewrite_over_reply_time"] = (
                res["exact"]["rewrite_s"] / res["exact"]["reply_s"])
            ratios[f"{style}_exact_over_inexact_turn2_ttft"] = (
                res["exact"]["turn2_ttft_s"] / res["inexact"]["turn2_ttft_s"])
        for key in ("exact_over_inexact_decode", "exact_over_llama_decode",
                    "guesses_over_exact_decode", "exact_over_inexact_turn2_ttft"):
            ratios[key] = statistics.fmean(ratios[f"{s}_{key}"] for s in DECODE_PROMPTS)
    finally:
        for runner in engines.values():
            runner.close()
        llama.close()
    return {"max_tokens": n_gen, "turn2_max_tokens": n_turn2, "n_threads": threads, **styles,
            "decode_tokens_per_s": {f"{s}/{n}": styles[s][n]["decode_tokens_per_s"]
                                    for s in DECODE_PROMPTS for n in names},
            "replies_identical": all(styles[s]["replies_identical"]["exact_inexact_llama"]
                                     for s in DECODE_PROMPTS),
            "ratios": ratios}


FAMILIES = {"smollm2": "plain", "gemma3": "sliding-window", "lfm2": "hybrid",
            "mamba2": "recurrent", "granitehybrid": "hybrid"}


def family_model(family: str) -> str:
    """The embedded SmolLM2, or a tiny generated model of ``family`` with its tokenizer."""
    if family == "smollm2":
        return str(default_model_path())
    from .fixtures import make_text_model

    return str(make_text_model(family))


def _family_chat(path: str, slots: int, n_ctx: int, convs: dict[str, list[dict]],
                 turns: list[tuple[str, str]]) -> dict[str, Any]:
    """Play ``turns`` on one engine, settling between turns (the user reads), and compare
    each turn's prefill with the minimum.

    ``minimum`` (turns 2+ of a session): prompt_tokens(k) - prompt_tokens(k-1) -
    generated_tokens(k-1), the new message and the template's glue. ``reusable``: what a
    cache that can cut its KV anywhere would still prefill, from the session's slot tokens
    before the turn (the minimum, plus reply tokens that re-tokenize differently in the
    new prompt, plus a length-cut reply's last token, which was never decoded; at least 2).
    """
    runner = NbkvRunner(path, "imc", slots, n_ctx)
    eng = runner.engine
    hist = {k: [dict(m) for m in v] for k, v in convs.items()}
    last: dict[str, dict] = {}
    rows = []
    try:
        for i, (session, text) in enumerate(turns):
            msgs = hist[session]
            msgs.append({"role": "user", "content": text})
            prompt = eng.tokenize_prompt(msgs)
            prev = last.get(session)
            reusable = None
            if prev is not None:
                held = eng.slots()[prev["slot"]].tokens
                reusable = len(prompt) - min(common_prefix(held, prompt), len(prompt) - 2)
            r = runner.turn(msgs, session)
            msgs.append({"role": "assistant", "content": r["text"]})
            rows.append({
                "session": session, "turn": i, "prompt": r["prompt"], "reused": r["reused"],
                "prefilled": r["prefilled"], "generated": r["generated"],
                "minimum": (r["prompt"] - prev["prompt"] - prev["generated"]
                            if prev is not None else None),
                "reusable": reusable, "reprefilled": r["reprefilled"],
                "checkpoint_pos": r["checkpoint_pos"], "rewrite_absorbed": r["rewrite_absorbed"],
                "ttft_ms": 1000 * r["ttft"], "restore_ms": 1000 * r["restore_s"],
                "settle_ms": 1000 * r["settle_s"]})
            last[session] = r
        infos = eng.slots()
        memory = eng.memory.kind
    finally:
        runner.close()
    later = [r for r in rows if r["minimum"] is not None]
    over_min = [r["prefilled"] / max(r["minimum"], 1) for r in later]
    over_reusable = [r["prefilled"] / max(r["reusable"], 1) for r in later]
    return {
        "memory": memory, "turns": rows,
        "prefilled_over_minimum": {"mean": mean(over_min), "max": max(over_min)},
        "prefilled_over_reusable": {"mean": mean(over_reusable), "max": max(over_reusable)},
        "checkpoints_per_slot": [len(s.checkpoints) for s in infos if s.tokens],
        "checkpoint_bytes_per_slot": [s.checkpoint_bytes for s in infos if s.tokens],
        "_later": later,
    }


def scenario_families(path: str, quick: bool) -> dict[str, Any]:
    """Prefill against the minimum on every memory class: plain (SmolLM2), sliding-window
    (gemma3), hybrid (lfm2, granitehybrid) and recurrent (mamba2).

    For each family: the single scenario's 12-turn chat on one slot, and four sessions
    interleaved on four slots, with short replies, settling between turns. The generated
    models are tiny (64 wide, 4 layers, random weights, SmolLM2's tokenizer), so their
    first-token times show what checkpoints cost at a depth, not a real model's speed: they
    are compared with SmolLM2's at the same turn. ``path`` is not used: SmolLM2 is the
    plain reference.
    """
    n_single, rounds = (4, 2) if quick else (12, 4)
    single_convs = {"solo": [{"role": "system", "content": system_prompt("Ada", 6)}]}
    single_turns = [("solo", paragraph(t, 6)) for t in range(n_single)]
    names = ["Ada", "Brook", "Cyd", "Dale"]
    inter_convs = {n: [{"role": "system", "content": system_prompt(n, 14)}] for n in names}
    inter_turns = [(n, paragraph(r * 4 + i, 1)) for r in range(rounds)
                   for i, n in enumerate(names)]
    out: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for family in FAMILIES:
        model = family_model(family)
        single = _family_chat(model, 1, 4096, single_convs, single_turns)
        inter = _family_chat(model, 4, 2048, inter_convs, inter_turns)
        later = single.pop("_later") + inter.pop("_later")
        over_min = [r["prefilled"] / max(r["minimum"], 1) for r in later]
        over_reusable = [r["prefilled"] / max(r["reusable"], 1) for r in later]
        out[family] = {"memory": single["memory"], "single": single, "interleaved": inter}
        ratios[f"{family}_prefilled_over_minimum"] = mean(over_min)
        ratios[f"{family}_prefilled_over_minimum_max"] = max(over_min)
        ratios[f"{family}_prefilled_over_reusable"] = mean(over_reusable)
        ratios[f"{family}_prefilled_over_reusable_max"] = max(over_reusable)
    ref = out["smollm2"]["single"]["turns"]
    for family in FAMILIES:
        rows = out[family]["single"]["turns"]
        per_turn = [r["ttft_ms"] / s["ttft_ms"] for r, s in zip(rows, ref)]
        out[family]["ttft_over_smollm2_per_turn"] = per_turn
        if family != "smollm2":
            ratios[f"{family}_ttft_over_smollm2"] = mean(per_turn[1:])
    return {
        "single_turns": n_single, "interleaved_rounds": rounds, "max_tokens": MAX_TOKENS,
        **out,
        "checkpoint_bytes_per_slot": {f: max(out[f]["single"]["checkpoint_bytes_per_slot"]
                                             + out[f]["interleaved"]["checkpoint_bytes_per_slot"])
                                      for f in FAMILIES},
        "ratios": ratios,
    }


class HandlerRunner:
    """A llama-cpp-python multimodal chat handler by name (``llama_chat_format``): every turn
    clears the KV cache, re-encodes every image and re-prefills the whole prompt."""

    def __init__(self, path: str, mmproj: str, handler: str, n_ctx: int) -> None:
        from llama_cpp import Llama, llama_chat_format

        self.handler = getattr(llama_chat_format, handler)(clip_model_path=mmproj,
                                                           verbose=False)
        # all cores, as nbkv (Llama's default is half of them, which its handlers' image
        # encoder inherits)
        self.llm = Llama(path, chat_handler=self.handler, n_ctx=n_ctx, n_batch=1024,
                         n_ubatch=1024, verbose=False, flash_attn=False,
                         n_threads=default_threads())
        self.max_tokens = MAX_TOKENS
        init = getattr(self.handler, "_init_mtmd_context", None)
        if init is not None:  # load the projector now, as nbkv's Engine does, not in turn 1
            init(self.llm)

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        r = LlamaCppRunner.turn(self, messages, session)  # the same streaming TTFT measurement
        r["encoder_runs"] = 1  # the image of the conversation, again every turn
        return r

    def close(self) -> None:
        self.llm.close()


def _png_data_uri(seed: int, size: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(a).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGE_FOLLOWUPS = ["Describe its colours.", "Is it a photo?", "What is two plus two?",
                   "Back to the picture: is it bright?", "Summarize."]


def _vision_runner(variant: str, path: str, mmproj: str) -> Any:
    """nbkv (``"imc"``, or ``"off"`` with its embedding cache off too), else the
    llama-cpp-python chat handler of that name."""
    from .embeddings import EmbeddingCache

    if variant not in ("imc", "off"):
        return HandlerRunner(path, mmproj, variant, 4096)
    return NbkvRunner(path, variant, 1, 4096, settle=False, mmproj=mmproj, n_batch=1024,
                      embedding_cache=EmbeddingCache(0 if variant == "off" else 256 << 20))


def _image_chat(runner: Any, kind: str, n_turns: int) -> list[dict[str, Any]]:
    """A picture (32 px for ``"tiny"`` projectors, else 512), then text follow-ups about it:
    each turn's figures (``runner.turn``)."""
    uri = _png_data_uri(7, 32 if kind == "tiny" else 512)
    first = {"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": uri}}]}
    hist: list[dict] = [{"role": "system", "content": "You describe pictures briefly."}]
    out = []
    try:
        for t in range(n_turns):
            hist.append(first if t == 0 else {"role": "user", "content": IMAGE_FOLLOWUPS[t - 1]})
            r = runner.turn(hist, "v")
            hist.append({"role": "assistant", "content": r["text"]})
            out.append(r)
    finally:
        runner.close()
    return out


def scenario_vision(path: str, quick: bool, kind: str = "tiny") -> dict[str, Any]:
    """An image conversation of 6 turns: nbkv IMC vs. llama-cpp's Llava15ChatHandler vs. off."""
    from .fixtures import make_mmproj

    projector = "mlp" if kind == "tiny" else "gemma3"
    mmproj = str(make_mmproj(kind=kind, projector=projector))
    n_turns = 3 if quick else 6
    variants = {"imc": "imc", "off": "off", "llava-handler": "Llava15ChatHandler"}
    results = {name: _image_chat(_vision_runner(v, path, mmproj), kind, n_turns)
               for name, v in variants.items()}
    final = {v: rs[-1]["ttft"] for v, rs in results.items()}
    return {
        "projector": f"{kind} {projector}", "turns": n_turns,
        "first_turn_prompt_positions": results["imc"][0]["prompt"],
        "ttft_s_per_turn": {v: [r["ttft"] for r in rs] for v, rs in results.items()},
        "encoder_runs": {v: sum(r["encoder_runs"] for r in rs) for v, rs in results.items()},
        "mean_ttft_s": {v: mean([r["ttft"] for r in rs[1:]]) for v, rs in results.items()},
        "ratios": {"imc_vs_handler_final_turn_ttft": final["llava-handler"] / final["imc"],
                   "imc_vs_off_final_turn_ttft": final["off"] / final["imc"]},
    }


def scenario_vision_realistic(path: str, quick: bool) -> dict[str, Any]:
    """The same with a SmolVLM-sized projector (768 wide, 12 blocks, 512-px images)."""
    return scenario_vision(path, quick, kind="realistic")


_RESTART = """
import json, sys, time
t0 = time.perf_counter()
from nbkv import Engine
from nbkv.sessions import SessionStore
path, save, mode, msgs_file, max_tokens = sys.argv[1:6]
msgs = json.load(open(msgs_file))
e = Engine(path, n_slots=1, n_ctx=4096)
load_s = time.perf_counter() - t0
restore_s = 0.0
if mode == "restore":
    t1 = time.perf_counter()
    e.restore(save, SessionStore())
    restore_s = time.perf_counter() - t1
r = e.chat(msgs, session="solo", max_tokens=int(max_tokens), temperature=0)
print(json.dumps({"load_s": load_s, "restore_s": restore_s, "ttft": r.record.ttft_s,
                  "text": r.text, "strategy": r.record.strategy,
                  "prefilled": r.record.prefilled_tokens}))
e.close()
"""


def _fresh_process(path: str, save: str, mode: str, msgs_file: str) -> dict[str, Any]:
    import subprocess

    p = subprocess.run([sys.executable, "-c", _RESTART, path, save, mode, msgs_file,
                        str(MAX_TOKENS)], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def scenario_restore(path: str, quick: bool) -> dict[str, Any]:
    """A 2,000-token conversation saved, then its next turn in a fresh process.

    Variants: ``warm`` (the next turn in the process that built the conversation),
    ``restored`` (a new process: load, ``engine.restore``, next turn) and ``rebuild`` (a new
    process without the save: the whole conversation is prefilled). Fresh processes run in
    A B B A order; the warm figure is measured twice, the second time after an in-process
    restore of the same save (the same KV).
    """
    import tempfile

    from .sessions import SessionStore

    n_turns = 6 if quick else 12
    hist = [{"role": "system", "content": system_prompt("Ada", 6)}]
    runner = NbkvRunner(path, "imc", 1, 4096)
    e = runner.engine
    for t in range(n_turns):
        hist.append({"role": "user", "content": paragraph(t, 6)})
        r = runner.turn(hist, "solo")
        hist.append({"role": "assistant", "content": r["text"]})
    nxt = hist + [{"role": "user", "content": paragraph(n_turns, 6)}]
    with tempfile.TemporaryDirectory(prefix="nbkv-bench-") as tmp:
        save_dir = os.path.join(tmp, "save")
        saves = [e.save(save_dir, SessionStore()) for _ in range(2)]
        rep = saves[-1]  # the second save finds its blobs on disk: what autosave pays
        warm = []
        for i in range(2):
            if i:
                e.restore(save_dir, SessionStore())
            w = e.chat(nxt, session="solo", max_tokens=MAX_TOKENS, temperature=0)
            warm.append({"ttft": w.record.ttft_s, "text": w.text, "strategy": w.record.strategy})
        runner.close()
        msgs_file = os.path.join(tmp, "next.json")
        with open(msgs_file, "w") as f:
            json.dump(nxt, f)
        runs: dict[str, list[dict[str, Any]]] = {"restored": [], "rebuild": []}
        for mode in ("restored", "rebuild", "rebuild", "restored"):
            runs[mode].append(_fresh_process(path, save_dir, mode.replace("restored", "restore"),
                                             msgs_file))
        bytes_on_disk = sum(os.path.getsize(os.path.join(d, f))
                            for d, _, fs in os.walk(save_dir) for f in fs)
    ttft = {"warm": mean([w["ttft"] for w in warm]),
            "restored": mean([r["ttft"] for r in runs["restored"]]),
            "rebuild": mean([r["ttft"] for r in runs["rebuild"]])}
    return {
        "conversation_tokens": rep.slots[0].tokens,
        "save_s": saves[0].seconds, "save_again_s": rep.seconds,
        "save_bytes": rep.nbytes, "bytes_on_disk": bytes_on_disk,
        "restore_s": mean([r["restore_s"] for r in runs["restored"]]),
        "load_s": mean([r["load_s"] for r in runs["restored"] + runs["rebuild"]]),
        "mean_ttft_s": ttft,
        "strategies": {"warm": [w["strategy"] for w in warm],
                       **{k: [r["strategy"] for r in v] for k, v in runs.items()}},
        "replies_equal": len({w["text"] for w in warm} |
                             {r["text"] for v in runs.values() for r in v}) == 1,
        "ratios": {
            "restored_over_warm_ttft": ttft["restored"] / ttft["warm"],
            "rebuild_over_restored_ttft": ttft["rebuild"] / ttft["restored"],
        },
    }


def scenario_kv_types(path: str, quick: bool) -> dict[str, Any]:
    """f16 against q8_0 KV (with the flash attention a quantized V needs), side by side.

    Each variant chats the same 12-turn conversation in lockstep; reported: bytes per slot
    (planned and allocated), prefill and decode rates, first-token times, and the exactness
    check (the final reply equals a from-scratch one with the same settings, and the slot's
    probe logits equal a from-scratch decode's).
    """
    import numpy as np

    from .hardware import kv_type_id
    from .oracle import scratch_logits

    n_turns = 6 if quick else 12
    variants = {"f16": dict(type_k="f16", type_v="f16", flash_attn="off"),
                "q8_0": dict(type_k="q8_0", type_v="q8_0", flash_attn="on")}
    runners = {v: NbkvRunner(path, "imc", 1, 4096, **kw) for v, kw in variants.items()}
    hist = {v: [{"role": "system", "content": system_prompt("Ada", 6)}] for v in variants}
    logs: dict[str, list[dict]] = {v: [] for v in variants}
    for t in range(n_turns):
        for v, runner in runners.items():
            hist[v].append({"role": "user", "content": paragraph(t, 6)})
            r = runner.turn(hist[v], "solo")
            logs[v].append(r)
            hist[v].append({"role": "assistant", "content": r["text"]})
    out: dict[str, Any] = {"turns": n_turns, "variants": {}}
    for v, runner in runners.items():
        e, kw = runner.engine, variants[v]
        rs = logs[v]
        fresh = NbkvRunner(path, "off", 1, 4096, **kw)
        exact_reply = fresh.turn(hist[v][:-1], "x")["text"] == rs[-1]["text"]
        fresh.close()
        slot = e.slots()[0]
        got = np.array(e.probe(0, 42), dtype=np.float32)
        want = scratch_logits(e.model, slot.tokens, 42,
                              flash_attn=1 if kw["flash_attn"] == "on" else 0,
                              type_k=kv_type_id(kw["type_k"]), type_v=kv_type_id(kw["type_v"]))
        later = rs[1:]
        out["variants"][v] = {
            "bytes_per_slot_planned": e.plan.per_slot,
            "bytes_allocated": e.ctx.kv_buffer_bytes,
            "kv_bytes_per_token": e.plan.kv_bytes_per_token,
            "prefill_tok_per_s": sum(r["prefilled"] for r in rs)
            / max(sum(r["ttft"] for r in rs), 1e-9),
            "decode_tok_per_s": sum(r["generated"] - 1 for r in rs)
            / max(sum(r["decode_s"] for r in rs), 1e-9),
            "ttft_s": [r["ttft"] for r in rs],
            "mean_ttft_s_turns_2_on": mean([r["ttft"] for r in later]),
            "final_reply_equals_fresh": exact_reply,
            "probe_logits_equal_fresh": bool(want is not None and np.array_equal(got, want)),
        }
        runner.close()
    f16, q8 = out["variants"]["f16"], out["variants"]["q8_0"]
    out["ratios"] = {
        "q8_0_over_f16_bytes": q8["bytes_per_slot_planned"] / f16["bytes_per_slot_planned"],
        "q8_0_over_f16_ttft": q8["mean_ttft_s_turns_2_on"] / f16["mean_ttft_s_turns_2_on"],
        "q8_0_over_f16_decode_rate": q8["decode_tok_per_s"] / f16["decode_tok_per_s"],
        "exact_variants": sum(x["final_reply_equals_fresh"] and x["probe_logits_equal_fresh"]
                              for x in out["variants"].values()),
    }
    return out


#: (text family, projector type) of the generated vision pairs (tests/test_vision_families.py)
VISION_PAIRS = (("gemma3", "gemma3"), ("lfm2", "lfm2"), ("llama", "idefics3"),
                ("qwen2vl", "qwen2vl_merger"), ("qwen2vl", "qwen2.5vl_merger"),
                ("qwen3vl", "qwen3vl_merger"))
#: llama-cpp-python's chat handler for a projector type; the others get its LLaVA-1.5 handler,
#: which runs any libmtmd projector (its ``MTMDChatHandler`` needs a chat template that takes
#: content lists, which SmolLM2's, copied into the generated text models, does not)
VISION_HANDLERS = {"qwen2vl_merger": "Qwen25VLChatHandler",
                   "qwen2.5vl_merger": "Qwen25VLChatHandler"}


def scenario_vision_families(path: str, quick: bool, kind: str = "tiny") -> dict[str, Any]:
    """The 6-turn image conversation on every generated vision pair: TTFT of nbkv IMC against
    llama-cpp-python's chat handler for the pair (``VISION_HANDLERS``) and nbkv
    ``cache="off"``, both of which re-encode and re-prefill every turn.

    The text models are tiny (64 wide) and so is the text prefill: what is measured is the
    image's cost. ``kind="tiny"`` (32-px images, 2-block ViT) shows the mechanism;
    ``"realistic"`` (SigLIP-B-sized, 512-px images: seconds per encode) the speed-up a user
    sees. ``path`` is unused (each pair brings its own text model).
    """
    from .fixtures import make_mmproj, make_text_model

    n_turns = 3 if quick else 6
    out: dict[str, Any] = {"turns": n_turns, "projectors": kind, "pairs": {}, "ratios": {}}
    for family, proj in VISION_PAIRS:
        text = str(make_text_model(family, vision=proj))
        mmproj = str(make_mmproj(kind=kind, projector=proj, text_width=64))
        handler = VISION_HANDLERS.get(proj, "Llava15ChatHandler")
        runs = {v: _image_chat(_vision_runner(v, text, mmproj), kind, n_turns)
                for v in ("imc", "off", handler)}
        per: dict[str, Any] = {v: {"ttft_s_per_turn": [r["ttft"] for r in rs],
                                   "encoder_runs": sum(r["encoder_runs"] for r in rs)}
                               for v, rs in runs.items()}
        per["final_prompt_positions"] = runs["imc"][-1]["prompt"]
        name = f"{family}+{proj}"
        out["pairs"][name] = per
        final = per["imc"]["ttft_s_per_turn"][-1]
        out["ratios"][f"{name}_imc_vs_handler_final_turn_ttft"] = (
            per[handler]["ttft_s_per_turn"][-1] / final)
        out["ratios"][f"{name}_imc_vs_off_final_turn_ttft"] = (
            per["off"]["ttft_s_per_turn"][-1] / final)
    return out


def scenario_vision_families_realistic(path: str, quick: bool) -> dict[str, Any]:
    """The same with SigLIP-B-sized projectors (768 wide, 12 blocks, 512-px images)."""
    return scenario_vision_families(path, quick, kind="realistic")


class RemoteRunner:
    """nbkv's remote engine on a llama-server: ``pin`` (nbkv's policy, ``id_slot``) or not.

    Unpinned is the same client without ``id_slot``: llama-server picks the slot itself (the
    idle slot whose cached prompt is most similar, else the least recently used).
    """

    def __init__(self, url: str, pin: bool, max_tokens: int = MAX_TOKENS) -> None:
        from .remote import connect

        self.engine = connect(url)
        self.engine.clear()
        self.pin = pin
        self.max_tokens = max_tokens

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        if self.pin:
            res = self.engine.chat(messages, session=session, max_tokens=self.max_tokens,
                                   temperature=0)
            r = res.record
            return {"ttft": r.ttft_s, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                    "prefilled": r.prefilled_tokens, "server_prefill_s": r.prefill_s,
                    "slot": r.slot, "verified": r.verified, "text": res.text}
        tokens = self.engine.tokenize_prompt(messages)
        body = {"prompt": tokens, "cache_prompt": True, "stream": True, "n_cache_reuse": 0,
                "n_predict": self.max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        ttft, text, final = 0.0, "", {}
        for ev in self.engine.client.stream("/completion", body):
            if ev.get("content") and not ttft:
                ttft = time.perf_counter() - t0
            text += ev.get("content") or ""
            if ev.get("stop"):
                final = ev
        t = final.get("timings") or {}
        return {"ttft": ttft, "prompt": len(tokens), "reused": int(t.get("cache_n", 0)),
                "prefilled": int(t.get("prompt_n", 0)),
                "server_prefill_s": float(t.get("prompt_ms", 0.0)) / 1000,
                "slot": final.get("id_slot"), "verified": True, "text": text}

    def close(self) -> None:
        self.engine.close()


def scenario_remote(path: str, quick: bool) -> dict[str, Any]:
    """Four sessions interleaved on llama-server with 2 and 4 slots: nbkv pinning its slots,
    the same client leaving the choice to the server, and the in-kernel engine."""
    from .server import LlamaServer, binary

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


QUANTS = ("Q4_K_M", "Q6_K", "Q8_0")  # against the embedded Q4_1


def scenario_quants(path: str, quick: bool) -> dict[str, Any]:
    """The 12-turn chat, the 4-session interleaving and single-session decoding on SmolLM2
    re-quantized to K-quants and Q8_0, against the embedded Q4_1 in the same run.

    Every weight type prefills in its own calibrated grouping (nbkv.invariance): the extra
    tokens it costs per turn (prefilled over the minimum), first-token times against
    llama-cpp-python and the physical floor, and decode speed against ``Llama.generate``.
    Targets: each type's ratios within 5% of Q4_1's.
    """
    from .fixtures import quantized

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
    variants = {"exact": {}, "inexact": {"exact": False}, "off": None}
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


class HeadlessComm:
    """A kernel comm with no kernel: it serializes what a widget sends, as ipykernel would."""

    def __init__(self, **kw: Any) -> None:
        self.comm_id = kw.get("comm_id") or f"headless-{id(self)}"
        self.kernel = "headless"  # ipywidgets sends only through a comm that has a kernel
        self.bytes = 0

    def open(self, *a: Any, **kw: Any) -> None:
        pass

    def on_msg(self, *a: Any, **kw: Any) -> None:
        pass

    def on_close(self, *a: Any, **kw: Any) -> None:
        pass

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.bytes += len(json.dumps(data, default=str))

    def close(self, *a: Any, **kw: Any) -> None:
        pass


def scenario_dashboard(path: str, quick: bool) -> dict[str, Any]:
    """What the live dashboard costs the engine: prefill tokens/s with and without it.

    One engine (2 slots x 2048) serves requests back to back, as "Run All" does: each a new
    ~300-token prompt (its slot cleared first, so all of it is read) and an 8-token reply.
    Blocks alternate ``bare`` and ``dashboard`` (a ``CacheDashboard`` attached, its live feed
    redrawing the slot cards, KV map and timeline from the events, comm messages serialized
    as a kernel would, no browser), A B B A. Target: the dashboard costs at most 5% of
    prefill throughput.
    """
    import comm

    from .widgets import CacheDashboard

    per_block = 4 if quick else 8
    order = ["bare", "dashboard", "dashboard", "bare"] * (1 if quick else 2)
    engine = Engine(path, n_slots=2, n_ctx=2048)
    seed = iter(range(1000))
    out: dict[str, dict[str, Any]] = {v: {"prefilled": 0, "prefill_s": 0.0, "ttft": [],
                                          "renders": 0, "render_cpu_s": 0.0, "comm_bytes": 0,
                                          "wall_s": 0.0}
                                      for v in ("bare", "dashboard")}

    def block(variant: str) -> None:
        acc = out[variant]
        dash, comms, original = None, [], comm.create_comm
        if variant == "dashboard":
            comm.create_comm = lambda **kw: comms.append(HeadlessComm(**kw)) or comms[-1]
            dash = CacheDashboard(engine, interval=0.25)
        t0 = time.perf_counter()
        try:
            for _ in range(per_block):
                k = next(seed)
                engine.clear()
                msgs = [{"role": "system", "content": paragraph(k, 12)},
                        {"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
                r = engine.chat(msgs, session=f"s{k % 2}", max_tokens=8, temperature=0).record
                acc["prefilled"] += r.prefilled_tokens
                acc["prefill_s"] += r.prefill_s
                acc["ttft"].append(r.ttft_s)
            acc["wall_s"] += time.perf_counter() - t0
            if dash is not None:
                time.sleep(0.5)  # the last redraw, so that its cost is counted
                acc["renders"] += dash.feed.renders
                acc["render_cpu_s"] += dash.feed.render_cpu_s
        finally:
            if dash is not None:
                dash.close()
                comm.create_comm = original
                acc["comm_bytes"] += sum(c.bytes for c in comms)

    try:
        engine.chat([{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=0)
        for variant in order:
            block(variant)
    finally:
        engine.close()
    for acc in out.values():
        acc["prefill_tokens_per_s"] = acc["prefilled"] / acc["prefill_s"]
        acc["mean_ttft"] = mean(acc.pop("ttft"))
    ratio = out["dashboard"]["prefill_tokens_per_s"] / out["bare"]["prefill_tokens_per_s"]
    return {**out, "order": order, "requests_per_block": per_block,
            "ratios": {"dashboard_over_bare_prefill_tokens_per_s": ratio,
                       "dashboard_render_cpu_share": out["dashboard"]["render_cpu_s"]
                       / out["dashboard"]["wall_s"]}}


SCENARIOS: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "single": scenario_single,
    "interleaved": scenario_interleaved,
    "drift": scenario_drift,
    "shared-system": scenario_shared_system,
    "vision": scenario_vision,
    "vision-realistic": scenario_vision_realistic,
    "vision-families": scenario_vision_families,
    "vision-families-realistic": scenario_vision_families_realistic,
    "subagents": scenario_subagents,
    "speculative": scenario_speculative,
    "decode": scenario_decode,
    "families": scenario_families,
    "restore": scenario_restore,
    "kv-types": scenario_kv_types,
    "remote": scenario_remote,
    "quants": scenario_quants,
    "back-to-back": scenario_back_to_back,
    "dashboard": scenario_dashboard,
}

TARGETS = [
    ("single", "imc_vs_llama_cpp_ttft", ">=", 1.0),
    ("single", "imc_over_limit_ttft", "<=", 1.15),
    ("single", "imc_prefilled_over_minimum", "<=", 1.05),
    ("interleaved", "imc_vs_llama_cpp_ttft", ">=", 5.0),
    ("drift", "salvage_of_shared_prefix", ">=", 0.90),
    ("vision", "imc_vs_handler_final_turn_ttft", ">=", 10.0),
    ("vision-realistic", "imc_vs_handler_final_turn_ttft", ">=", 10.0),
    *(("vision-families-realistic", f"{f}+{p}_imc_vs_handler_final_turn_ttft", ">=", 10.0)
      for f, p in VISION_PAIRS),
    ("subagents", "batched_over_sequential_tokens_per_s", ">=", 2.0),
    ("subagents", "batched_ttft_over_single_session_ttft", "<=", 2.0),
    ("restore", "restored_over_warm_ttft", "<=", 1.5),
    ("kv-types", "q8_0_over_f16_bytes", "<=", 0.55),
    ("kv-types", "exact_variants", ">=", 2),
    ("restore", "rebuild_over_restored_ttft", ">=", 10.0),
    ("remote", "pinned_over_kernel_ttft_4_slots", "<=", 1.3),
    ("remote", "pinned_over_kernel_reused_4_slots", ">=", 1.0),
    ("back-to-back", "exact_over_inexact_ttft", "<=", 1.2),
    *(("quants", f"{q}_{k}_vs_Q4_1", "<=", 1.05)
      for q in QUANTS for k in ("imc_prefilled_over_minimum", "imc_over_limit_ttft")),
    *(("quants", f"{q}_{k}_vs_Q4_1", ">=", 0.95) for q in QUANTS
      for k in ("single_imc_vs_llama_cpp_ttft", "interleaved_imc_vs_llama_cpp_ttft",
                "exact_over_llama_decode")),
    ("dashboard", "dashboard_over_bare_prefill_tokens_per_s", ">=", 0.95),
    # prefill over the minimum, mean over turns 2+: hybrid/recurrent models go back to a
    # checkpoint, plain/SWA ones cut anywhere. The minimum as such (new message + glue), and
    # what a cache could reuse at all (replies of the random-weight models often re-tokenize
    # differently: no cache can reuse those tokens)
    *(("families", f"{f}_prefilled_over_{m}", "<=",
       1.10 if kind in ("hybrid", "recurrent") else 1.05)
      for f, kind in FAMILIES.items() for m in ("minimum", "reusable")),
]


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the issue's targets against a report."""
    out = []
    for scen, key, op, want in TARGETS:
        if scen not in report or key not in report[scen]["ratios"]:
            continue
        got = report[scen]["ratios"][key]
        ok = got >= want if op == ">=" else got <= want
        out.append({"scenario": scen, "ratio": key, "target": f"{op} {want}", "got": got,
                    "met": ok})
    if "shared-system" in report:
        got = report["shared-system"]["spc_restore_ms"]["max"]
        out.append({"scenario": "shared-system", "ratio": "spc_restore_ms_max",
                    "target": "< 10", "got": got, "met": got < 10})
    return out


def print_report(report: dict[str, Any]) -> None:
    """The tables: mean TTFT per scenario and variant, decode speeds, targets."""
    print()
    print(f"{'scenario':<14} {'variant':<10} {'mean TTFT (ms)':>15}")
    for name in SCENARIOS:
        if name not in report:
            continue
        key = next((k for k in report[name] if k.startswith("mean_ttft")), None)  # turns 2 on
        if key is None:
            continue
        for variant, v in report[name][key].items():
            print(f"{name:<14} {variant:<10} {1000 * v:>15.1f}")
    if "decode" in report:
        dec = report["decode"]
        print()
        print(f"{'decode':<14} {'variant':<10} " + " ".join(f"{s + ' tok/s':>12}"
                                                          for s in DECODE_PROMPTS))
        for variant in DECODE_VARIANTS:
            print(f"{'decode':<14} {variant:<10} " + " ".join(
                f"{dec[s][variant]['decode_tokens_per_s']:>12.1f}" for s in DECODE_PROMPTS))
    print()
    print(f"{'target':<52} {'want':>8} {'got':>9}  met")
    for t in report["targets"]:
        print(f"{t['scenario'] + ': ' + t['ratio']:<52} {t['target']:>8} {t['got']:>9.3f}  "
              f"{'yes' if t['met'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nbkv.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2-135M)")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="run only these (repeatable); default: all")
    ap.add_argument("--quick", action="store_true", help="fewer turns (a smoke run)")
    ap.add_argument("--out", default="bench-results.json", help="where to write the JSON")
    args = ap.parse_args(argv)
    path = str(args.model or default_model_path())
    report: dict[str, Any] = {"model": path, "max_tokens": MAX_TOKENS}
    for name in args.scenario or list(SCENARIOS):
        t0 = time.perf_counter()
        print(f"== {name} ...", file=sys.stderr, flush=True)
        report[name] = SCENARIOS[name](path, args.quick)
        report[name]["wall_s"] = time.perf_counter() - t0
        print(json.dumps(report[name]["ratios"], indent=1), file=sys.stderr, flush=True)
        with open(args.out, "w") as f:  # after every scenario, so a long run keeps its figures
            json.dump(report, f, indent=1)
    report["targets"] = targets(report)
    print_report(report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nJSON written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
