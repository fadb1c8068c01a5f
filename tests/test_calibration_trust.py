"""A calibration is trusted only where it was proven: background proving, and forged entries.

``calibration="background"`` (the default; the test run sets ``$NBKV_CALIBRATION``, which these
tests unset) serves at once with records ``exact=False`` and proves the rule on its own
thread, and with the rule cached it is exact from the first request; a forged (edited)
cached entry is measured again, so no reply that differs from cache-off is ever marked
exact. The embedded model, in a calibration cache of its own.
"""

from __future__ import annotations

import json
import logging

import pytest

from nbkv import Engine
from nbkv.core.events import SlotsChanged
from nbkv.engine import native
from nbkv.engine.proving import NOT_PROVEN
from nbkv.kv.calibration_file import FILE

KW = dict(n_slots=1, n_ctx=512, n_threads=1)
SYSTEM = "You are a terse assistant. Answer in one short sentence."
ASKS = ["What is a CPU?", "And memory?", "Why is a cache fast?"]


def turns(engine):
    msgs = [{"role": "system", "content": SYSTEM}]
    out = []
    for ask in ASKS:
        msgs.append({"role": "user", "content": ask})
        r = engine.chat(msgs, session="s", max_tokens=8, temperature=0)
        msgs.append(r.message)
        out.append((r.text, r.record.exact))
    return out


QUICK = native.QUICK_PROOF_PARAMS


@pytest.fixture(autouse=True)
def as_a_large_model(monkeypatch):
    """The embedded model is proven during its load by default (it is small): here it proves
    in the background, as a model of billions of parameters does."""
    monkeypatch.setattr(native, "QUICK_PROOF_PARAMS", 0)


@pytest.fixture(scope="module")
def off(model_path):
    with Engine(model_path, cache="off", exact=False, **KW) as e:
        return [t for t, _ in turns(e)]


@pytest.fixture(scope="module")
def proven(model_path, tmp_path_factory):
    """An engine with the default settings that found nothing cached: a reply while it
    proves, then three after."""
    d = tmp_path_factory.mktemp("calibration")
    mp = pytest.MonkeyPatch()
    mp.setenv("NBKV_CACHE_DIR", str(d))
    mp.delenv("NBKV_CALIBRATION", raising=False)  # the default, not the test run's
    events = []
    with pytest.MonkeyPatch.context() as quick:
        quick.setattr(native, "QUICK_PROOF_PARAMS", 0)  # as a model of billions of parameters
        engine = Engine(model_path, **KW)
    with engine as e:
        assert e.settings.exactness.calibration == "background"
        e.subscribe(events.append)
        unproven = e.prefill_rule
        asked = [{"role": "user", "content": ASKS[0]}]
        first = e.chat(asked, session="p", max_tokens=8, temperature=0)
        assert e.wait_proven(900)
        emptied = [len(s.tokens) for s in e.slots()]
        rule = e.prefill_rule
        later = turns(e)
        again = e.chat([*asked, first.message, {"role": "user", "content": ASKS[1]}],
                       session="p", max_tokens=1, temperature=0).record  # its next turn
    yield {"dir": d, "unproven": unproven, "first": first, "emptied": emptied,
           "rule": rule, "later": later, "events": events, "again": again}
    mp.undo()


def test_background_serves_at_once_unproven_then_exact(proven, off):
    assert not proven["unproven"].exact and proven["unproven"].reason == NOT_PROVEN
    assert proven["first"].record.exact is False  # served before the proof: never claimed
    assert proven["rule"].exact
    said = [e.reason for e in proven["events"] if isinstance(e, SlotsChanged)
            and e.reason.startswith("nbkv proved")]
    assert len(said) == 1 and proven["rule"].describe() in said[0]
    assert proven["emptied"] == [0]  # the KV grouped by the unproven rule: gone
    # ... and the next turn of the conversation it held says why it was read again
    assert proven["again"].reason == "proven" and proven["again"].exact
    assert "proved this model's exact grouping" in proven["again"].reason_text
    assert [t for t, _ in proven["later"]] == off
    assert all(exact for _, exact in proven["later"])
    assert (proven["dir"] / FILE).is_file()  # stored, signed: the next load measures nothing


def test_closing_while_proving_ends_the_proof(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("NBKV_CACHE_DIR", str(tmp_path))
    e = Engine(model_path, calibration="background", **KW)
    proof = e.core.proof
    assert proof is not None and proof.thread.is_alive()
    e.close()
    assert not proof.thread.is_alive() and not (tmp_path / FILE).exists()
    assert e.wait_proven(0) is True  # waiters are released


def test_a_forged_calibration_is_measured_again(model_path, proven, off, monkeypatch, caplog):
    """The issue's forgery on the embedded Q4_1: single_row=True (no reply rewrite), its
    table edited to agree. Signed over the true entry, so the signature gives it away."""
    monkeypatch.setenv("NBKV_CACHE_DIR", str(proven["dir"]))
    path = proven["dir"] / FILE
    data = json.loads(path.read_text())
    assert data and not proven["rule"].single_row
    for entry in data.values():
        rule = entry["body"]["rule"]
        rule.update(single_row=True, align=1,
                    table=[[k, True] for k, _ in rule["table"]] or [[1, True]])
    path.write_text(json.dumps(data))
    caplog.set_level(logging.WARNING, logger="nbkv")
    with Engine(model_path, calibration="cached", **KW) as e:
        assert not e.prefill_rule.single_row and e.prefill_rule == proven["rule"]
        got = turns(e)
    assert "does not match its contents" in caplog.text and "measuring again" in caplog.text
    assert [t for t, _ in got] == off and all(exact for _, exact in got)


@pytest.fixture
def never_proven(monkeypatch, tmp_path):
    """Background proofs that never end (until the engine closes): the unproven window."""
    import time

    from nbkv.engine import proving

    real = proving.calibrate.calibrate

    def forever(*args, gate=None, **kw):
        if gate is None:  # a load that measures (or reads the cache): as it is
            return real(*args, **kw)
        while True:
            gate()
            time.sleep(0.005)

    monkeypatch.setattr(proving.calibrate, "calibrate", forever)
    monkeypatch.setenv("NBKV_CACHE_DIR", str(tmp_path / "cache"))


def test_nothing_grouped_unproven_is_saved_or_spilled_as_proven(model_path, proven, tmp_path,
                                                               never_proven, monkeypatch):
    park = tmp_path / "park"
    e = Engine(model_path, calibration="background", park_dir=str(park), **KW)
    try:
        r = e.chat([{"role": "user", "content": ASKS[0]}], session="a", max_tokens=4)
        assert r.record.exact is False and e.core.proof.pending()
        e.settle()
        state = e.export_state()
        assert state.slots and all(s.kv.settled == 0 and s.kv.exact_len == 0
                                   for s in state.slots)
    finally:
        e.close()
    # the next engine (proven: its calibration cached) adopts nothing from the park folder
    monkeypatch.setenv("NBKV_CACHE_DIR", str(proven["dir"]))
    with Engine(model_path, calibration="background", park_dir=str(park), **KW) as e2:
        assert e2.prefill_rule.exact and e2.parked() == ()


@pytest.mark.parametrize("why", ["stored", "small"])
def test_background_with_the_rule_cached_is_exact_from_the_first_request(
        model_path, proven, off, monkeypatch, tmp_path, why):
    """Nothing left to prove: the load adopts the stored rule before it returns (no race);
    a small model with nothing stored is measured during its load."""
    d = proven["dir"] if why == "stored" else tmp_path
    monkeypatch.setattr(native, "QUICK_PROOF_PARAMS", QUICK)
    monkeypatch.setenv("NBKV_CACHE_DIR", str(d))
    monkeypatch.delenv("NBKV_CALIBRATION", raising=False)
    with Engine(model_path, **KW) as e:
        assert e.core.proof is None and e.wait_proven(0)
        assert e.prefill_rule == proven["rule"]
        assert (d / FILE).is_file()
        r = e.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASKS[0]}],
                   session="s", max_tokens=8, temperature=0)
    assert r.record.exact is True and r.text == off[0]


class _Stub:
    """Whatever the call asks of it: nothing (adopt's engine parts, which it must not touch)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __iter__(self):
        raise AssertionError("the slots were walked: something was forgotten")


def test_an_inexact_engine_keeps_its_cache_when_the_proof_lands():
    """exact=False groups prompts the lean way before and after the proof: nothing to drop."""
    from pathlib import Path

    from nbkv.engine import proving
    from nbkv.kv.invariance import PrefillRule

    rule = PrefillRule(4, 2, exact=True)
    res = _Stub(exact=False, model=_Stub(path=Path("m.gguf"), prefill_rule=None), rule=None)
    proof = proving.BackgroundProof(res, busy=lambda: False, wake=lambda: None, cache=True)
    proof.rule = rule
    said = []
    got = proving.adopt(proof, res, _Stub(), _Stub(clear=None), None, None,
                        _Stub(publish=said.append))
    assert got is rule and res.rule is rule and res.model.prefill_rule is rule
    assert not proof.pending() and "recomputed" not in said[0].reason
