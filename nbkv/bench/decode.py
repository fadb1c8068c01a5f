"""Generation speed: exact, speculative guesses, inexact, and plain llama.cpp decoding."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from nbkv.bench.conversations import (
    QUESTIONS,
    mean,
    mirrored,
    paragraph,
    run_conversations,
    system_prompt,
)
from nbkv.bench.registry import scenario
from nbkv.bench.runners import LlamaDecodeRunner, NbkvRunner


def _decode_rate(log: list[dict]) -> float:
    """Generated tokens per second after each reply's first token (as RequestRecord.decode_tps)."""
    decoded = sum(max(r["generated"] - 1, 0) for r in log)
    seconds = sum(r["decode_s"] for r in log)
    return decoded / seconds if seconds > 0 else float("nan")


@scenario("speculative")
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
    variants: dict[str, dict[str, Any]] = {
        "plain": {}, "guesses": {"speculative": True}, "inexact": {"exact": False}}
    out: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    deterministic, same_as_plain = True, {}
    pays_off = {}
    for style, user in styles.items():
        turns = [(n, user(n, t)) for n in names for t in range(n_turns)]
        res_style: dict[str, Any] = {}
        logs: dict[str, list[list[dict]]] = {v: [] for v in variants}
        for variant in mirrored(variants):
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
DECODE_VARIANTS: dict[str, dict[str, Any] | None] = {
    "exact": {}, "guesses": {"speculative": True}, "inexact": {"exact": False}, "llama": None}
#: the second turn's reply length (it measures that turn's first-token time)
DECODE_TURN2 = 16


@scenario("decode")
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
    threads = os.cpu_count() or 1
    names = list(DECODE_VARIANTS)
    styles: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    variants = _DecodeBench(path, n_gen, threads)
    try:
        variants.warm_up()
        for style, question in DECODE_PROMPTS.items():
            msgs = [{"role": "user", "content": question}]
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for name in mirrored(names):
                runs[name].append(variants.run(name, msgs))
            # the second turn from scratch (plain llama.cpp, nothing reused): exact mode's
            # cached second turn must equal it; inexact's reuses token-by-token KV
            scratch2 = variants.scratch_turn2(msgs, runs["exact"][0]["text"])
            styles[style] = _decode_style(runs, len(variants.tokenize(msgs)), scratch2)
            ratios.update(_decode_ratios(style, styles[style]))
        for key in ("exact_over_inexact_decode", "exact_over_llama_decode",
                    "guesses_over_exact_decode", "exact_over_inexact_turn2_ttft"):
            ratios[key] = statistics.fmean(ratios[f"{s}_{key}"] for s in DECODE_PROMPTS)
    finally:
        variants.close()
    return {"max_tokens": n_gen, "turn2_max_tokens": DECODE_TURN2, "n_threads": threads,
            **styles,
            "decode_tokens_per_s": {f"{s}/{n}": styles[s][n]["decode_tokens_per_s"]
                                    for s in DECODE_PROMPTS for n in names},
            "replies_identical": all(styles[s]["replies_identical"]["exact_inexact_llama"]
                                     for s in DECODE_PROMPTS),
            "ratios": ratios}


class _DecodeBench:
    """The decode scenario's variants: one nbkv engine per setting, and a plain ``Llama``."""

    def __init__(self, path: str, n_gen: int, threads: int) -> None:
        self.n_gen = n_gen
        self.engines = {v: NbkvRunner(path, "imc", 1, 2048, max_tokens=n_gen,
                                      n_threads=threads, **kw)
                        for v, kw in DECODE_VARIANTS.items() if kw is not None}
        self.llama = LlamaDecodeRunner(path, 2048, threads)
        self.tokenize = self.engines["exact"].engine.tokenize_prompt

    def warm_up(self) -> None:
        """First decodes allocate: one short reply on each, not timed."""
        warm = [{"role": "user", "content": "Hello!"}]
        for runner in self.engines.values():
            runner.engine.chat(warm, max_tokens=4, temperature=0)
            runner.engine.settle()
        self.llama.reply(self.tokenize(warm), 4)

    def run(self, name: str, msgs: list[dict]) -> dict[str, Any]:
        """One measured reply and its second turn on variant ``name``."""
        return self._llama(msgs) if name == "llama" else self._nbkv(self.engines[name], msgs)

    def _nbkv(self, runner: NbkvRunner, msgs: list[dict]) -> dict[str, Any]:
        eng = runner.engine
        eng.clear()
        res = eng.chat(msgs, session="d", max_tokens=self.n_gen, temperature=0)
        rec = res.record
        t0 = time.perf_counter()
        eng.settle()
        settle_s = time.perf_counter() - t0
        rewrite = [e for e in runner.rewrites if e.request_id == rec.id]
        follow = [*msgs, res.message, {"role": "user", "content": DECODE_FOLLOWUP}]
        res2 = eng.chat(follow, session="d", max_tokens=DECODE_TURN2, temperature=0)
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

    def _llama(self, msgs: list[dict]) -> dict[str, Any]:
        r = self.llama.reply(self.tokenize(msgs), self.n_gen)
        r["decode_tps"] = (r["generated"] - 1) / r["decode_s"] if r["decode_s"] > 0 else 0.0
        r2 = self.llama.reply(self.tokenize(_follow_up(msgs, r["text"])), DECODE_TURN2,
                              fresh=False)  # Llama's own prefix reuse
        r.update(turn2_ttft=r2["ttft"], turn2_text=r2["text"])
        return r

    def scratch_turn2(self, msgs: list[dict], reply: str) -> str:
        """The second turn's reply from scratch (a fresh prefill on ``Llama``)."""
        return self.llama.reply(self.tokenize(_follow_up(msgs, reply)), DECODE_TURN2)["text"]

    def close(self) -> None:
        for runner in self.engines.values():
            runner.close()
        self.llama.close()


def _follow_up(msgs: list[dict], reply: str) -> list[dict]:
    return [*msgs, {"role": "assistant", "content": reply},
            {"role": "user", "content": DECODE_FOLLOWUP}]


def _decode_style(runs: dict[str, list[dict]], prompt_tokens: int,
                  scratch2: str) -> dict[str, Any]:
    """One reply style's figures per variant, and whether the replies agree."""
    res: dict[str, Any] = {"prompt_tokens": prompt_tokens}
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
        "deterministic": all(r["text"] == rs[0]["text"] for rs in runs.values() for r in rs)}
    res["turn2_equals_scratch"] = {n: rs[0]["turn2_text"] == scratch2 for n, rs in runs.items()}
    res["reply_text"] = first
    return res


def _decode_ratios(style: str, res: dict[str, Any]) -> dict[str, float]:
    """One reply style's ratios between the variants."""
    tps = {n: res[n]["decode_tokens_per_s"] for n in DECODE_VARIANTS}
    return {
        f"{style}_exact_over_inexact_decode": tps["exact"] / tps["inexact"],
        f"{style}_exact_over_llama_decode": tps["exact"] / tps["llama"],
        f"{style}_guesses_over_exact_decode": tps["guesses"] / tps["exact"],
        f"{style}_exact_over_llama_reply_time": res["exact"]["reply_s"] / res["llama"]["reply_s"],
        f"{style}_rewrite_over_reply_time": res["exact"]["rewrite_s"] / res["exact"]["reply_s"],
        f"{style}_exact_over_inexact_turn2_ttft": (
            res["exact"]["turn2_ttft_s"] / res["inexact"]["turn2_ttft_s"]),
    }
