"""Hardware and memory options: KV types, flash attention, GPU offload, the memory plan."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from conftest import QUESTIONS, SYSTEM, assert_consistent, fresh_probe, scratch_reply
from nbkv import Engine
from nbkv.core.config import HardwareSettings
from nbkv.core.errors import InsufficientMemoryError, InvalidRequestError
from nbkv.llama import memplan
from nbkv.llama.hardware import devices, gpu_offload, kv_type_id
from nbkv.ui.display import status_table

MAX = 8
Q8 = dict(type_k="q8_0", type_v="q8_0", flash_attn="on")


def converse(engine, sessions=("a", "b"), turns=3):
    """Interleaved sessions sharing a system prompt: extends, copies and salvage."""
    convs = {s: [{"role": "system", "content": SYSTEM}] for s in sessions}
    replies = []
    for t in range(turns):
        for i, s in enumerate(sessions):
            convs[s].append({"role": "user", "content": QUESTIONS[(t + i) % len(QUESTIONS)]})
            r = engine.chat(convs[s], s, max_tokens=MAX, temperature=0)
            replies.append((list(convs[s]), r.text))
            convs[s].append(r.message)
    return replies


@pytest.mark.parametrize("settings", [Q8, dict(type_k="q8_0", type_v="f16", flash_attn="off")],
                         ids=["q8_0-kv-flash-attn", "q8_0-k-only"])
def test_quantized_kv_keeps_the_oracle(model_path, settings):
    """Cached replies equal fresh ones, and every slot's KV equals a from-scratch decode."""
    with Engine(model_path, n_slots=2, n_ctx=1024, exact=True, **settings) as e:
        assert e.ctx.params.type_k == kv_type_id(settings["type_k"])
        assert e.ctx.params.type_v == kv_type_id(settings["type_v"])
        assert e.ctx.params.flash_attn_type == (1 if settings["flash_attn"] == "on" else 0)
        replies = converse(e)
        assert any(r.reused_tokens for r in e.history[1:])
        for msgs, text in replies[-2:]:
            assert text == scratch_reply(model_path, msgs, max_tokens=MAX, **settings)
        assert_consistent(e)
        context = dict(type_k=kv_type_id(settings["type_k"]),
                       type_v=kv_type_id(settings["type_v"]),
                       flash_attn=1 if settings["flash_attn"] == "on" else 0)
        for s in e.slots():
            probe = 42
            got = np.array(e.probe(s.index, probe), dtype=np.float32)
            want = fresh_probe(e.model, [t for t in s.tokens], probe, **context)
            assert np.array_equal(got, want), f"slot {s.index}: KV differs from a fresh decode"


def test_flash_attention_with_f16_kv_is_refused_under_exact(model_path):
    with pytest.raises(InvalidRequestError, match="quantized type_k and type_v"):
        Engine(model_path, flash_attn="on")
    with pytest.raises(InvalidRequestError, match="needs flash attention"):
        Engine(model_path, type_v="q8_0")
    with pytest.raises(InvalidRequestError, match="type_k must be one of"):
        Engine(model_path, type_k="q3_weird")
    # auto picks what keeps exactness: off with f16, on with quantized K and V
    assert HardwareSettings(flash_attn="auto").resolved_flash_attn(exact=True) == "off"
    assert HardwareSettings(flash_attn="auto", type_k="q8_0", type_v="q8_0"
                           ).resolved_flash_attn(exact=True) == "on"


def test_options_reach_llama_cpp_and_status_shows_them(model_path):
    with Engine(model_path, n_slots=2, n_ctx=512, use_mmap=False, **Q8) as e:
        assert e.model.params.load_mode == 0  # LLAMA_LOAD_MODE_NONE: read, not mapped
        assert e.model.params.n_gpu_layers == 0  # this build: CPU only
        assert e.model.params.split_mode == 1  # layer
        rows = dict(status_table(e).rows)
        assert rows["devices"].startswith("CPU") and "no GPU backend" in rows["offload"]
        assert "K q8_0, V q8_0" in rows["KV cache"] and "flash attention on" in rows["KV cache"]
        assert rows["KV memory"].startswith(f"{e.plan.per_slot / 2**20:.1f} MiB per slot")
    assert not gpu_offload() and devices()[0].kind == "cpu"


def test_gpu_layers_on_a_cpu_build_warn_in_one_line(model_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Engine(model_path, n_slots=1, n_ctx=256, n_gpu_layers=10) as e:
            assert e.model.params.n_gpu_layers == 0
    msgs = [str(w.message) for w in caught]
    assert msgs == ["n_gpu_layers=10: this llama.cpp build has no GPU backend, so every layer "
                    "runs on the CPU"]


@pytest.mark.parametrize("family", ["smollm2", "gemma3", "lfm2", "mamba2", "granitehybrid"])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_memory_plan_matches_what_llama_cpp_allocates(family, kv):
    from conftest import default_model_path
    from nbkv.fixtures import make_text_model

    path = default_model_path() if family == "smollm2" else make_text_model(family)
    settings = dict(type_k=kv, type_v=kv, flash_attn="on" if kv != "f16" else "off")
    with Engine(str(path), n_slots=3, n_ctx=1024, exact=False, **settings) as e:
        actual = e.ctx.kv_buffer_bytes
        assert actual > 0
        # llama.cpp logs its buffers in MiB with two decimals: allow that rounding too
        assert abs(e.plan.total - actual) <= max(0.05 * actual, 0.006 * 2**20), (
            e.plan.describe(), actual)


def test_a_plan_that_cannot_fit_is_refused_before_allocation(model_path, monkeypatch):
    monkeypatch.setattr(memplan, "free_memory", lambda: 64 * 2**20)  # a 64 MiB machine
    with pytest.raises(InsufficientMemoryError) as err:
        Engine(model_path, n_slots=8, n_ctx=8192)
    msg = str(err.value)
    assert "the KV cache would need 1.58 GiB" in msg and "64.0 MiB of RAM is free" in msg
    assert "(+1 for the reply rewrite)" in msg  # the shadow sequence (exact mode)
    assert "quantized KV type" in msg and "slot(s) of 8192 tokens" not in msg
    # the real machine: far more than free RAM is refused too, and nothing was allocated
    monkeypatch.undo()
    huge = memplan.free_memory() // (23 * 1024) + 1  # tokens of 23 KiB that exceed free RAM
    with pytest.raises(InsufficientMemoryError, match="free"):
        Engine(model_path, n_slots=4, n_ctx=huge // 4 + 256)


def test_default_size_follows_the_plan():
    from conftest import default_model_path
    from nbkv.llama.gguf_header import read_metadata

    meta = read_metadata(default_model_path())
    assert memplan.default_size(meta, 24 * 2**30) == (4, 4096)
    assert memplan.default_size(meta, 400 * 2**20) == (2, 2048)  # 94 MiB of 100
    assert memplan.default_size(meta, 300 * 2**20) == (2, 1024)
    assert memplan.default_size(meta, 1) == (1, 512)


def test_kvcache_load_takes_hardware_options_and_picks_a_size(model_path, monkeypatch):
    from IPython.utils.capture import capture_output

    from nbkv.notebook.magics import Nbkv
    from nbkv.notebook.sessions import SessionStore

    monkeypatch.setenv("NBKV_SAVE_DIR", "/nonexistent-nbkv-saves")
    store = SessionStore()
    m = Nbkv(shell=None, store=store, frontend="terminal")
    try:
        with capture_output() as cap:
            m.kvcache("load --kv-type q8_0 --flash-attn on --slots 1 --ctx 512")
        e = store.engine
        assert (e.hardware.type_k, e.hardware.type_v, e.flash_attn) == ("q8_0", "q8_0", "on")
        assert not e.sized and "picked" not in cap.stdout
        with capture_output() as cap:
            m.kvcache("load")  # no size given: the memory plan picks one, and says so
        e = store.engine
        assert (e.n_slots, e.n_ctx) == (4, 4096)  # 24 GiB machines: the default fits
        # the note is computed from the plan: what the KV takes, and its share of free RAM
        assert re.search(r"picked slots and tokens per slot: 4 slots x 4096 tokens take "
                         r"[\d.]+ MiB of KV, \d+% of the [\d.]+ GiB of free RAM", cap.stdout)
    finally:
        m.kvcache("unload")


def test_a_save_restores_only_into_the_same_kv_types(model_path, tmp_path):
    from nbkv.core.errors import RestoreError
    from nbkv.store import persist

    with Engine(model_path, n_slots=1, n_ctx=512) as e:
        e.chat([{"role": "user", "content": "Hi"}], "s", max_tokens=2)
        persist.save(e, tmp_path / "save")
    with Engine(model_path, n_slots=1, n_ctx=512, **Q8) as e:
        with pytest.raises(RestoreError, match="KV layout"):
            persist.restore(e, tmp_path / "save")
        assert e.slots()[0].empty
