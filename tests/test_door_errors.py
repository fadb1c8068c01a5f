"""Bad input gets a named error at the door (issue 32, items 7-9): paths and types checked
before a model loads, tokens inside the vocabulary, content parts, finite sampling numbers,
an empty save path. Each case raised a raw Python error (or was silently accepted) before."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import assert_consistent
from nbkv import Engine
from nbkv.core.errors import InvalidRequestError
from nbkv.llama.tokens import SamplingParams
from nbkv.notebook.sessions import SessionStore

Q = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture()
def no_model(monkeypatch):
    """Fail the test if the engine gets as far as loading a model."""
    import nbkv.engine.facade as facade

    def refuse(*a, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(facade, "Resources", refuse)


def _paths(tmp_path):
    (tmp_path / "file").write_text("x")
    return {"file": str(tmp_path / "file"), "under": str(tmp_path / "file" / "parked")}


@pytest.mark.parametrize("kwargs, message", [
    ({"model_path": 123}, "model_path must be a non-empty path"),
    ({"model_path": ""}, "model_path must be a non-empty path"),
    ({"mmproj": 5}, "mmproj must be a non-empty path"),
    ({"park_dir": 123}, "park_dir must be a non-empty path"),
    ({"park_dir": ""}, "park_dir must be a non-empty path"),
    ({"park_dir": "file"}, "is a file"),
    ({"park_dir": "under"}, "lies under the file"),
    ({"template": 7}, "template must be a Jinja2 chat template"),
])
def test_paths_and_types_are_refused_before_the_model_loads(no_model, tmp_path, kwargs,
                                                            message):
    paths = _paths(tmp_path)
    kwargs = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(InvalidRequestError, match=message):
        Engine(n_slots=1, n_ctx=256, **kwargs)


def test_sampling_numbers_must_be_finite():
    for name, value in [("temperature", math.inf), ("temperature", math.nan),
                        ("top_p", math.inf), ("min_p", math.nan),
                        ("repeat_penalty", math.inf)]:
        with pytest.raises(InvalidRequestError, match=f"{name} must be a finite number"):
            SamplingParams.from_kwargs(**{name: value})
    SamplingParams.from_kwargs(temperature=1e6)  # large, but a number


# -- on the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_slots=2, n_ctx=512, n_threads=2) as e:
        yield e


def test_probe_takes_token_ids_of_the_vocabulary_only(engine):
    engine.chat(Q, max_tokens=2, temperature=0)
    n_vocab = engine.model.n_vocab
    for bad in ("a", -1, n_vocab, 10**6, True, 1.5, None):
        with pytest.raises(InvalidRequestError, match="token id in 0"):
            engine.probe(0, bad)
    with pytest.raises(InvalidRequestError, match="probe must be a token id"):
        engine.verify(probe=n_vocab)
    assert np.isfinite(engine.probe(0, n_vocab - 1)).all()  # the last id is one
    assert all(v.identical for v in engine.verify())
    assert_consistent(engine)


@pytest.mark.parametrize("content, message", [
    ([], "content is an empty list"),
    ([{"type": "audio", "audio": "x"}], "unknown content part type 'audio'"),
    ([{"type": "text", "text": "a"}, {"type": "file"}], r"content\[1\]: unknown content part"),
    ([{"type": "text"}], "a text part needs a str 'text'"),
    ([{"type": "text", "text": 5}], "a text part needs a str 'text'"),
])
def test_malformed_content_parts_are_named(engine, content, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        engine.chat([{"role": "user", "content": content}], max_tokens=2)
    assert "TypeError" not in str(err.value)  # not the template's own failure
    with pytest.raises(InvalidRequestError, match=message):
        engine.render([{"role": "user", "content": content}])


def test_text_parts_are_the_text_they_hold(engine):
    """OpenAI-style text parts: the same prompt, and reply, as the plain string."""
    parts = [{"type": "text", "text": "Name a "}, "fruit", {"type": "text", "text": "."}]
    assert engine.tokenize_prompt([{"role": "user", "content": parts}]) == \
        engine.tokenize_prompt(Q)
    engine.clear()
    want = engine.chat(Q, max_tokens=6, temperature=0).text
    engine.clear()
    assert engine.chat([{"role": "user", "content": parts}], max_tokens=6,
                       temperature=0).text == want


def test_sampling_inf_is_refused_by_the_engine(engine):
    with pytest.raises(InvalidRequestError, match="temperature must be a finite number"):
        engine.chat(Q, max_tokens=2, temperature=math.inf)


def test_an_empty_save_path_is_refused_not_the_current_directory(engine, tmp_path,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine.chat(Q, max_tokens=2, temperature=0)
    for bad in ("", 123):
        with pytest.raises(InvalidRequestError, match="non-empty path"):
            engine.save(bad, SessionStore())
        with pytest.raises(InvalidRequestError, match="non-empty path"):
            engine.restore(bad, SessionStore())
    assert list(tmp_path.iterdir()) == []


def test_a_load_with_a_park_dir_under_a_file_keeps_the_engine(tmp_path, monkeypatch):
    """Checked before the engine it would replace is closed: nothing is lost."""
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    from nbkv.notebook.magics import Nbkv

    paths = _paths(tmp_path)
    store = SessionStore()
    m = Nbkv(shell=None, store=store, frontend="terminal", max_tokens=4)
    try:
        m.kvcache("load --slots 1 --ctx 256")
        engine = store.engine
        with capture_output():
            m.chat("alice", "Name a fruit.")
        for where in ("file", "under"):
            with pytest.raises(UsageError, match="park_dir .* (is a file|lies under the file)"):
                m.kvcache(f"load --slots 1 --ctx 256 --park-dir {paths[where]}")
            assert store.engine is engine and not engine.closed
        with capture_output():
            m.chat("alice", "And a colour?")
        assert store["alice"].records[-1].strategy == "hash-extend"
        m.park_dir = paths["under"]  # %config Nbkv.park_dir: checked the same way
        with pytest.raises(UsageError, match="lies under the file"):
            m.kvcache("load --slots 1 --ctx 256")
        assert store.engine is engine and not engine.closed
    finally:
        m.kvcache("unload")

