"""Prefill against the minimum on every memory class (plain, sliding-window, hybrid,
recurrent)."""

from __future__ import annotations

from typing import Any

from nbkv.bench.conversations import four_sessions, mean, paragraph, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import MAX_TOKENS, NbkvRunner
from nbkv.kv.policy import common_prefix
from nbkv.llama.models import default_model_path

FAMILIES = {"smollm2": "plain", "gemma3": "sliding-window", "lfm2": "hybrid",
            "mamba2": "recurrent", "granitehybrid": "hybrid"}


def family_model(family: str) -> str:
    """The embedded SmolLM2, or a tiny generated model of ``family`` with its tokenizer."""
    if family == "smollm2":
        return str(default_model_path())
    from nbkv.fixtures import make_text_model

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


@scenario("families")
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
    inter_convs, inter_turns = four_sessions(rounds)
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
