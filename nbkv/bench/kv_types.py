"""f16 against q8_0 KV: bytes, speed and exactness side by side."""

from __future__ import annotations

from typing import Any

from nbkv.bench.conversations import mean, paragraph, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import NbkvRunner


@scenario("kv-types")
def scenario_kv_types(path: str, quick: bool) -> dict[str, Any]:
    """f16 against q8_0 KV (with the flash attention a quantized V needs), side by side.

    Each variant chats the same 12-turn conversation in lockstep; reported: bytes per slot
    (planned and allocated), prefill and decode rates, first-token times, and the exactness
    check (the final reply equals a from-scratch one with the same settings, and the slot's
    probe logits equal a from-scratch decode's).
    """
    import numpy as np

    from nbkv.kv.oracle import scratch_logits
    from nbkv.llama.hardware import kv_type_id

    n_turns = 6 if quick else 12
    variants: dict[str, dict[str, Any]] = {
        "f16": dict(type_k="f16", type_v="f16", flash_attn="off"),
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
