"""What Python work costs right after a decode: each call timed cold, then warm.

Usage: ``python tools/cold_calls.py [--mib 1100]``. Before each cold timing a buffer the size
of a model's weights (default: the 1.5B Q4_K_M's 1.1 GB) is read through, as a decode does,
so caches and TLBs hold none of the interpreter's data; the same call is then timed again at
once. Prints the median of each (microseconds). Explains the bench's host time per request
(issue 45): a generation step's cost is the number of distinct things it touches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from nbkv.core.messages import _canonical, prefix_hashes


def timed(fn: Callable[[], object], sweep: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median cold and warm time of ``fn`` in microseconds."""
    cold, warm = [], []
    for _ in range(reps):
        sweep()
        a = time.perf_counter()
        fn()
        b = time.perf_counter()
        fn()
        c = time.perf_counter()
        cold.append(b - a)
        warm.append(c - b)
    return statistics.median(cold) * 1e6, statistics.median(warm) * 1e6


def main() -> None:
    """Time each call cold and warm; print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1100, help="buffer read between calls")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    big = np.ones(args.mib * 1024 * 1024 // 8)
    message = {"role": "assistant", "content": "A short answer about the topic at hand. " * 4}
    calls: dict[str, Callable[[], object]] = {
        "an empty call": lambda: None,
        "time.perf_counter": time.perf_counter,
        "time.thread_time": time.thread_time,
        "sha256 of 300 bytes": lambda: hashlib.sha256(b"x" * 300).hexdigest(),
        "json.dumps (sorted keys)": lambda: json.dumps(message, sort_keys=True),
        "a message's canonical bytes": lambda: _canonical(message),
        "prefix_hashes of one message": lambda: prefix_hashes([message], ["a" * 32]),
    }
    print(f"{'call':32} {'cold µs':>9} {'warm µs':>9}")
    for name, fn in calls.items():
        cold, warm = timed(fn, big.sum, args.reps)
        print(f"{name:32} {cold:9.1f} {warm:9.1f}")


if __name__ == "__main__":
    main()
