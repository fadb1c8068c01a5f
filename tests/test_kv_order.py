"""The order of KV operations within one admission pass (issue 36, finding 1).

llama.cpp copies a sequence's cells' metadata at ``seq_cp`` but runs the data copy at the next
``llama_decode``. A prefix copy from slot 0 and, in the same admission pass, a parked
conversation restored into slot 0 gave the copy the restored KV: a wrong reply marked exact.
``Engine.hold_admission()`` makes both admissions fall into one pass on purpose (timing never
decides these tests).
"""

from __future__ import annotations

import ctypes

import pytest
from test_families import model_for

from conftest import assert_consistent
from nbkv import Engine
from nbkv.core.errors import KVOrderError
from nbkv.core.events import RequestStarted
from nbkv.llama.backend import Batch

ASTRO = ("You are a helpful assistant who answers questions about astronomy in a short and "
         "simple way. Always mention the planets of the solar system and the moon when you can.")
GARDEN = "You are Carol's assistant. You talk only about gardening and flowers, briefly."
CALC = "You are a calculator. Reply with numbers only, nothing else at all."


def conv(system, text):
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def verified(engine):
    engine.settle()
    assert_consistent(engine)
    checks = engine.verify()
    assert checks and all(v.identical for v in checks), [str(v) for v in checks]


def set_the_stage(e):
    """carol parked, alice (the astronomy prompt) in slot 0, x in slot 1; carol's next turn."""
    carol = conv(GARDEN, "How do I grow roses?")
    carol += [e.chat(carol, session="carol", max_tokens=6, temperature=0).message,
              {"role": "user", "content": "And tulips?"}]
    e.chat(conv(CALC, "2+2"), session="x", max_tokens=4, temperature=0)
    e.chat(conv(ASTRO, "What is the moon?"), session="alice", max_tokens=40, temperature=0)
    e.settle()
    assert [s.session for s in e.slots()] == ["alice", "x"]
    assert [i.session for i in e.parked()] == ["carol"]
    return carol


@pytest.mark.parametrize("family, tier", [
    ("smollm2", "ram"), ("smollm2", "disk"),
    pytest.param("lfm2", "ram", marks=pytest.mark.slow)])
def test_a_copy_and_a_restore_admitted_in_one_pass_both_get_their_own_kv(family, tier,
                                                                         tmp_path):
    path = model_for(family)
    parking = {"park_ram": 0, "park_dir": str(tmp_path)} if tier == "disk" else {}
    with Engine(path, n_slots=2, n_ctx=1024, cache_min_tokens=20, **parking) as e, \
            Engine(path, n_slots=1, n_ctx=1024, cache="off") as off:
        carol = set_the_stage(e)
        bob = conv(ASTRO, "What is Jupiter?")
        passes = []
        unsub = e.subscribe(lambda ev: isinstance(ev, RequestStarted) and passes.append(
            (ev.record.session, len(e.core.queue))))
        with e.hold_admission():
            streams = e.chat_many([bob, carol], ["bob", "carol"], stream=True, max_tokens=8,
                                  temperature=0)
        rb, rc = (s.result() for s in streams)
        unsub()
        # bob started while both were still queued: carol's admission was in the same pass
        assert passes[0] == ("bob", 2)
        assert rb.record.donor_session == "alice" and rb.record.slot == 1 and rb.record.exact
        assert (rc.record.restored_from, rc.record.slot) == (tier, 0)
        assert rb.text == off.chat(bob, max_tokens=8, temperature=0).text
        assert rc.text == off.chat(carol, max_tokens=8, temperature=0).text
        verified(e)
        bob += [rb.message, {"role": "user", "content": "And Saturn?"}]
        again = e.chat(bob, session="bob", max_tokens=8, temperature=0)
        assert again.text == off.chat(bob, max_tokens=8, temperature=0).text
        verified(e)


def test_the_kv_layer_refuses_a_state_write_into_a_copy_that_waits(model_path):
    """The guard below the order: a write into a copy's source, or a read of its
    destination, before the next decode raises instead of serving the wrong KV."""
    with Engine(model_path, n_slots=2, n_ctx=512) as e:
        e.chat(conv(ASTRO, "What is the moon?"), session="alice", max_tokens=4, temperature=0)
        e.settle()

        def race():
            ctx, src = e.ctx, e.table[0].kv
            state = ctx.state_get(0)
            e.table[1].kv.copy_from(src, len(src) - 5)
            assert ctx.copy_queued(0) and ctx.copy_queued(1)
            errors = []
            for act in (lambda: ctx.state_set(0, state), lambda: ctx.state_get(1)):
                try:
                    act()
                except KVOrderError as err:
                    errors.append(str(err))
            batch = Batch(2)  # any decode runs the queued copy
            batch.add(int(src.tokens[-1]), len(src), 0, False)
            ctx.decode(batch)
            batch.close()
            ctx.try_seq_rm(0, len(src), -1)
            return errors, ctx.copy_queued(0), ctypes.sizeof(ctx.state_get(1)) > 0

        errors, still, readable = e.core.call(race)
        assert len(errors) == 2 and "copy" in errors[0] and "copy" in errors[1]
        assert not still and readable
        verified(e)


def test_a_copy_whose_request_ends_before_its_first_decode_still_runs(model_path):
    """Cancelled as it starts: nothing else will decode, so the copy is run at once, and a
    restore into the donor then proceeds (it does not wait for ever)."""
    with Engine(model_path, n_slots=2, n_ctx=1024, cache_min_tokens=20) as e, \
            Engine(model_path, n_slots=1, n_ctx=1024, cache="off") as off:
        carol = set_the_stage(e)
        bob = conv(ASTRO, "What is Jupiter?")
        streams = []

        def cancel_bob(ev):
            if isinstance(ev, RequestStarted) and ev.record.session == "bob":
                streams[0]._job.cancel.set()

        unsub = e.subscribe(cancel_bob)
        with e.hold_admission():
            streams.extend(e.chat_many([bob, carol], ["bob", "carol"], stream=True,
                                       max_tokens=8, temperature=0))
        rb, rc = streams[0].result(), streams[1].result()
        unsub()
        assert rb.record.finish_reason == "cancelled" and rb.record.donor_session == "alice"
        assert rc.record.restored_from == "ram"
        assert rc.text == off.chat(carol, max_tokens=8, temperature=0).text
        verified(e)
        again = e.chat(bob, session="bob", max_tokens=8, temperature=0)
        assert again.text == off.chat(bob, max_tokens=8, temperature=0).text
        verified(e)
