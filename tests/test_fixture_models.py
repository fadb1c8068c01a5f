"""The generated tiny text models (``nbkv.fixtures.make_text_model``) load in llama.cpp as the
memory class they stand for, with SmolLM2's tokenizer, and say varied things."""

from __future__ import annotations

import hashlib

import pytest

from nbkv import fixtures
from nbkv.llama.backend import Batch, Context, Model
from nbkv.llama.models import default_model_path

# (is_recurrent, is_hybrid, n_swa) as llama.cpp reports them
EXPECTED = {
    "gemma3": (False, False, 8),
    "lfm2": (False, True, 0),
    "mamba2": (True, False, 0),
    "granitehybrid": (False, True, 0),
}
TEXT = "The quick brown fox jumps over the lazy dog, and the cat watches from the window."


@pytest.fixture(scope="session")
def text_models():
    """Every family's file, generated once (then cached across sessions)."""
    return {family: fixtures.make_text_model(family) for family in fixtures.TEXT_FAMILIES}


@pytest.fixture(scope="session")
def smollm2():
    model = Model(default_model_path())
    yield model
    model.close()


def test_every_family_is_covered():
    assert set(EXPECTED) == set(fixtures.TEXT_FAMILIES)


@pytest.mark.parametrize("family", fixtures.TEXT_FAMILIES)
def test_memory_class(text_models, smollm2, family):
    path = text_models[family]
    assert 5e6 < path.stat().st_size < 20e6
    model = Model(path)
    try:
        assert (model.is_recurrent, model.is_hybrid, model.n_swa) == EXPECTED[family]
        assert model.n_vocab == smollm2.n_vocab == 49152
        assert model.tokenize(TEXT) == smollm2.tokenize(TEXT)
        assert model.chat_template == smollm2.chat_template
        assert model.eos_text == smollm2.eos_text

        # greedy decoding: a prompt in one batch, then token by token; the tokens vary
        ctx = Context(model, n_ctx=1024, n_seq_max=2, n_batch=256, n_threads=2)
        batch = Batch(256)
        try:
            prompt = model.tokenize(TEXT)
            last = batch.add_run(prompt, 0, 0, logits_last=True)
            generated = []
            for step in range(8):
                ctx.decode(batch)
                logits = ctx.logits(last)
                generated.append(max(range(model.n_vocab), key=logits.__getitem__))
                batch.clear()
                last = batch.add(generated[-1], len(prompt) + step, 0, True)
            assert len(set(generated)) >= 4, generated
        finally:
            batch.close()
            ctx.close()
    finally:
        model.close()


def test_cached_and_deterministic(text_models, tmp_path):
    """Same parameters, same bytes; a truncated file is rewritten; the seed changes weights."""
    cached = text_models["mamba2"]
    fresh = fixtures.make_text_model("mamba2", cache_dir=tmp_path)
    assert fresh.name == cached.name
    assert fresh.read_bytes() == cached.read_bytes()
    assert fixtures.make_text_model("mamba2", cache_dir=tmp_path) == fresh  # reused

    digest = hashlib.sha256(fresh.read_bytes()).hexdigest()
    with open(fresh, "r+b") as f:
        f.truncate(fresh.stat().st_size - 1000)
    again = fixtures.make_text_model("mamba2", cache_dir=tmp_path)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == digest

    other = fixtures.make_text_model("mamba2", seed=1, cache_dir=tmp_path)
    assert other != again and other.read_bytes() != again.read_bytes()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".gguf", ".gguf"]  # no temp left


def test_unknown_family():
    with pytest.raises(ValueError, match="family must be one of"):
        fixtures.make_text_model("transformer-xl")
