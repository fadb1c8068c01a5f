"""The sequences the stateful simulation (``tests/test_stateful.py``) shrank to, kept as
plain tests named for what they show (each failed on the code before its fix)."""

from __future__ import annotations

import pytest
from test_parking_engine import N_CTX

from nbkv import Engine
from nbkv.core.events import ParkingDropped
from nbkv.llama.models import default_model_path


@pytest.fixture(scope="module")
def model():
    return str(default_model_path())


def test_close_announces_what_it_could_not_spill(model, tmp_path):
    """Found: start with a disk budget smaller than one conversation, chat once (unnamed),
    reopen. ``close()`` could not write the slot's conversation to disk: a listener must
    hear it (a ``ParkingDropped``), else the conversation is lost without a word."""
    heard = []
    with Engine(model, n_slots=2, n_ctx=N_CTX, park_ram=40 << 10, park_dir=str(tmp_path),
                park_disk=400 << 10) as e:
        e.subscribe(lambda ev: isinstance(ev, ParkingDropped) and heard.append(ev))
        e.chat([{"role": "system", "content": "You are a chef."},
                {"role": "user", "content": "And memory?"}], max_tokens=3, temperature=0)
    assert [(ev.session, ev.tier) for ev in heard] == [(None, "ram")]
    assert "larger than the whole disk budget" in heard[0].why
    with Engine(model, n_slots=3, n_ctx=N_CTX, park_ram=0, park_dir=str(tmp_path)) as again:
        assert again.parked() == ()
