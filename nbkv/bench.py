"""Side-by-side benchmark: nbkv's caches against no cache and llama-cpp-python's own reuse.

``python -m nbkv.bench`` runs every scenario on the same conversations, in one process, and
prints a table plus JSON (also written to ``--out``). Timings on shared CPUs are noisy, so
the figures that matter are *ratios between variants measured in the same run*.

Variants:
  off        nbkv with cache="off": clear the slot and prefill everything, every request
  llama-cpp  llama_cpp.Llama.create_chat_completion: one sequence, longest-common-prefix reuse
  imc        nbkv Incremental Message Cache
  spc        nbkv System Prompt Cache
  limit      (single scenario) the physical floor: only the new tokens, decoded at that
             depth on a raw context with nothing else going on
  sequential / batched   (subagents) the same agents one request at a time / all at once
  guesses / copies / inexact   (speculative) exact mode with prompt-lookup guesses in the
             second decode position / with throwaway copies there / exact=False
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from . import templates
from .backend import Batch, Context, Model
from .engine import Engine
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
    """An nbkv engine in one cache mode."""

    def __init__(self, path: str, cache: str, slots: int, n_ctx: int, template: str | None = None,
                 max_tokens: int = MAX_TOKENS, **engine_kw: Any) -> None:
        self.max_tokens = max_tokens
        self.engine = Engine(path, n_slots=slots, n_ctx=n_ctx, cache=cache, template=template,
                             **engine_kw)

    def turn(self, messages: list[dict], session: str) -> dict[str, Any]:
        res = self.engine.chat(messages, session=session, max_tokens=self.max_tokens,
                               temperature=0)
        r = res.record
        return {"ttft": r.ttft_s, "prompt": r.prompt_tokens, "reused": r.reused_tokens,
                "prefilled": r.prefilled_tokens, "generated": r.generated_tokens,
                "strategy": r.strategy, "restore_s": r.restore_s, "decode_s": r.decode_s,
                "guesses": r.draft_tokens, "accepted": r.draft_accepted, "text": res.text}

    def close(self) -> None:
        self.engine.close()


class LlamaCppRunner:
    """llama-cpp-python's high-level ``Llama``: one sequence, prefix reuse built in."""

    def __init__(self, path: str, n_ctx: int, max_tokens: int = MAX_TOKENS) -> None:
        from llama_cpp import Llama

        self.max_tokens = max_tokens
        self.llm = Llama(path, n_ctx=n_ctx, n_batch=256, n_ubatch=256, verbose=False,
                         flash_attn=False)

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
            if len(chunk) == 1:  # the same two-token rule as nbkv's exact mode
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
    against one step of a single sequence (two positions each, as in exact mode), on a raw
    context at ``depth`` tokens; the best case for the tokens/s ratio is ``n * t1 / tn``."""
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
                for s in range(n):
                    batch.add(filler[s][0], depth, s, True)
                    batch.add(filler[s][1], depth + 1, s, True)
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
    """Four sub-agents with distinct system prompts, 8 turns each: batched vs. one by one."""
    import threading

    n_agents, n_turns, max_tokens = 4, (3 if quick else 8), 32
    names = ["Ada", "Brook", "Cyd", "Dale"][:n_agents]
    convs = {n: [{"role": "system", "content": system_prompt(n, 8)}] for n in names}
    tasks = {n: [f"{n}, task {t}: " + paragraph(t + len(n), 1) for t in range(n_turns)]
             for n in names}
    # one request at a time, agents taking turns
    in_turns = [(n, tasks[n][t]) for t in range(n_turns) for n in names]

    def run(mode: str) -> tuple[float, list[dict]]:
        runner = NbkvRunner(path, "imc", n_agents, 2048, max_tokens=max_tokens)
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
        runner.close()
        for r in log:  # each agent's own turn number
            r["agent_turn"] = r["turn"] // n_agents if mode == "sequential" else r["turn"]
        return wall, log

    out: dict[str, Any] = {}
    runs: dict[str, list[tuple[float, list]]] = {"sequential": [], "batched": []}
    # A B B A: timings on shared machines drift, and this order cancels a steady drift
    for mode in ("sequential", "batched", "batched", "sequential"):
        runs[mode].append(run(mode))
    depth = 0
    for mode, pairs in runs.items():
        log = [r for _, lg in pairs for r in lg]
        wall = sum(w for w, _ in pairs)
        gen = sum(r["generated"] for r in log)
        depth = max(depth, max(r["prompt"] for r in log))
        out[mode] = {
            "runs": len(pairs), "wall_s": wall, "walls_s": [w for w, _ in pairs],
            "generated_tokens": gen, "tokens_per_s": gen / wall,
            "mean_ttft_s": mean([r["ttft"] for r in log]),
            "mean_ttft_s_turns_2_on": mean([r["ttft"] for r in log if r["agent_turn"] > 0]),
            "first_turn_ttft_s": sorted(r["ttft"] for r in log if r["agent_turn"] == 0),
            "max_ttft_s": max(r["ttft"] for r in log),
            "guesses_accepted": sum(r["accepted"] for r in log),
            "guesses": sum(r["guesses"] for r in log),
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
    return {
        "agents": n_agents, "turns": n_turns, "max_tokens": max_tokens, **out,
        "mean_ttft_s": {k: v["mean_ttft_s"] for k, v in out.items()},
        "decode_step_ceiling": ceiling,
        "ratios": {
            "batched_over_sequential_tokens_per_s": bat["tokens_per_s"] / seq["tokens_per_s"],
            "decode_batching_ceiling": ceiling["tokens_per_s_ratio"],
            "batched_ttft_over_single_session_ttft": bat["mean_ttft_s"] / seq["mean_ttft_s"],
            "batched_ttft_over_single_session_ttft_turns_2_on":
                bat["mean_ttft_s_turns_2_on"] / seq["mean_ttft_s_turns_2_on"],
            "batched_vs_llama_cpp_wall":
                out["llama-cpp"]["wall_s"] / (bat["wall_s"] / bat["runs"]),
        },
    }


def scenario_speculative(path: str, quick: bool) -> dict[str, Any]:
    """Generation speed of exact mode with guesses in the second position, with throwaway
    copies there instead, and of exact=False (one position per step), on two kinds of chat:
    short open questions, and sub-agent tasks (whose replies tend to restate the task)."""
    n_turns, max_tokens = (2 if quick else 4), 48
    names = ["Ada", "Brook"]
    convs = {n: [{"role": "system", "content": system_prompt(n, 8)}] for n in names}
    styles = {"questions": lambda n, t: QUESTIONS[(t + 3 * len(n)) % len(QUESTIONS)],
              "tasks": lambda n, t: f"{n}, task {t}: " + paragraph(t + len(n), 1)}
    variants = {"guesses": {}, "copies": {"speculative": False}, "inexact": {"exact": False}}
    out: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    identical = True
    for style, user in styles.items():
        turns = [(n, user(n, t)) for n in names for t in range(n_turns)]
        res_style: dict[str, Any] = {}
        replies: dict[str, list[str]] = {}
        for variant, kw in variants.items():
            runner = NbkvRunner(path, "imc", 2, 2048, max_tokens=max_tokens, **kw)
            log = run_conversations(runner, convs, turns, None)
            runner.close()
            replies[variant] = [r["text"] for r in log]
            decoded = sum(max(r["generated"] - 1, 0) for r in log)
            res_style[variant] = {
                "decode_tokens_per_s": decoded / sum(r["decode_s"] for r in log),
                "guesses": sum(r["guesses"] for r in log),
                "guesses_accepted": sum(r["accepted"] for r in log)}
        identical = identical and replies["guesses"] == replies["copies"]
        out[style] = res_style
        g = res_style["guesses"]
        ratios[f"{style}_guess_acceptance"] = g["guesses_accepted"] / max(g["guesses"], 1)
        ratios[f"{style}_guesses_over_copies_decode"] = (
            g["decode_tokens_per_s"] / res_style["copies"]["decode_tokens_per_s"])
        ratios[f"{style}_guesses_over_inexact_decode"] = (
            g["decode_tokens_per_s"] / res_style["inexact"]["decode_tokens_per_s"])
    return {"turns": len(turns), "max_tokens": max_tokens, **out,
            "exact_replies_identical": identical, "ratios": ratios}


class LlavaRunner:
    """llama-cpp-python's multimodal chat: ``Llava15ChatHandler`` clears the KV cache and
    re-encodes every image on every turn."""

    def __init__(self, path: str, mmproj: str, n_ctx: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Llava15ChatHandler

        self.handler = Llava15ChatHandler(clip_model_path=mmproj, verbose=False)
        self.llm = Llama(path, chat_handler=self.handler, n_ctx=n_ctx, n_batch=1024,
                         n_ubatch=1024, verbose=False, flash_attn=False)
        self.turn = LlamaCppRunner.turn.__get__(self)  # same streaming TTFT measurement

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


def scenario_vision(path: str, quick: bool, kind: str = "tiny") -> dict[str, Any]:
    """An image conversation of 6 turns: nbkv IMC vs. llama-cpp's Llava15ChatHandler vs. off."""
    from .fixtures import make_mmproj
    from .media import EmbeddingCache

    projector = "mlp" if kind == "tiny" else "gemma3"
    mmproj = str(make_mmproj(kind=kind, projector=projector))
    size = 32 if kind == "tiny" else 512
    n_turns = 3 if quick else 6
    uri = _png_data_uri(7, size)
    first = {"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": uri}}]}
    followups = ["Describe its colours.", "Is it a photo?", "What is two plus two?",
                 "Back to the picture: is it bright?", "Summarize."]
    convs = {"v": [{"role": "system", "content": "You describe pictures briefly."}]}
    results: dict[str, list] = {}
    encodes: dict[str, int] = {}
    for variant in ("imc", "off", "llava-handler"):
        if variant == "llava-handler":
            runner: Any = LlavaRunner(path, mmproj, 4096)
        else:
            runner = NbkvRunner.__new__(NbkvRunner)
            runner.engine = Engine(path, n_slots=1, n_ctx=4096, cache=variant, mmproj=mmproj,
                                   n_batch=1024,
                                   embedding_cache=EmbeddingCache(0 if variant == "off" else
                                                                  256 << 20))
        hist = [dict(m) for m in convs["v"]]
        out = []
        for t in range(n_turns):
            hist.append(first if t == 0 else {"role": "user", "content": followups[t - 1]})
            if isinstance(runner, NbkvRunner):
                res = runner.engine.chat(hist, session="v", max_tokens=MAX_TOKENS, temperature=0)
                r = {"ttft": res.record.ttft_s, "encoder_runs": res.record.encoder_runs,
                     "prompt": res.record.prompt_tokens, "reused": res.record.reused_tokens,
                     "text": res.text}
            else:
                r = runner.turn(hist, "v")
                r["encoder_runs"] = 1  # the handler encodes every image of the prompt, every turn
            hist.append({"role": "assistant", "content": r["text"]})
            out.append(r)
        results[variant] = out
        encodes[variant] = sum(r["encoder_runs"] for r in out)
        runner.close()
    final = {v: rs[-1]["ttft"] for v, rs in results.items()}
    return {
        "projector": f"{kind} {projector}", "turns": n_turns,
        "first_turn_prompt_positions": results["imc"][0]["prompt"],
        "ttft_s_per_turn": {v: [r["ttft"] for r in rs] for v, rs in results.items()},
        "encoder_runs": encodes,
        "mean_ttft_s": {v: mean([r["ttft"] for r in rs[1:]]) for v, rs in results.items()},
        "ratios": {"imc_vs_handler_final_turn_ttft": final["llava-handler"] / final["imc"],
                   "imc_vs_off_final_turn_ttft": final["off"] / final["imc"]},
    }


def scenario_vision_realistic(path: str, quick: bool) -> dict[str, Any]:
    """The same with a SmolVLM-sized projector (768 wide, 12 blocks, 512-px images)."""
    return scenario_vision(path, quick, kind="realistic")


SCENARIOS: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "single": scenario_single,
    "interleaved": scenario_interleaved,
    "drift": scenario_drift,
    "shared-system": scenario_shared_system,
    "vision": scenario_vision,
    "vision-realistic": scenario_vision_realistic,
    "subagents": scenario_subagents,
    "speculative": scenario_speculative,
}

TARGETS = [
    ("single", "imc_vs_llama_cpp_ttft", ">=", 1.0),
    ("single", "imc_over_limit_ttft", "<=", 1.15),
    ("single", "imc_prefilled_over_minimum", "<=", 1.05),
    ("interleaved", "imc_vs_llama_cpp_ttft", ">=", 5.0),
    ("drift", "salvage_of_shared_prefix", ">=", 0.90),
    ("vision", "imc_vs_handler_final_turn_ttft", ">=", 10.0),
    ("vision-realistic", "imc_vs_handler_final_turn_ttft", ">=", 10.0),
    ("subagents", "batched_over_sequential_tokens_per_s", ">=", 2.0),
    ("subagents", "batched_ttft_over_single_session_ttft", "<=", 2.0),
]


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the issue's targets against a report."""
    out = []
    for scen, key, op, want in TARGETS:
        if scen not in report:
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
    print()
    print(f"{'target':<42} {'want':>8} {'got':>9}  met")
    for t in report["targets"]:
        print(f"{t['scenario'] + ': ' + t['ratio']:<42} {t['target']:>8} {t['got']:>9.3f}  "
              f"{'yes' if t['met'] else 'NO'}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nJSON written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
