"""More conversations than slots: parking against the alternatives (issue 23)."""

from __future__ import annotations

import os
import re
import statistics
import sys
from typing import Any

from nbkv.bench.conversations import TOPICS, mean, paragraph
from nbkv.bench.registry import scenario
from nbkv.bench.runners import (
    MAX_TOKENS,
    LimitRunner,
    LlamaCacheRunner,
    NbkvRunner,
    RemoteRunner,
)
from nbkv.kv.policy import common_prefix

NAMES = ["Ada", "Brook", "Cyd", "Dale", "Eve", "Finn"]


def own_system(i: int, sentences: int) -> str:
    """Session ``i``'s system prompt: its own text from the first sentence on (~25 tokens a
    sentence), so that no two sessions share more than the template's opening."""
    return (f"You are {NAMES[i]}, the assistant of the {TOPICS[(5 * i) % len(TOPICS)]} desk. "
            + paragraph(100 + 13 * i, sentences))


def _later(rs: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return rs[n:]


def _figures(rs: list[dict[str, Any]], park_inside: bool) -> dict[str, Any]:
    """Later-round figures of one variant: first-token time, reuse, restores and parks.

    ``park_inside``: the record's ``restore_s`` includes parking the slot's conversation
    (nbkv: ``park_s`` of it). nbkv's restore proper is the record's ``unpark_s`` (the entry
    taken from the lot, its state written into the slot and checked); its ``restore_s``
    also holds the admission around it (matching, trimming), reported beside it.
    """
    restores = [r for r in rs if r.get("restored_from") and "restore_s" in r]
    took = [r["unpark_s"] if "unpark_s" in r else
            r["restore_s"] - (r["park_s"] if park_inside else 0.0) for r in restores]
    per_1k = [1e6 * s / r["restored_tokens"] for s, r in zip(took, restores)
              if r.get("restored_tokens")]
    admission = [1e6 * (r["restore_s"] - (r["park_s"] if park_inside else 0.0))
                 / r["restored_tokens"] for r in restores if r.get("restored_tokens")]
    with_park = [1e6 * r["restore_s"] / r["restored_tokens"] for r in restores
                 if r.get("restored_tokens")]
    parks = [r["park_s"] for r in rs  # nbkv: when the evicted conversation was parked
             if (r.get("evicted_parked") if "evicted_parked" in r else r.get("park_s"))]
    return {
        "mean_ttft_s": mean([r["ttft"] for r in rs]),
        "reuse_pct": 100.0 * sum(r.get("reused", 0) for r in rs) / max(
            sum(r.get("prompt", 0) for r in rs), 1),
        "restores": sum(1 for r in rs if r.get("restored_from")),
        "mean_restored_tokens": mean([r["restored_tokens"] for r in restores
                                      if r.get("restored_tokens")]),
        "restore_ms_per_1k_tokens": {"mean": mean(per_1k), "max": max(per_1k, default=0.0),
                                     "median": statistics.median(per_1k) if per_1k else 0.0},
        # the restore and the admission around it (restore_s less the park)
        "admission_ms_per_1k_tokens": {"mean": mean(admission),
                                       "max": max(admission, default=0.0)},
        # nbkv: the record's restore_s as it is, the park of the slot's conversation included
        "restore_s_ms_per_1k_tokens": {"mean": mean(with_park),
                                       "max": max(with_park, default=0.0)},
        "mean_restore_ms": 1000 * mean(took),
        "parks": len(parks),
        "park_ms": {"mean": 1000 * mean(parks), "max": 1000 * max(parks, default=0.0)},
    }


def _server_cache_ms(log_path: str) -> list[float]:
    """llama-server's own time for each prompt cache update (save the slot's prompt, load
    the best cached one), from its trace log (``-lv 4``)."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    return [float(m) for m in re.findall(r"prompt cache update took ([0-9.]+) ms", text)]


def _spread(xs: list[float]) -> dict[str, float]:
    """Min, median and max of per-turn ratios (nan when there are none)."""
    if not xs:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan"), "n": 0}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


@scenario("thrash")
def scenario_thrash(path: str, quick: bool) -> dict[str, Any]:
    """Six sessions with their own system prompts on two slots, round-robin.

    Variants, played in lockstep (turn by turn, the order rotating, so that all see the
    same machine): nbkv with parking (default), with 6 slots (nothing leaves a slot),
    llama-server with ``--cache-ram`` pinned by ``nbkv.connect``, and the physical floor
    (``limit``: only the tokens that the session's previous prompt and reply did not hold,
    decoded on a raw context that holds the rest). The full run adds nbkv without parking
    (``park_ram=0``) and llama-cpp-python's ``Llama`` with ``LlamaRAMCache``. Every variant
    gets the same conversation (the parking engine's replies). ``quick``: shorter system
    prompts and replies, the same 6 sessions on 2 slots, 3 rounds (2 measured).
    """
    from nbkv.store.parking import default_ram_budget

    rounds, sentences, max_tokens = (3, 4, 8) if quick else (3, 9, MAX_TOKENS)
    n, n_ctx = len(NAMES), 2048
    hist = {s: [{"role": "system", "content": own_system(i, sentences)}]
            for i, s in enumerate(NAMES)}
    turns = [(s, paragraph(1000 + r * n + i, 1)) for r in range(rounds)
             for i, s in enumerate(NAMES)]
    budget = default_ram_budget()
    runners: dict[str, Any] = {}
    servers: list[Any] = []  # the llama-server, where there is one
    server_ms: list[float] = []
    limit: LimitRunner | None = None
    out: dict[str, Any] = {"sessions": n, "slots": 2, "rounds": rounds,
                           "max_tokens": max_tokens, "park_ram_budget": budget}
    try:
        _start_runners(runners, servers, out, path, quick, n_ctx, max_tokens, budget)
        limit = LimitRunner(path, n_ctx)
        results = _play(runners, limit, hist, turns)
        # after the run: what is parked, against llama.cpp's own KV per token
        eng = runners["parking"].engine
        parked = eng.parked()
        verified = eng.verify()
        kv_per_token = eng.plan.kv_bytes_per_token
        llama_tokens, llama_state_bytes, llama_bytes = _llama_ram_cache(runners)
    finally:
        for runner in runners.values():
            runner.close()
        if limit is not None:
            limit.close()
        for server in servers:  # its log is read before the stop removes it
            server_ms = _server_cache_ms(server.log_path)
            server.stop()
    figures = {v: _figures(_later(rs, n), v != "llama-ram") for v, rs in results.items()}
    if servers:
        figures["server-ram"]["server_cache_update_ms"] = {
            "n": len(server_ms), "mean": mean(server_ms), "max": max(server_ms, default=0.0)}
    parked_tokens = sum(p.n_tokens for p in parked)
    parked_bytes = sum(p.nbytes for p in parked)
    out.update(_per_turn(results, figures, n))
    out.update({
        "verify_parking_engine": [v.identical for v in verified],
        "parked": {"entries": len(parked), "tokens": parked_tokens, "bytes": parked_bytes,
                   "bytes_per_token": parked_bytes / max(parked_tokens, 1),
                   "llama_cpp_kv_bytes_per_token": kv_per_token,
                   "llama_ram_cache_state_bytes_per_token": llama_state_bytes / max(
                       llama_tokens, 1),
                   "llama_ram_cache_bytes_per_token": llama_bytes / max(llama_tokens, 1)},
    })
    _ratios(out, figures, {v: rs[n:] for v, rs in results.items()}, kv_per_token)
    return out


def _start_runners(runners: dict[str, Any], servers: list[Any], out: dict[str, Any],
                   path: str, quick: bool, n_ctx: int, max_tokens: int, budget: int) -> None:
    """Open the variants into ``runners``, and the llama-server into ``servers``.

    Filled in place, so that what opened before a failure is still closed.
    """
    from nbkv.remote.server import LlamaServer, binary

    runners["parking"] = NbkvRunner(path, "imc", 2, n_ctx, max_tokens=max_tokens)
    if not quick:
        runners["no-parking"] = NbkvRunner(path, "imc", 2, n_ctx, max_tokens=max_tokens,
                                           park_ram=0)
    runners["6-slots"] = NbkvRunner(path, "imc", len(NAMES), n_ctx, max_tokens=max_tokens)
    if binary() is not None:
        server = LlamaServer(path, slots=2, ctx=n_ctx, threads=os.cpu_count(), batch=256,
                             ubatch=256, flash_attn="off", cache_ram=budget >> 20,
                             extra=("-lv", "4")).start()
        servers.append(server)
        assert server.argv[server.argv.index("--cache-ram") + 1] == str(budget >> 20)
        runners["server-ram"] = RemoteRunner(server.url, True, max_tokens)
    else:
        out["server_skipped"] = "no llama-server binary: run `make llama-server`"
    if not quick:
        runners["llama-ram"] = LlamaCacheRunner(path, n_ctx, budget, max_tokens)


def _play(runners: dict[str, Any], limit: LimitRunner, hist: dict[str, list[dict]],
          turns: list[tuple[str, str]]) -> dict[str, list[dict[str, Any]]]:
    """Every turn on every variant, in lockstep: each variant's records, turn by turn.

    The order of the variants rotates from turn to turn; every session carries on with the
    parking engine's reply. ``limit`` decodes only what the session's KV did not hold.
    """
    names = [*runners, "limit"]
    held: dict[str, list[int]] = {s: [] for s in NAMES}
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
    for i, (session, text) in enumerate(turns):
        msgs = hist[session]
        msgs.append({"role": "user", "content": text})
        prompt = runners["parking"].engine.tokenize_prompt(msgs)
        new = len(prompt) - common_prefix(held[session], prompt)
        for v in names[i % len(names):] + names[: i % len(names)]:
            r: dict[str, Any]
            if v == "limit":
                r = {"ttft": limit.turn(prompt, new), "prompt": len(prompt),
                     "reused": len(prompt) - new}
            else:
                r = runners[v].turn(msgs, session)
            r.update(session=session, turn=i)
            results[v].append(r)
        reply = results["parking"][i]["text"]
        held[session] = prompt + runners["parking"].engine.model.tokenize(reply)
        msgs.append({"role": "assistant", "content": reply})
        print(f"thrash turn {i + 1}/{len(turns)} {session}: " + " ".join(
            f"{v} {1000 * results[v][i]['ttft']:.0f}" for v in names) + " ms",
            file=sys.stderr, flush=True)
    return results


def _llama_ram_cache(runners: dict[str, Any]) -> tuple[int, int, int]:
    """What ``LlamaRAMCache`` holds (zeros without it): tokens, state bytes, and all bytes."""
    if "llama-ram" not in runners:
        return 0, 0, 0
    states = runners["llama-ram"].cache.cache_state  # tokens -> LlamaState
    tokens = sum(len(k) for k in states)
    state_bytes = sum(s.llama_state_size for s in states.values())
    # what the cache holds in RAM besides: each entry's copy of Llama's logits array
    return tokens, state_bytes, state_bytes + sum(s.scores.nbytes + s.input_ids.nbytes
                                                  for s in states.values())


def _per_turn(results: dict[str, list[dict[str, Any]]], figures: dict[str, Any],
              n: int) -> dict[str, Any]:
    """The report's per-turn lists, and whether every variant replied as the parking one."""
    ref = [r["text"] for r in results["parking"]]
    replied = {v: rs for v, rs in results.items() if v != "limit"}  # the floor only times
    return {
        "system_prompt_tokens": [results["parking"][i]["prompt"] for i in range(n)],
        "final_prompt_tokens": [r["prompt"] for r in results["parking"][-n:]],
        "mean_ttft_s_rounds_2_on": {v: f["mean_ttft_s"] for v, f in figures.items()},
        "variants": figures,
        "strategies_parking": [r["strategy"] for r in results["parking"]],
        "restored_per_turn": {v: [r.get("restored_from", "") for r in rs]
                              for v, rs in results.items()},
        "reused_per_turn": {v: [r.get("reused", 0) for r in rs] for v, rs in results.items()},
        "ttft_ms_per_turn": {v: [round(1000 * r["ttft"], 1) for r in rs]
                             for v, rs in results.items()},
        "replies_equal_parking": {v: [r["text"] for r in rs] == ref
                                  for v, rs in replied.items()},
        "replies_differ_at_turns": {v: [i for i, r in enumerate(rs) if r["text"] != ref[i]]
                                    for v, rs in replied.items()},
    }


def _ratios(out: dict[str, Any], f: dict[str, Any], later: dict[str, list[dict[str, Any]]],
            kv_per_token: float) -> None:
    """The headline ratios of the later rounds, and their spread over the turns."""

    def per_turn(a: str, b: str) -> dict[str, float]:
        return _spread([x["ttft"] / y["ttft"] for x, y in zip(later[a], later[b])])

    park = f["parking"]
    ratios = {
        "parking_over_6_slots_ttft": park["mean_ttft_s"] / f["6-slots"]["mean_ttft_s"],
        "parking_over_limit_ttft": park["mean_ttft_s"] / f["limit"]["mean_ttft_s"],
        "6_slots_over_limit_ttft": f["6-slots"]["mean_ttft_s"] / f["limit"]["mean_ttft_s"],
        "reuse_points_below_6_slots": f["6-slots"]["reuse_pct"] - park["reuse_pct"],
        "restore_ms_per_1k_tokens_max": park["restore_ms_per_1k_tokens"]["max"],
        "restore_ms_per_1k_tokens_mean": park["restore_ms_per_1k_tokens"]["mean"],
        "restore_admission_ms_per_1k_tokens_mean": park["admission_ms_per_1k_tokens"]["mean"],
        "restore_admission_ms_per_1k_tokens_max": park["admission_ms_per_1k_tokens"]["max"],
        "restore_s_with_park_ms_per_1k_tokens_mean":
            park["restore_s_ms_per_1k_tokens"]["mean"],
        "parked_over_kv_bytes_per_token": out["parked"]["bytes_per_token"] / kv_per_token,
    }
    spreads = {"parking_over_6_slots_ttft": per_turn("parking", "6-slots"),
               "parking_over_limit_ttft": per_turn("parking", "limit")}
    for v, key in (("no-parking", "no_parking_over_parking_ttft"),
                   ("llama-ram", "llama_ram_over_parking_ttft"),
                   ("server-ram", "server_ram_over_parking_ttft")):
        if v in f:
            ratios[key] = f[v]["mean_ttft_s"] / park["mean_ttft_s"]
            spreads[key] = per_turn(v, "parking")
    if "server-ram" in f:
        out["parking_faster_than_server_ram_turns"] = sum(
            a["ttft"] < b["ttft"] for a, b in zip(later["parking"], later["server-ram"]))
    out["ratios"] = ratios
    out["per_turn_ratio_spread"] = spreads
