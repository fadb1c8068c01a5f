"""A saved conversation's next turn in a fresh process: restored against rebuilt."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from nbkv.bench.conversations import mean, paragraph, system_prompt
from nbkv.bench.registry import scenario
from nbkv.bench.runners import MAX_TOKENS, NbkvRunner

_RESTART = """
import json, sys, time
t0 = time.perf_counter()
from nbkv import Engine
from nbkv.notebook.sessions import SessionStore
path, save, mode, msgs_file, max_tokens = sys.argv[1:6]
msgs = json.load(open(msgs_file))
e = Engine(path, n_slots=1, n_ctx=4096)
load_s = time.perf_counter() - t0
restore_s = 0.0
if mode == "restore":
    t1 = time.perf_counter()
    e.restore(save, SessionStore())
    restore_s = time.perf_counter() - t1
r = e.chat(msgs, session="solo", max_tokens=int(max_tokens), temperature=0)
print(json.dumps({"load_s": load_s, "restore_s": restore_s, "ttft": r.record.ttft_s,
                  "text": r.text, "strategy": r.record.strategy,
                  "prefilled": r.record.prefilled_tokens}))
e.close()
"""


def _fresh_process(path: str, save: str, mode: str, msgs_file: str) -> dict[str, Any]:
    import subprocess

    p = subprocess.run([sys.executable, "-c", _RESTART, path, save, mode, msgs_file,
                        str(MAX_TOKENS)], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


@scenario("restore")
def scenario_restore(path: str, quick: bool) -> dict[str, Any]:
    """A 2,000-token conversation saved, then its next turn in a fresh process.

    Variants: ``warm`` (the next turn in the process that built the conversation),
    ``restored`` (a new process: load, ``engine.restore``, next turn) and ``rebuild`` (a new
    process without the save: the whole conversation is prefilled). Fresh processes run in
    A B B A order; the warm figure is measured twice, the second time after an in-process
    restore of the same save (the same KV).
    """
    import tempfile

    from nbkv.notebook.sessions import SessionStore

    n_turns = 6 if quick else 12
    hist = [{"role": "system", "content": system_prompt("Ada", 6)}]
    runner = NbkvRunner(path, "imc", 1, 4096)
    e = runner.engine
    for t in range(n_turns):
        hist.append({"role": "user", "content": paragraph(t, 6)})
        r = runner.turn(hist, "solo")
        hist.append({"role": "assistant", "content": r["text"]})
    nxt = hist + [{"role": "user", "content": paragraph(n_turns, 6)}]
    with tempfile.TemporaryDirectory(prefix="nbkv-bench-") as tmp:
        save_dir = os.path.join(tmp, "save")
        saves = [e.save(save_dir, SessionStore()) for _ in range(2)]
        rep = saves[-1]  # the second save finds its blobs on disk: what autosave pays
        warm: list[dict[str, Any]] = []
        for i in range(2):
            if i:
                e.restore(save_dir, SessionStore())
            w = e.chat(nxt, session="solo", max_tokens=MAX_TOKENS, temperature=0)
            warm.append({"ttft": w.record.ttft_s, "text": w.text, "strategy": w.record.strategy})
        runner.close()
        msgs_file = os.path.join(tmp, "next.json")
        with open(msgs_file, "w") as f:
            json.dump(nxt, f)
        runs: dict[str, list[dict[str, Any]]] = {"restored": [], "rebuild": []}
        for mode in ("restored", "rebuild", "rebuild", "restored"):
            runs[mode].append(_fresh_process(path, save_dir, mode.replace("restored", "restore"),
                                             msgs_file))
        bytes_on_disk = sum(os.path.getsize(os.path.join(d, f))
                            for d, _, fs in os.walk(save_dir) for f in fs)
    ttft = {"warm": mean([w["ttft"] for w in warm]),
            "restored": mean([r["ttft"] for r in runs["restored"]]),
            "rebuild": mean([r["ttft"] for r in runs["rebuild"]])}
    return {
        "conversation_tokens": rep.slots[0].tokens,
        "save_s": saves[0].seconds, "save_again_s": rep.seconds,
        "save_bytes": rep.nbytes, "bytes_on_disk": bytes_on_disk,
        "restore_s": mean([r["restore_s"] for r in runs["restored"]]),
        "load_s": mean([r["load_s"] for r in runs["restored"] + runs["rebuild"]]),
        "mean_ttft_s": ttft,
        "strategies": {"warm": [w["strategy"] for w in warm],
                       **{k: [r["strategy"] for r in v] for k, v in runs.items()}},
        "replies_equal": len({w["text"] for w in warm} |
                             {r["text"] for v in runs.values() for r in v}) == 1,
        "ratios": {
            "restored_over_warm_ttft": ttft["restored"] / ttft["warm"],
            "rebuild_over_restored_ttft": ttft["rebuild"] / ttft["restored"],
        },
    }
