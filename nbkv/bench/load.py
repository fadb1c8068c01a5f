"""Loading a model nbkv has never seen, against llama-cpp-python's ``Llama``."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from nbkv.bench.conversations import mean
from nbkv.bench.registry import scenario
from nbkv.core.config import described
from nbkv.engine.facade import Engine

N_CTX = 4096
#: nbkv's own default calibration (what a load gets with nothing said, whatever
#: ``$NBKV_CALIBRATION`` says in this process), measured against the blocking one
DEFAULT = next(f.metadata["default"] for _, f in described() if f.name == "calibration")


def _llama_load(path: str) -> tuple[float, float]:
    """``Llama``'s load, and when its first reply's first token comes (from the load's start)."""
    from nbkv.bench.runners import LlamaCppRunner

    t0 = time.perf_counter()
    runner = LlamaCppRunner(path, N_CTX, max_tokens=4)
    took = time.perf_counter() - t0
    try:
        first = runner.turn([{"role": "user", "content": "Say hello."}], "s")["ttft"]
    finally:
        runner.close()
    return took, took + first


def _nbkv_load(path: str, mode: str) -> dict[str, Any]:
    """A first load as of a never-seen model (an empty calibration cache); then a first
    reply, then the end of the proof.

    ``mode``: the ``calibration`` asked for: ``"cached"`` (measured during the load) or
    :data:`DEFAULT` (the engine serves at once and proves in the background).
    """
    old = os.environ.get("NBKV_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="nbkv-bench-") as tmp:
        os.environ["NBKV_CACHE_DIR"] = tmp  # empty until the proof ends (it looks there again)
        try:
            t0 = time.perf_counter()
            engine = Engine(path, n_ctx=N_CTX, calibration=mode)
            try:
                ready = time.perf_counter() - t0
                res = engine.chat([{"role": "user", "content": "Say hello."}], max_tokens=4,
                                  temperature=0)
                engine.wait_proven()
                proven = time.perf_counter() - t0
                rule = engine.prefill_rule
                return {"calibration": mode, "ready_s": ready,
                        "first_ttft_s": res.record.ttft_s,
                        "first_reply_exact": res.record.exact, "proven_s": proven,
                        "calibration_s": rule.seconds, "rule": rule.describe()}
            finally:
                engine.close()
        finally:
            if old is None:
                os.environ.pop("NBKV_CACHE_DIR", None)
            else:
                os.environ["NBKV_CACHE_DIR"] = old


def first_load(path: str, quick: bool) -> dict[str, Any]:
    """Llama's load and nbkv's first loads of ``path`` (with the default calibration, and
    measuring during the load), in A B C C B A order (A B C if quick)."""
    _llama_load(path)  # the file into the page cache: every load below reads it warm
    order = ["llama", "default", "cached"]
    asked = {"default": DEFAULT, "cached": "cached"}
    llama: list[tuple[float, float]] = []
    runs: dict[str, list[dict[str, Any]]] = {"default": [], "cached": []}
    for who in order if quick else order + order[::-1]:
        if who == "llama":
            llama.append(_llama_load(path))
        else:
            runs[who].append(_nbkv_load(path, asked[who]))
    llama_s, llama_first = mean([a for a, _ in llama]), mean([b for _, b in llama])
    out: dict[str, Any] = {"model": os.path.basename(path), "default_calibration": DEFAULT,
                           "llama_load_s": llama_s,
                           "llama_first_token_s": llama_first, "runs": runs, "ratios": {}}
    for mode, rs in runs.items():
        ready = mean([r["ready_s"] for r in rs])
        first = mean([r["ready_s"] + r["first_ttft_s"] for r in rs])
        out[f"{mode}_ready_s"] = ready
        out[f"{mode}_first_token_s"] = first
        out[f"{mode}_proven_s"] = mean([r["proven_s"] for r in rs])
        out["ratios"][f"{mode}_ready_over_llama_load"] = ready / llama_s
        out["ratios"][f"{mode}_first_token_over_llama_load"] = first / llama_s
        out["ratios"][f"{mode}_first_token_over_llama_first_token"] = first / llama_first
    return out


@scenario("realistic-load")
def scenario_realistic_load(path: str, quick: bool) -> dict[str, Any]:
    """The first load of a model nbkv has never seen, against ``Llama``'s load of the same
    file: on the generated 1.5B-shaped Q4_K_M (nbkv.fixtures.realistic) and on ``path``
    (the embedded model by default), each with an empty calibration cache. Two ways: nbkv's
    default (``calibration="background"``: the engine serves at once while it proves in the
    background), and the calibration measured during the load (``calibration="cached"``).

    Figures: when the engine is ready (a first reply can start), when that first reply's
    first token comes, and when the exactness proof has ended. Target: ready within 2x
    ``Llama``'s load on the 1.5B-shaped model, with the default.
    """
    from nbkv.fixtures.realistic import realistic_model

    big = first_load(str(realistic_model()), quick)
    small = first_load(path, quick)
    ratios = {f"realistic_{k}": v for k, v in big["ratios"].items()}
    ratios.update({f"embedded_{k}": v for k, v in small["ratios"].items()})
    return {"realistic": big, "embedded": small, "ratios": ratios}
