"""Side-by-side benchmark: nbkv's caches against no cache and llama-cpp-python's own reuse.

``python -m nbkv.bench`` runs every scenario on the same conversations, in one process, and
prints a table plus JSON (also written to ``--out``, with the run's machine, date and command:
the docs' benchmark page renders it). Timings on shared CPUs are noisy, so the figures that
matter are *ratios between variants measured in the same run*, timed in A B B A order. Chat
scenarios call ``engine.settle()`` after every reply, the user's reading time, in which exact
mode rewrites the reply's KV (docs: Exactness); ``decode`` measures the rewrite's own cost.

Variants:
  off        nbkv with cache="off": clear the slot and prefill everything, every request
  llama-cpp  llama_cpp.Llama.create_chat_completion: one sequence, longest-common-prefix reuse
  imc        nbkv Incremental Message Cache
  spc        nbkv System Prompt Cache
  limit      (single, thrash) the physical floor: only the new tokens, decoded at that
             depth on a raw context with nothing else going on
  sequential / batched   (subagents) the same agents one request at a time / all at once
  plain (speculative) or exact (decode) / guesses / inexact   the default engine /
             speculative=True (prompt-lookup guesses) / exact=False (no reply rewrite)
  llama      (decode) llama_cpp.Llama.generate on the same prompt tokens, greedy

``decode`` (generation speed, the rewrite's cost) and ``families`` (prefill against the
minimum on every memory class, with ``nbkv.fixtures.make_text_model``'s tiny models) measure
the engine's design; the others measure the caches against their alternatives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any

from nbkv.bench.registry import SCENARIOS
from nbkv.bench.report import print_report, targets
from nbkv.bench.runners import MAX_TOKENS
from nbkv.llama.models import default_model_path


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_facts(argv: list[str] | None) -> dict[str, Any]:
    """Machine, date and command of a run: what the docs' benchmark page states with it."""
    import llama_cpp

    args = sys.argv[1:] if argv is None else argv
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python -m nbkv.bench", *args]),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, {platform.system()} "
                   f"{platform.release()}",
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios asked for (default: all), print the tables, write the JSON."""
    ap = argparse.ArgumentParser(prog="python -m nbkv.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2-135M)")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="run only these (repeatable); default: all")
    ap.add_argument("--quick", action="store_true", help="fewer turns (a smoke run)")
    ap.add_argument("--out", default="bench-results.json", help="where to write the JSON")
    args = ap.parse_args(argv)
    # engines measured proven: a model never seen is calibrated during its load, not in the
    # background (realistic-load asks for each way itself: it measures that first load)
    os.environ.setdefault("NBKV_CALIBRATION", "cached")
    path = str(args.model or default_model_path())
    report: dict[str, Any] = {"model": path, "max_tokens": MAX_TOKENS, "run": run_facts(argv)}
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
