"""The engine's fixed cost, counted (nbkv.core.events), and the lean path it shows.

On the lean path (exact=False, or no grouping proven) a request's new tokens are read in as
few decodes as n_batch allows and nothing is read twice; on the exact path the counters show
what exactness costs. Counts only: no test here times anything.
"""

from __future__ import annotations

import gc
import math
import threading
import time

import pytest

from conftest import SYSTEM, talk
from nbkv import Engine
from nbkv.core.events import KVCounters, RequestCounts, SlotRewritten
from nbkv.engine import scheduler as scheduler_mod
from nbkv.kv import calibrate, invariance
from nbkv.kv.invariance import PrefillRule

N_BATCH = 32


def test_host_time_excludes_llama_time_and_nested_parts():
    c = KVCounters()
    req = RequestCounts()
    with c.part("placement", req):
        with c.part("parking", req):
            c.decoded(4, 1e6)  # more llama time than the wall clock: the part's host time is 0
        c.decoded(2, 1e6, padded=1)
    assert c.host_s == {"placement": 0.0, "parking": 0.0}
    assert req.host_s == {"placement": 0.0, "parking": 0.0}
    assert (c.decode_calls, c.rows, c.padded_rows) == (2, 6, 1)
    with c.part("sampling"):
        pass
    assert c.host_s["sampling"] >= 0.0 and "sampling" not in req.host_s
    with c.part("parking", idle=True):  # idle-time work: apart from the requests' host time
        pass
    assert c.host_s["parking"] == 0.0 and "parking" in c.idle_host_s
    snap = c.snapshot()
    assert snap["host_total_s"] == sum(c.host_s.values()) and snap["bytes_moved"] == 0
    assert snap["idle_host_s"] == c.idle_host_s

    shared = (RequestCounts(), RequestCounts())  # one step's requests share its part
    with c.part("sampling", shared):
        time.sleep(0.002)
    assert shared[0].host_s["sampling"] == shared[1].host_s["sampling"] > 0.0
    assert math.isclose(2 * shared[0].host_s["sampling"],
                        c.host_s["sampling"] - snap["host_s"]["sampling"])


def test_gc_due_names_the_oldest_generation_half_way_to_its_run():
    limits, enabled = gc.get_threshold(), gc.isenabled()
    try:
        gc.set_threshold(100_000, 10, 10)  # no automatic collection while the test counts
        gc.collect()
        assert scheduler_mod.gc_due() is None
        young = [[] for _ in range(60_000)]  # containers: they count towards generation 0
        assert scheduler_mod.gc_due() == 0
        for _ in range(5):  # each collection of generation 1 counts towards generation 2
            gc.collect(1)
        assert scheduler_mod.gc_due() == 2 and young
        gc.set_threshold(0)  # the collector's automatic runs off: nothing is due
        assert scheduler_mod.gc_due() is None
        gc.set_threshold(100_000, 10, 10)
        gc.disable()
        assert scheduler_mod.gc_due() is None
    finally:
        gc.set_threshold(*limits)
        if enabled:
            gc.enable()


def test_a_due_collection_runs_in_idle_time_counted_apart(monkeypatch, model_path):
    collected: list[int] = []

    class FakeGC:
        @staticmethod
        def collect(gen):
            collected.append(gen)

    monkeypatch.setattr(scheduler_mod, "gc", FakeGC)
    monkeypatch.setattr(scheduler_mod, "gc_due", lambda: None if collected else 1)
    with Engine(model_path, n_slots=1, n_ctx=1024, exact=False, park_ram=0) as e:
        e.scheduler.wake()
        for _ in range(200):  # the idle pass runs once the thread looks at its work
            if collected:
                break
            e.core.call(lambda: None)
            time.sleep(0.01)
        snap = e.counters()
    assert collected == [1]
    assert "gc" in snap["idle_host_s"] and "gc" not in snap["host_s"]


def test_the_lean_grouping_takes_whole_batches():
    rule = PrefillRule(8, 4, exact=True, single_row=False, mixed=True, reason="")
    lean = invariance.lean(rule, "not asked")
    assert not lean.exact and lean.reason == "not asked" and not lean.mixed
    units = list(range(100))
    assert [invariance.next_chunk(units, p, lean, 32) for p in (0, 32, 64, 96)] == [32, 32, 32, 4]
    assert invariance.valid_start(units, 37, lean) == 37  # no canonical cut-back
    assert invariance.chunks(units, 0, 100, lean, 32) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert invariance.chunks(units, 0, 100, rule, 32) != invariance.chunks(units, 0, 100, lean, 32)


def check_lean(rec, n_batch):
    """The lean path's counts for one finished request (see the module's docstring)."""
    assert rec.path == "lean" and rec.exact is False
    assert rec.prefill_calls == math.ceil(rec.new_tokens / n_batch)
    assert rec.prefill_rows == rec.new_tokens and rec.rows_per_new_token == 1.0
    # every generated token is decoded but the last, unless a stop token followed it
    decoded = rec.generated_tokens - (rec.finish_reason == "length")
    assert rec.decode_calls == rec.prefill_calls + decoded
    assert rec.rows_computed == rec.prefill_rows + decoded


def test_lean_path_counts(model_path):
    with Engine(model_path, n_slots=2, n_ctx=2048, n_batch=N_BATCH, exact=False,
                park_ram=0) as e:  # parking copies states out in idle time: not here
        before = e.counters()
        assert before["path"] == "lean" and not e.prefill_rule.exact
        msgs = [{"role": "system", "content": SYSTEM}]
        recs = [talk(e, msgs, q, "a", max_tokens=6).record
                for q in ("What is a CPU?", "And memory?", "Why is a cache fast?")]
        other = e.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "What is a GPU?"}], session="b",
                       max_tokens=5, temperature=0).record  # its system prompt: a copy
        after = e.counters()
    for rec in (*recs, other):
        check_lean(rec, N_BATCH)
    assert recs[1].reused_tokens > recs[0].prompt_tokens  # the reply was reused as it is
    assert recs[1].reprefilled_tokens == 0 and recs[2].reprefilled_tokens == 0
    # every decode since the load carried these requests' rows: no rewrite, no shadow
    done = (*recs, other)
    assert after["decode_calls"] - before["decode_calls"] == sum(r.decode_calls for r in done)
    assert after["rows"] - before["rows"] == sum(r.rows_computed for r in done)
    assert after["host_s"].get("rewrite", 0.0) == before["host_s"].get("rewrite", 0.0)
    assert all(r.host_s > 0.0 and dict(r.host_parts).keys() >= {"placement", "sampling"}
               for r in done)
    assert after["bytes_moved"] == before["bytes_moved"]  # nothing through host RAM
    assert all(r.kv_bytes == 0 for r in done)
    if other.donor_slot is not None:  # the shared system prompt, copied inside the KV
        assert after["copies"] > before["copies"] and other.kv_bytes == 0


def test_exact_path_counts(model_path):
    with Engine(model_path, n_slots=1, n_ctx=2048, n_batch=N_BATCH) as e:
        if not e.prefill_rule.exact:
            pytest.skip("no exact grouping on this build")
        idle_rewrite = threading.Event()
        e.subscribe(lambda ev: isinstance(ev, SlotRewritten) and ev.tokens > ev.mixed
                    and idle_rewrite.set())
        msgs: list = []
        first = talk(e, msgs, "What is a CPU?", "a", max_tokens=6).record
        second = talk(e, msgs, "And memory?", "a", max_tokens=6).record
        rewritten = idle_rewrite.wait(120)  # the last reply's, in idle time
        e.core.call(lambda: None)  # after the pass that rewrote it
        snap = e.counters()
    for rec in (first, second):
        assert rec.path == "exact" and rec.exact is True
        assert rec.prefill_rows == rec.prefilled_tokens >= rec.new_tokens
        assert rec.prefill_calls >= math.ceil(rec.prefilled_tokens / N_BATCH)
    assert snap["path"] == "exact" and snap["decode_calls"] >= first.decode_calls
    # a reply rewritten in idle time is idle-time work, apart from the requests' host time
    assert rewritten and "rewrite" in snap["idle_host_s"] and "rewrite" not in snap["host_s"]


def test_no_proven_grouping_takes_the_lean_path(monkeypatch, model_path):
    failed = PrefillRule(8, 4, exact=False, reason="faked: no grouping reproduced a batch")
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: failed)
    monkeypatch.setattr(calibrate, "store", lambda *a, **k: None)  # the shared cache: not it
    with pytest.warns(UserWarning, match="cannot prove cached replies exact"):
        e = Engine(model_path, n_slots=1, n_ctx=2048, n_batch=N_BATCH, calibration="fresh")
    with e:
        assert e.model.exactness == "exact: no (faked: no grouping reproduced a batch)"
        assert e.counters()["path"] == "lean"
        msgs: list = []
        recs = [talk(e, msgs, q, "a", max_tokens=6).record for q in ("Hi", "And then?")]
        calls = e.counters()["decode_calls"]
        e.settle()  # exact mode asked: nothing to rewrite on the lean path all the same
        assert e.counters()["decode_calls"] == calls
    for rec in recs:
        check_lean(rec, N_BATCH)
    assert recs[1].reprefilled_tokens == 0 and recs[1].rewrite_absorbed == 0


@pytest.mark.slow  # its calibration (a key of its own) pads every probe decode
def test_fixed_shape_decodes_pad_every_call_and_keep_replies(model_path):
    rows = 4
    msgs = [{"role": "system", "content": SYSTEM}]
    with Engine(model_path, n_slots=1, n_ctx=1024, n_batch=N_BATCH, fixed_rows=rows) as e:
        before = e.counters()
        first = talk(e, msgs, "What is a CPU?", "a", max_tokens=6)
        second = talk(e, msgs, "And memory?", "a", max_tokens=6)
        after = e.counters()
        exact = e.prefill_rule.exact
    calls = after["decode_calls"] - before["decode_calls"]
    assert after["rows"] - before["rows"] == calls * rows  # one shape, every call
    assert after["padded_rows"] > before["padded_rows"]
    assert first.record.prefill_rows == first.record.prefilled_tokens
    assert first.record.prefill_calls >= first.record.prefill_rows / rows  # chunks <= rows
    assert second.record.exact is exact  # proven (or not) in the padded shape
    if exact:  # a proven grouping: the cached reply is the one computed from scratch
        with Engine(model_path, n_slots=1, n_ctx=1024, n_batch=N_BATCH, fixed_rows=rows,
                    cache="off") as off:
            assert off.chat(msgs[:-1], max_tokens=6, temperature=0).text == second.text


def test_fixed_rows_is_checked():
    from nbkv.core.errors import InvalidRequestError

    for bad, match in ((-1, "fixed_rows must be an integer"), (64, "at most n_batch")):
        with pytest.raises(InvalidRequestError, match=match):
            Engine(None, n_batch=N_BATCH, fixed_rows=bad)
