"""Text chat scenarios: one long chat, interleaved sessions, a drifting template, a shared
system prompt."""

from __future__ import annotations

import datetime
from typing import Any

from nbkv.bench.conversations import (
    NAMES,
    baselines,
    four_sessions,
    mean,
    paragraph,
    played,
    system_prompt,
)
from nbkv.bench.registry import scenario
from nbkv.bench.runners import LimitRunner, LlamaCppRunner, NbkvRunner
from nbkv.engine.facade import Engine
from nbkv.kv.policy import common_prefix
from nbkv.prompt import templates


@scenario("single")
def scenario_single(path: str, quick: bool) -> dict[str, Any]:
    """One conversation of 12 turns growing past 2,000 tokens.

    nbkv (IMC, exact, the reply settled after each turn as a user reading lets it be),
    llama-cpp-python's ``Llama`` and the physical floor take each turn side by side; cache
    off and SPC play the conversation afterwards.
    """
    n_turns = 6 if quick else 12
    convs = {"solo": [{"role": "system", "content": system_prompt("Ada", 6)}]}
    turns = [("solo", paragraph(t, 6)) for t in range(n_turns)]
    imc = NbkvRunner(path, "imc", 1, 4096)
    limit = LimitRunner(path, 4096)
    llama = LlamaCppRunner(path, 4096)
    # imc, llama-cpp-python's Llama and the physical floor run in lockstep, turn by turn (in
    # A B C, C B A order on alternate turns), so that all see the same machine load; the
    # floor decodes only the minimum: every token that the previous prompt and the reply to
    # it did not already hold. Llama gets the same conversation (nbkv's replies).
    hist = [dict(m) for m in convs["solo"]]
    base, floor, alike, minimum = [], [], [], []
    held: list[int] = []
    for i, (_, text) in enumerate(turns):
        hist.append({"role": "user", "content": text})
        prompt = imc.engine.tokenize_prompt(hist)
        new = len(prompt) - common_prefix(held, prompt)
        order = ["imc", "llama", "limit"]
        got: dict[str, Any] = {}
        for name in order if i % 2 == 0 else order[::-1]:
            if name == "imc":
                got[name] = imc.turn(hist, "solo")
            elif name == "llama":
                got[name] = llama.turn(hist, "solo")
            else:
                got[name] = {"ttft": limit.turn(prompt, new), "prefilled": new}
        r = got["imc"]
        r.update(session="solo", turn=i)
        floor.append(got["limit"])
        alike.append(got["llama"])
        base.append(r)
        minimum.append(new)
        held = prompt + imc.engine.model.tokenize(r["text"])
        hist.append({"role": "assistant", "content": r["text"]})
    imc.close()
    limit.close()
    llama.close()
    replies = [r["text"] for r in base]
    results: dict[str, list] = {"imc": base, "limit": floor, "llama-cpp": alike}
    results.update(baselines(path, 1, 4096, convs, turns, replies, llama=False))
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


@scenario("interleaved")
def scenario_interleaved(path: str, quick: bool) -> dict[str, Any]:
    """Four sessions with distinct system prompts, round-robin, on four slots."""
    rounds = 2 if quick else 4
    convs, turns = four_sessions(rounds)
    base = played(NbkvRunner(path, "imc", 4, 2048), convs, turns, None)
    replies = [r["text"] for r in base]
    results: dict[str, list] = {"imc": base}
    results.update(baselines(path, 4, 2048, convs, turns, replies))
    later = slice(len(NAMES), None)
    summary = {v: mean([r["ttft"] for r in rs[later]]) for v, rs in results.items()}
    return {
        "sessions": len(NAMES), "rounds": rounds,
        "mean_prompt_tokens": mean([r["prompt"] for r in base]),
        "mean_ttft_s_rounds_2_on": summary,
        "ratios": {"imc_vs_llama_cpp_ttft": summary["llama-cpp"] / summary["imc"],
                   "imc_vs_off_ttft": summary["off"] / summary["imc"]},
    }


@scenario("drift")
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
            results[variant] = played(runner, convs, turns, replies)
            replies = [r["text"] for r in results["imc"]]
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


@scenario("shared-system")
def scenario_shared_system(path: str, quick: bool) -> dict[str, Any]:
    """A 1,000-token system prompt shared by many short one-turn chats."""
    n_chats = 4 if quick else 8
    sys_text = system_prompt("Sam", 43)  # ~1,000 tokens
    convs = {f"u{i}": [{"role": "system", "content": sys_text}] for i in range(n_chats)}
    turns = [(f"u{i}", paragraph(i, 1)) for i in range(n_chats)]
    results: dict[str, list] = {}
    spc = NbkvRunner(path, "spc", 2, 2048)
    sys_tokens = len(spc.engine.tokenize_prompt(convs["u0"])) - 3
    results["spc"] = played(spc, convs, turns, None)
    for name in ("imc", "off"):
        results[name] = played(NbkvRunner(path, name, 2, 2048), convs, turns, None)
    results["llama-cpp"] = played(LlamaCppRunner(path, 2048), convs, turns, None)
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
