"""SPC, template drift (prefix salvage), and model loading errors, on the real model."""

from __future__ import annotations

import datetime

import pytest

from conftest import MAX_TOKENS, QUESTIONS, SYSTEM, assert_consistent, scratch_reply
from nbkv import Engine
from nbkv.core.errors import ModelLoadError, ModelNotFoundError
from nbkv.kv import policy
from nbkv.prompt import templates

TIMED = templates.CLOCK_CHATML  # renders the time: no two calls render alike


@pytest.fixture
def clock(monkeypatch):
    now = {"t": datetime.datetime(2026, 1, 1, 9, 0, 0)}
    monkeypatch.setattr(templates, "_now", lambda: now["t"])

    def tick(seconds=61):
        now["t"] += datetime.timedelta(seconds=seconds)

    return tick


def user(text):
    return {"role": "user", "content": text}


def test_template_drift_is_salvaged_by_token_prefix(model_path, clock):
    with Engine(model_path, n_slots=2, n_ctx=2048, template=TIMED) as e:
        msgs = [{"role": "system", "content": SYSTEM}]
        records = []
        for q in QUESTIONS[:4]:
            msgs.append(user(q))
            clock()  # a new minute: the system turn renders differently
            res = e.chat(msgs, session="drift", max_tokens=MAX_TOKENS, temperature=0)
            assert res.text == scratch_reply(model_path, msgs, template=TIMED)
            records.append(res.record)
            msgs.append(res.message)
            assert_consistent(e)
        sys_tokens = len(e.model.tokenize(SYSTEM))
        for r in records[1:]:
            assert r.strategy == policy.PREFIX_SALVAGE
            assert r.reused_tokens >= sys_tokens  # everything before the clock is kept
            assert r.trimmed_tokens > 0
            assert r.slot == records[0].slot and r.donor_slot is None
        # same minute: the rendering is stable again and the hash path extends
        msgs.append(user("Thanks!"))
        res = e.chat(msgs, session="drift", max_tokens=MAX_TOKENS, temperature=0)
        assert res.record.strategy == policy.HASH_EXTEND
        assert res.text == scratch_reply(model_path, msgs, template=TIMED)


def test_spc_restores_the_system_prompt(model_path):
    with Engine(model_path, n_slots=2, n_ctx=2048, cache="spc") as e:
        first = [{"role": "system", "content": SYSTEM}, user(QUESTIONS[0])]
        r1 = e.chat(first, max_tokens=MAX_TOKENS, temperature=0)
        assert r1.record.strategy == policy.MISS and r1.record.reused_tokens == 0
        assert e.stats()["spc_entries"] == 1
        for q in QUESTIONS[1:3]:
            msgs = [{"role": "system", "content": SYSTEM}, user(q)]
            res = e.chat(msgs, max_tokens=MAX_TOKENS, temperature=0)
            assert res.record.strategy == "spc"
            sys_len = len(e.tokenize_prompt(first[:1])) - 3  # minus the generation prompt
            assert res.record.reused_tokens >= sys_len - 2
            assert res.text == scratch_reply(model_path, msgs)
            assert_consistent(e)
        # another system prompt: a new entry; a short one: not cached at all
        other = [{"role": "system", "content": "Answer like a pirate. " + SYSTEM}, user("Hi")]
        assert e.chat(other, max_tokens=4).record.strategy == policy.MISS
        assert e.chat(other, max_tokens=4).record.strategy == "spc"
        short = [{"role": "system", "content": "Be brief."}, user("Hi")]
        e.chat(short, max_tokens=4)
        assert e.chat(short, max_tokens=4).record.strategy == policy.MISS
        assert e.stats()["spc_entries"] == 2


def test_cache_off_never_reuses(model_path):
    with Engine(model_path, n_slots=1, n_ctx=1024, cache="off") as e:
        msgs = [{"role": "system", "content": SYSTEM}, user("hi")]
        e.chat(msgs, max_tokens=2)
        r = e.chat(msgs, max_tokens=2).record
        assert r.strategy == "off" and r.reused_tokens == 0


def test_missing_and_corrupt_model_files(tmp_path, model_path):
    with pytest.raises(ModelNotFoundError, match="no model file"):
        Engine(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Engine(junk)
    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError):
        Engine(truncated)


def test_default_model_resolution(monkeypatch, tmp_path):
    from nbkv.llama import models

    monkeypatch.setenv("NBKV_MODEL", str(tmp_path / "x.gguf"))
    assert models.default_model_path() == tmp_path / "x.gguf"
    monkeypatch.delenv("NBKV_MODEL")
    assert models.default_model_path().name == models.DEFAULT_FILE
    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "no_such_package_nbkv")
    with pytest.raises(ModelNotFoundError, match=r"pip install 'nbkv\[model\]'"):
        models.default_model_path()
