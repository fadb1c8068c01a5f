"""What the live dashboard costs the engine's prefill, measured headless."""

from __future__ import annotations

import json
import time
from typing import Any

from nbkv.bench.conversations import QUESTIONS, mean, paragraph
from nbkv.bench.registry import scenario
from nbkv.engine.facade import Engine


class HeadlessComm:
    """A kernel comm with no kernel: it serializes what a widget sends, as ipykernel would."""

    def __init__(self, **kw: Any) -> None:
        self.comm_id = kw.get("comm_id") or f"headless-{id(self)}"
        self.kernel = "headless"  # ipywidgets sends only through a comm that has a kernel
        self.bytes = 0

    def open(self, *a: Any, **kw: Any) -> None:
        pass

    def on_msg(self, *a: Any, **kw: Any) -> None:
        pass

    def on_close(self, *a: Any, **kw: Any) -> None:
        pass

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.bytes += len(json.dumps(data, default=str))

    def close(self, *a: Any, **kw: Any) -> None:
        pass


@scenario("dashboard")
def scenario_dashboard(path: str, quick: bool) -> dict[str, Any]:
    """What the live dashboard costs the engine: prefill tokens/s with and without it.

    One engine (2 slots x 2048) serves requests back to back, as "Run All" does: each a new
    ~300-token prompt (its slot cleared first, so all of it is read) and an 8-token reply.
    Blocks alternate ``bare`` and ``dashboard`` (a ``CacheDashboard`` attached, its live feed
    redrawing the slot cards, KV map and timeline from the events, comm messages serialized
    as a kernel would, no browser), A B B A. Target: the dashboard costs at most 5% of
    prefill throughput.
    """
    import comm

    from nbkv.ui.widgets import CacheDashboard

    per_block = 4 if quick else 8
    order = ["bare", "dashboard", "dashboard", "bare"] * (1 if quick else 2)
    engine = Engine(path, n_slots=2, n_ctx=2048)
    seed = iter(range(1000))
    out: dict[str, dict[str, Any]] = {v: {"prefilled": 0, "prefill_s": 0.0, "ttft": [],
                                          "renders": 0, "render_cpu_s": 0.0, "comm_bytes": 0,
                                          "wall_s": 0.0}
                                      for v in ("bare", "dashboard")}

    def block(variant: str) -> None:
        acc = out[variant]
        dash, original = None, comm.create_comm
        comms: list[HeadlessComm] = []

        def headless(*args: Any, **kw: Any) -> Any:
            comms.append(HeadlessComm(*args, **kw))
            return comms[-1]

        if variant == "dashboard":
            comm.create_comm = headless
            dash = CacheDashboard(engine, interval=0.25)
        t0 = time.perf_counter()
        try:
            for _ in range(per_block):
                k = next(seed)
                engine.clear()
                msgs = [{"role": "system", "content": paragraph(k, 12)},
                        {"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
                r = engine.chat(msgs, session=f"s{k % 2}", max_tokens=8, temperature=0).record
                acc["prefilled"] += r.prefilled_tokens
                acc["prefill_s"] += r.prefill_s
                acc["ttft"].append(r.ttft_s)
            acc["wall_s"] += time.perf_counter() - t0
            if dash is not None:
                time.sleep(0.5)  # the last redraw, so that its cost is counted
                acc["renders"] += dash.feed.renders
                acc["render_cpu_s"] += dash.feed.render_cpu_s
        finally:
            if dash is not None:
                dash.close()
                comm.create_comm = original
                acc["comm_bytes"] += sum(c.bytes for c in comms)

    try:
        engine.chat([{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=0)
        for variant in order:
            block(variant)
    finally:
        engine.close()
    for acc in out.values():
        acc["prefill_tokens_per_s"] = acc["prefilled"] / acc["prefill_s"]
        acc["mean_ttft"] = mean(acc.pop("ttft"))
    ratio = out["dashboard"]["prefill_tokens_per_s"] / out["bare"]["prefill_tokens_per_s"]
    return {**out, "order": order, "requests_per_block": per_block,
            "ratios": {"dashboard_over_bare_prefill_tokens_per_s": ratio,
                       "dashboard_render_cpu_share": out["dashboard"]["render_cpu_s"]
                       / out["dashboard"]["wall_s"]}}
