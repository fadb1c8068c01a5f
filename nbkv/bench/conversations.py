"""The scenarios' conversations: deterministic texts, playing them, and averaging."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from nbkv.bench.runners import LlamaCppRunner, NbkvRunner

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


#: the four sessions of the interleaved scenarios
NAMES = ("Ada", "Brook", "Cyd", "Dale")


def four_sessions(rounds: int) -> tuple[dict[str, list[dict]], list[tuple[str, str]]]:
    """Four sessions with distinct system prompts, one turn each per round, round-robin."""
    convs = {n: [{"role": "system", "content": system_prompt(n, 14)}] for n in NAMES}
    turns = [(n, paragraph(r * 4 + i, 1)) for r in range(rounds) for i, n in enumerate(NAMES)]
    return convs, turns


def run_conversations(
    runner: Any, convs: dict[str, list[dict]], turns: list[tuple[str, str]],
    replies: list[str] | None,
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


def played(runner: Any, convs: dict[str, list[dict]], turns: list[tuple[str, str]],
           replies: list[str] | None) -> list[dict[str, Any]]:
    """:func:`run_conversations`, then close ``runner``."""
    try:
        return run_conversations(runner, convs, turns, replies)
    finally:
        runner.close()


def baselines(path: str, slots: int, n_ctx: int, convs: dict, turns: list, replies: list,
              llama: bool = True) -> dict[str, list]:
    """The same conversations through nbkv off, nbkv SPC and llama-cpp-python's ``Llama``
    (``llama=False``: not Llama, which the caller ran side by side with its own variant)."""
    out = {name: played(NbkvRunner(path, name, slots, n_ctx), convs, turns, replies)
           for name in ("off", "spc")}
    if llama:
        out["llama-cpp"] = played(LlamaCppRunner(path, n_ctx), convs, turns, replies)
    return out


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def mirrored(variants: Iterable[str]) -> list[str]:
    """``A B C C B A``: each variant twice, in an order that cancels a steady drift of the
    machine's speed (timings on a shared machine drift)."""
    names = list(variants)
    return [*names, *reversed(names)]
