"""What exactness costs on a realistic model, the engine's fixed cost, and the GPU's one shape.

``realistic``: a 1.5B-shaped Q4_K_M (generated weights: :mod:`nbkv.fixtures.realistic`),
turns back to back, exact against ``exact=False`` (the lean path), a second turn's first
token against llama-cpp-python's ``Llama``, and host time per request at 4 slots and 4k
context (:mod:`nbkv.core.events`). ``fixed-shape``: every decode padded to one row count
(``fixed_rows``), on whatever backend runs it: does calibration prove exactness then, and
what does the first token cost against the unpadded engine, cache off and ``Llama``.
"""

from __future__ import annotations

from typing import Any

from nbkv.bench.conversations import (
    NAMES,
    four_sessions,
    mean,
    played,
    run_conversations,
    system_prompt,
)
from nbkv.bench.registry import scenario
from nbkv.bench.runners import LlamaCppRunner, NbkvRunner

#: the fixed row counts the fixed-shape scenario tries (0: unpadded)
FIXED_ROWS = (0, 16, 128)


def _costs(runner: NbkvRunner, before: dict[str, Any], requests: int) -> dict[str, Any]:
    """Per request since ``before``: decode calls, rows, host time by part, bytes moved.

    Host time is the requests' own (see :mod:`nbkv.core.events`), as wall time and as the
    scheduler thread's CPU time (``host_cpu_s``: without waits for the interpreter's lock or
    a core); idle-time work, such as a reply's rewrite or a park's copy made ahead, is
    reported beside it (``idle_host_s_by_part``).
    """
    now = runner.engine.counters()
    n = max(requests, 1)
    host = {k: (v - before["host_s"].get(k, 0.0)) / n for k, v in now["host_s"].items()}
    idle = {k: (v - before["idle_host_s"].get(k, 0.0)) / n
            for k, v in now["idle_host_s"].items()}  # no request waited for it
    return {"path": now["path"],
            "decode_calls": (now["decode_calls"] - before["decode_calls"]) / n,
            "rows": (now["rows"] - before["rows"]) / n,
            "padded_rows": (now["padded_rows"] - before["padded_rows"]) / n,
            "bytes_moved": (now["bytes_moved"] - before["bytes_moved"]) / n,
            "host_s_by_part": host, "host_s": sum(host.values()),
            "host_cpu_s": (now["host_cpu_s"] - before["host_cpu_s"]) / n,
            "idle_host_s_by_part": idle}


def _agent(path: str, n_turns: int, **kw: Any) -> tuple[list[dict], dict[str, Any]]:
    """An agent loop on one slot, the next request sent as a reply ends; its costs."""
    runner = NbkvRunner(path, "imc", 1, 4096, settle=False, max_tokens=16, **kw)
    before = runner.engine.counters()
    msgs = [{"role": "system", "content": system_prompt("Agent", 12)}]
    log = []
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"Step {t}: name one file to check next."})
        r = runner.turn(msgs, "agent")
        msgs.append({"role": "assistant", "content": r["text"]})
        log.append(r)
    costs = _costs(runner, before, n_turns)
    runner.close()
    return log, costs


def _four_slots(path: str, rounds: int) -> dict[str, Any]:
    """Four sessions round-robin on 4 slots of 4k: mean host time and counts per request."""
    convs, turns = four_sessions(rounds)
    out = {}
    variants: tuple[tuple[str, dict[str, Any]], ...] = (("exact", {}),
                                                        ("lean", {"exact": False}))
    for name, kw in variants:
        runner = NbkvRunner(path, "imc", 4, 4096, max_tokens=8, **kw)
        before = runner.engine.counters()
        recs = run_conversations(runner, convs, turns, None)
        out[name] = {**_costs(runner, before, len(recs)),
                     "mean_ttft_s": mean([r["ttft"] for r in recs[len(NAMES):]])}
        runner.close()
    return out


def _host_floor(path: str, steps: int = 24) -> float:
    """The least host time a Python-driven decode step takes on ``path``, in seconds.

    A bare loop over llama.cpp: one token a decode, picked by the graph's greedy sampler,
    timed outside ``llama_decode`` (median of ``steps``). Every step of any engine driven
    from Python pays it: the first code after a decode runs with caches the model's
    weights have just passed through.
    """
    import time

    from nbkv.llama.backend import Context, Model
    from nbkv.llama.tokens import Batch

    model = Model(path)
    ctx = Context(model, 1024, 1, n_batch=256)
    batch = Batch(256)
    try:
        ctx.sampling.use([0])
        prompt = model.tokenize(system_prompt("Floor", 2))[:200]
        batch.add_run(prompt, 0, 0, True)
        ctx.decode(batch)
        tok, pos, hosts = ctx.sampling.token(batch.n - 1), len(prompt), []
        for _ in range(steps):
            t0, in_llama = time.perf_counter(), ctx.counters.llama_s
            batch.clear()
            batch.add(tok, pos, 0, True)
            ctx.decode(batch)
            tok, pos = ctx.sampling.token(0), pos + 1
            hosts.append(time.perf_counter() - t0 - (ctx.counters.llama_s - in_llama))
    finally:
        batch.close()
        ctx.close()
        model.close()
    return sorted(hosts)[len(hosts) // 2]


@scenario("realistic")
def scenario_realistic(path: str, quick: bool) -> dict[str, Any]:
    """A 1.5B-shaped Q4_K_M (generated; ``path`` is not used): what exactness costs there.

    Back to back (an agent loop, one slot): exact against ``exact=False`` (target: exact
    <= 1.3x), replies compared; a second turn's first token against ``Llama``; four
    sessions on 4 slots of 4k context: host time per request (target: <= 2 ms) beside its
    floor (:func:`_host_floor` times the request's decode calls), decode calls and rows per
    request on both paths.
    """
    from nbkv.fixtures.realistic import realistic_model

    model = str(realistic_model())
    n_turns = 3 if quick else 6
    logs: dict[str, list[list[dict]]] = {}
    costs: dict[str, dict[str, Any]] = {}
    for name, kw in (("exact", {}), ("inexact", {"exact": False}), ("exact", {}),
                     ("inexact", {"exact": False})):  # A B A B: both see the same load
        log, cost = _agent(model, n_turns, **kw)
        logs.setdefault(name, []).append(log)
        costs[name] = cost
    ttft = {v: mean([r["ttft"] for log in ls for r in log[1:]]) for v, ls in logs.items()}
    llama = LlamaCppRunner(model, 4096, max_tokens=16)
    msgs = [{"role": "system", "content": system_prompt("Agent", 12)}]
    first = logs["exact"][0]
    second_llama = []
    for t in range(2):
        msgs.append({"role": "user", "content": f"Step {t}: name one file to check next."})
        r = llama.turn(msgs, "agent")
        msgs.append({"role": "assistant", "content": first[t]["text"]})
        second_llama.append(r["ttft"])
    llama.close()
    slots4 = _four_slots(model, 2 if quick else 3)
    floor = _host_floor(model)
    for cost in slots4.values():  # the same decodes in a bare loop
        cost["host_floor_s"] = floor * cost["decode_calls"]
    return {
        "model": model.rsplit("/", 1)[-1], "turns": n_turns,
        "mean_ttft_s_turns_2_on": ttft, "costs_per_request": costs,
        "second_turn_ttft_s": {"exact": first[1]["ttft"], "llama-cpp": second_llama[1]},
        "replies_identical": [r["text"] for r in logs["exact"][0]]
        == [r["text"] for r in logs["inexact"][0]],
        "four_slots_4k": slots4,
        "ratios": {"exact_over_inexact_ttft": ttft["exact"] / ttft["inexact"],
                   "llama_over_exact_second_turn": second_llama[1] / first[1]["ttft"],
                   "host_ms_per_request_exact": 1e3 * slots4["exact"]["host_s"],
                   "host_ms_per_request_lean": 1e3 * slots4["lean"]["host_s"],
                   "host_cpu_ms_per_request_exact": 1e3 * slots4["exact"]["host_cpu_s"],
                   "host_cpu_ms_per_request_lean": 1e3 * slots4["lean"]["host_cpu_s"],
                   "host_floor_ms_per_request_exact": 1e3 * slots4["exact"]["host_floor_s"],
                   "host_floor_ms_per_request_lean": 1e3 * slots4["lean"]["host_floor_s"]},
    }


@scenario("fixed-shape")
def scenario_fixed_shape(path: str, quick: bool) -> dict[str, Any]:
    """Every decode padded to one row count (``fixed_rows``), against the unpadded engine.

    For each row count: whether calibration proves the engine exact in that shape, the
    interleaved scenario's IMC first token (rounds 2+), and for the unpadded engine cache
    off and ``Llama`` on the same conversations (target on a GPU: IMC never slower).
    """
    rounds = 2 if quick else 3
    convs, turns = four_sessions(rounds)
    later = slice(len(NAMES), None)
    out: dict[str, Any] = {}
    replies = None
    for rows in FIXED_ROWS:
        runner = NbkvRunner(path, "imc", 4, 2048, fixed_rows=rows)
        before = runner.engine.counters()
        recs = run_conversations(runner, convs, turns, replies)
        replies = replies or [r["text"] for r in recs]
        out[f"rows_{rows}"] = {"exact": runner.engine.prefill_rule.exact,
                               "rule": runner.engine.model.exactness,
                               "mean_ttft_s": mean([r["ttft"] for r in recs[later]]),
                               **_costs(runner, before, len(recs))}
        runner.close()
    for name, make in (("off", lambda: NbkvRunner(path, "off", 4, 2048)),
                       ("llama-cpp", lambda: LlamaCppRunner(path, 2048))):
        recs = played(make(), convs, turns, replies)
        out[name] = {"mean_ttft_s": mean([x["ttft"] for x in recs[later]])}
    base = out["rows_0"]["mean_ttft_s"]
    out["ratios"] = {**{f"rows_{n}_over_unpadded_ttft": out[f"rows_{n}"]["mean_ttft_s"] / base
                        for n in FIXED_ROWS if n},
                     "off_over_imc_ttft": out["off"]["mean_ttft_s"] / base,
                     "llama_over_imc_ttft": out["llama-cpp"]["mean_ttft_s"] / base}
    return out
