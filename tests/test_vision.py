"""Media-aware IMC on the real pipeline: SmolLM2-135M + a generated (tiny, mlp) projector."""

from __future__ import annotations

import datetime
import io

import numpy as np
import pytest

from conftest import assert_consistent
from nbkv import Engine, policy, templates
from nbkv.errors import MediaError, ProjectorError
from nbkv.fixtures import make_mmproj

PIL = pytest.importorskip("PIL.Image")
MAX = 8
SYSTEM = "You describe pictures for a blind user. Be brief and concrete."


def picture(seed, size=32):
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, size, dtype=np.uint8)
    a = np.stack([np.add.outer(base, base) // 2, np.tile(base, (size, 1)),
                  rng.integers(0, 256, (size, size), dtype=np.uint8)], axis=-1)
    return a.astype(np.uint8)


def png(a):
    buf = io.BytesIO()
    PIL.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def image_msg(text, img):
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image", "image": img}]}


@pytest.fixture(scope="module")
def mmproj():
    return str(make_mmproj(kind="tiny"))


@pytest.fixture(scope="module")
def engine(model_path, mmproj):
    with Engine(model_path, mmproj=mmproj, n_slots=2, n_ctx=1024, n_threads=1) as e:
        yield e


def scratch(model_path, mmproj, messages, template=None):
    with Engine(model_path, mmproj=mmproj, n_slots=1, n_ctx=1024, cache="off",
                template=template, n_threads=1) as e:
        r = e.chat(messages, max_tokens=MAX, temperature=0)
        assert r.record.encoder_runs >= 1 or r.record.media_chunks == 0
        return r.text


def talk(engine, msgs, text_or_msg, session):
    msgs.append(text_or_msg if isinstance(text_or_msg, dict)
                else {"role": "user", "content": text_or_msg})
    r = engine.chat(msgs, session=session, max_tokens=MAX, temperature=0)
    msgs.append(r.message)
    return r


def test_image_conversation_matches_scratch_and_encodes_once(engine, model_path, mmproj, tmp_path):
    engine.clear()
    path = tmp_path / "pic.png"
    path.write_bytes(png(picture(1)))
    msgs = [{"role": "system", "content": SYSTEM}]
    first = {"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": str(path)}}]}
    records = []
    for turn in (first, "Describe its colours.", "What is two plus two?", "Back to the picture: "
                 "is it bright?"):
        r = talk(engine, msgs, turn, "pics")
        assert r.text == scratch(model_path, mmproj, msgs[:-1]), f"turn {len(records) + 1}"
        records.append(r.record)
        assert_consistent(engine)
    assert records[0].encoder_runs + records[0].embedding_cache_hits == 1
    assert records[0].media_chunks == 1 and records[0].media_reused == 0
    for r in records[1:]:
        assert r.strategy == policy.HASH_EXTEND
        assert r.encoder_runs == 0 and r.embedding_cache_hits == 0  # the image stays in KV
        assert r.media_chunks == 1 and r.media_reused == 1
        assert r.prefilled_tokens < 40
    images = [s for s in records[-1].segments if s.kind == "image"]
    assert len(images) == 1 and images[0].length == 16 and images[0].state == "reused"


def test_image_mid_conversation_keeps_the_text_prefix(engine, model_path, mmproj):
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}]
    for q in ("Hello!", "What can you do?"):
        talk(engine, msgs, q, "mid")
    before = engine.slots()
    held = next(s.n_tokens for s in before if s.session == "mid")
    r = talk(engine, msgs, image_msg("Now look at this.", picture(2)), "mid")
    assert r.text == scratch(model_path, mmproj, msgs[:-1])
    assert r.record.strategy == policy.HASH_EXTEND
    assert r.record.reused_tokens >= held - 2  # the text conversation was not re-decoded
    assert r.record.encoder_runs == 1
    r2 = talk(engine, msgs, "And the corners?", "mid")
    assert r2.text == scratch(model_path, mmproj, msgs[:-1])
    assert r2.record.encoder_runs == 0 and r2.record.media_reused == 1
    # a second image extends the slot too: no rebuild, one more encode
    r3 = talk(engine, msgs, image_msg("Compare with this one.", picture(3)), "mid")
    assert r3.text == scratch(model_path, mmproj, msgs[:-1])
    assert r3.record.strategy == policy.HASH_EXTEND and r3.record.encoder_runs == 1
    assert r3.record.media_chunks == 2 and r3.record.media_reused == 1
    assert r3.record.reused_tokens > r2.record.prompt_tokens - 2
    assert_consistent(engine)


def test_embedding_cache_skips_the_encoder_after_eviction(model_path, mmproj):
    with Engine(model_path, mmproj=mmproj, n_slots=1, n_ctx=1024, n_threads=1) as e:
        a = [{"role": "system", "content": SYSTEM}]
        r1 = talk(e, a, image_msg("What is this?", picture(4)), "a")
        assert r1.record.encoder_runs == 1
        b = [{"role": "system", "content": "Unrelated assistant."}]
        talk(e, b, "Hi there", "b")  # evicts a's conversation (one slot)
        r3 = talk(e, a, "Tell me more.", "a")
        assert r3.record.evicted_session == "b"
        assert r3.record.encoder_runs == 0 and r3.record.embedding_cache_hits == 1
        assert r3.text == scratch(model_path, mmproj, a[:-1])
        c = [{"role": "system", "content": "Another one."}]
        r4 = talk(e, c, image_msg("Same picture, other session.", picture(4)), "c")
        assert r4.record.encoder_runs == 0 and r4.record.embedding_cache_hits == 1
        assert_consistent(e)


# the user turn carries the time it was sent: every rendering differs *after* the image
SENT_AT = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% if loop.last and m['role'] == 'user' %}"
    "{{ ' (sent ' + strftime_now('%H:%M:%S') + ')' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_prefix_salvage_keeps_the_image(model_path, mmproj, monkeypatch):
    now = {"t": datetime.datetime(2026, 1, 1, 9, 0, 0)}
    monkeypatch.setattr(templates, "_now", lambda: now["t"])
    with Engine(model_path, mmproj=mmproj, n_slots=2, n_ctx=1024, template=SENT_AT,
                cache_min_tokens=20, n_threads=1) as e:
        msgs = [{"role": "system", "content": SYSTEM}, image_msg("What is this?", picture(5))]
        e.chat(msgs, session="s", max_tokens=MAX, temperature=0)
        now["t"] += datetime.timedelta(seconds=13)
        # regenerate: same messages, but the time after the image renders differently
        r = e.chat(msgs, session="s", max_tokens=MAX, temperature=0)
        assert r.record.strategy == policy.PREFIX_SALVAGE
        assert r.record.media_reused == 1 and r.record.encoder_runs == 0
        assert r.text == scratch(model_path, mmproj, msgs, template=SENT_AT)
        assert_consistent(e)


def test_bad_images_leave_everything_unchanged(engine, tmp_path):
    before = engine.slots()
    corrupt = tmp_path / "broken.png"
    corrupt.write_bytes(png(picture(6))[:40])
    for part, match in [
        ({"type": "image_url", "image_url": {"url": str(corrupt)}}, None),
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "network"),
        ({"type": "image_url", "image_url": {"url": str(tmp_path / "missing.png")}}, None),
        ({"type": "image", "image": b"not an image"}, None),
    ]:
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Look"}, part]}]
        with pytest.raises(MediaError, match=match):
            engine.chat(msgs, max_tokens=2)
    assert engine.slots() == before
    assert_consistent(engine)


def test_image_in_a_text_only_engine(model_path):
    with Engine(model_path, n_slots=1, n_ctx=512) as e:
        with pytest.raises(MediaError, match="no vision projector"):
            e.chat([image_msg("What is this?", picture(7))])
        assert e.chat([{"role": "user", "content": "hi"}], max_tokens=2).text is not None


def test_wrong_projectors_are_refused_before_native_code(model_path):
    with pytest.raises(ProjectorError, match="fake_token_around_image"):
        Engine(model_path, mmproj=str(make_mmproj(kind="tiny", projector="idefics3")))
    with pytest.raises(ProjectorError):
        Engine(model_path, mmproj=str(make_mmproj(kind="tiny", text_width=960)))
    with pytest.raises(ProjectorError):
        Engine(model_path, mmproj=model_path)  # a text model is not a projector


def test_other_sessions_keep_generating_while_an_image_is_encoded(engine, monkeypatch):
    """The encoder runs on its own thread: a slow encode holds up only its own request."""
    import threading
    import time

    engine.clear()
    window = {}
    encode = engine.projector.embedding

    def slow(*a, **kw):
        window["start"] = time.perf_counter()
        time.sleep(1.5)
        try:
            return encode(*a, **kw)
        finally:
            window["end"] = time.perf_counter()

    monkeypatch.setattr(engine.projector, "embedding", slow)
    text = engine.chat([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Count slowly from one to forty."}],
                       session="text", stream=True, max_tokens=40, temperature=0)
    first = next(iter(text))
    deltas = []
    reader = threading.Thread(target=lambda: deltas.extend((time.perf_counter(), d) for d in text))
    reader.start()
    pic = picture(99)  # never seen: not in the embedding cache
    r = engine.chat([{"role": "system", "content": SYSTEM}, image_msg("What is this?", pic)],
                    session="image", max_tokens=4, temperature=0)
    reader.join(60)
    assert first and r.record.encoder_runs == 1
    during = [t for t, _ in deltas if window["start"] < t < window["end"]]
    assert len(during) >= 3, (len(deltas), window)
    assert_consistent(engine)


def test_cancel_while_the_image_is_encoded(engine, monkeypatch):
    import time

    engine.clear()
    started = []
    encode = engine.projector.embedding

    def slow(*a, **kw):
        started.append(time.perf_counter())
        time.sleep(0.8)
        return encode(*a, **kw)

    monkeypatch.setattr(engine.projector, "embedding", slow)
    msgs = [{"role": "system", "content": SYSTEM}, image_msg("And this?", picture(123))]
    s = engine.chat(msgs, session="gone", stream=True, max_tokens=4, temperature=0)
    deadline = time.monotonic() + 30
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()  # cancelled while the encoder works
    assert s.finish_reason == "cancelled"
    assert_consistent(engine)
    monkeypatch.undo()
    engine._encoder.submit(lambda: None).result()  # the encode went on and was cached
    r = engine.chat(msgs, session="gone", max_tokens=4, temperature=0)
    assert r.record.encoder_runs == 0 and r.record.embedding_cache_hits == 1
    assert_consistent(engine)


def test_an_encoder_failure_fails_only_its_request(engine, monkeypatch):
    engine.clear()

    def broken(*a, **kw):
        raise MediaError("the vision encoder failed on a test image (code 1)")

    monkeypatch.setattr(engine.projector, "embedding", broken)
    msgs = [{"role": "system", "content": SYSTEM}, image_msg("What now?", picture(321))]
    with pytest.raises(MediaError, match="vision encoder failed"):
        engine.chat(msgs, session="broken", max_tokens=4, temperature=0)
    assert engine.history[-1].finish_reason == "error"
    assert_consistent(engine)
    monkeypatch.undo()
    r = engine.chat(msgs, session="broken", max_tokens=4, temperature=0)
    assert r.record.encoder_runs == 1 and r.finish_reason in ("stop", "length")
    assert_consistent(engine)
