"""A short multi-turn chat from the command line, with the cache figures of every turn.

Run ``python -m nbkv.demo`` (embedded SmolLM2-135M by default). Two sessions take turns
on separate slots, so both keep their conversations in KV.
"""

from __future__ import annotations

import argparse
import sys

from nbkv.engine.facade import Engine
from nbkv.ui.figures import summary

SYSTEM = (
    "You are a concise assistant in a notebook tutorial about prompt caching. Answer in one "
    "or two short sentences. Prefer plain words over jargon, give a concrete example when "
    "it helps, and never repeat the question back to the user. If you do not know, say so."
)

TURNS = [
    ("alice", "What is a KV cache in a language model?"),
    ("bob", "Name three fruits that are red."),
    ("alice", "Why does reusing it make the next reply start faster?"),
    ("bob", "Which of them is the sweetest?"),
    ("alice", "Give me a one-line summary of what we discussed."),
]


def main(argv: list[str] | None = None) -> int:
    """Run the demo chat and print per-turn figures."""
    ap = argparse.ArgumentParser(prog="python -m nbkv.demo", description=__doc__)
    ap.add_argument("--model", help="GGUF file (default: embedded SmolLM2-135M)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cache", choices=("imc", "spc", "off"), default="imc")
    args = ap.parse_args(argv)
    histories: dict[str, list[dict[str, str]]] = {}
    with Engine(args.model, n_slots=args.slots, n_ctx=2048, cache=args.cache) as engine:
        print(f"model: {engine.model.description} | {engine.n_slots} slots x {engine.n_ctx} "
              f"tokens | cache={engine.cache}\n")
        for session, text in TURNS:
            msgs = histories.setdefault(session, [{"role": "system", "content": SYSTEM}])
            msgs.append({"role": "user", "content": text})
            print(f"[{session}] {text}")
            print(f"[{session}] ", end="", flush=True)
            stream = engine.chat(msgs, session=session, stream=True,
                                 max_tokens=args.max_tokens, temperature=0)
            for delta in stream:
                print(delta, end="", flush=True)
            msgs.append({"role": "assistant", "content": stream.text})
            print(f"\n    -> {summary(stream.record)}\n")
        s = engine.stats()
        print(f"{s['requests']} requests: {s['reused_tokens']}/{s['prompt_tokens']} prompt "
              f"tokens served from cache ({s['salvage_pct']:.0f}%), "
              f"{s['prefilled_tokens']} prefilled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
