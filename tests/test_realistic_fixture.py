"""The realistic model fixture (``nbkv.fixtures.realistic``): a Qwen2 GGUF at a size people
run, in Q4_K_M. Tested on a one-layer, 256-wide spec of the same code (the 1.5B default is the
bench's); nothing is decoded here."""

from __future__ import annotations

import pytest

from nbkv.fixtures.gguf_scan import _scan_gguf
from nbkv.fixtures.realistic import realistic_model, realistic_spec

SMALL = dict(n_layer=1, n_embd=256, n_head=2, n_head_kv=1, n_ff=512)


def test_defaults_are_qwen2_5_1_5b_shaped():
    spec = realistic_spec()
    assert (spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv, spec.n_ff, spec.n_vocab,
            spec.ftype) == (28, 1536, 12, 2, 8960, 151936, "Q4_K_M")


def test_small_spec_written_quantized_and_cached(tmp_path):
    spec = realistic_spec(**SMALL)
    path = realistic_model(spec, tmp_path)
    kv, end = _scan_gguf(path, lambda k: not k.startswith("tokenizer.ggml.merges"))
    assert end <= path.stat().st_size
    assert kv["general.architecture"][2] == "qwen2"
    assert kv["general.file_type"][2] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert kv["qwen2.block_count"][2] == 1 and kv["qwen2.attention.head_count_kv"][2] == 1
    tokens = kv["tokenizer.ggml.tokens"][2]
    types = kv["tokenizer.ggml.token_type"][2]
    assert len(tokens) == len(types) == spec.n_vocab
    assert tokens[-1] == f"[PAD{spec.n_vocab - 1}]" and types[-1] == 5  # unused, never special
    assert kv["nbkv.fixture.digest"][2] == spec.digest
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no F16 or temp left
    mtime = path.stat().st_mtime_ns
    assert realistic_model(spec, tmp_path) == path and path.stat().st_mtime_ns == mtime


def test_loads_in_llama_cpp_and_tokenizes_like_smollm2(tmp_path):
    from nbkv.llama.backend import Model
    from nbkv.llama.models import default_model_path

    path = realistic_model(realistic_spec(**SMALL), tmp_path)
    model, smol = Model(path), Model(default_model_path())
    try:
        assert model.n_vocab == 151936
        text = "<|im_start|>user\nHello, world!<|im_end|>"
        assert model.tokenize(text) == smol.tokenize(text)
    finally:
        model.close()
        smol.close()


def test_k_quant_needs_256_wide_rows(tmp_path):
    with pytest.raises(ValueError, match="multiples of 256"):
        realistic_model(realistic_spec(**{**SMALL, "n_ff": 500}), tmp_path)
