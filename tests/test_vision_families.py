"""Media-aware IMC on other vision families: generated text model + projector pairs.

Each pair is a tiny random-weight text model (``nbkv.fixtures.make_text_model``) with a tiny
projector of the matching type and width (``make_mmproj(text_width=64)``). The flows are the
ones tests/test_vision.py runs on SmolLM2 + mlp: cached replies equal fresh ones (greedy),
every slot's KV matches its record, one encoder run per distinct image.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import pytest

from conftest import assert_consistent, talk
from nbkv import Engine
from nbkv.core.errors import ProjectorError
from nbkv.fixtures import make_mmproj, make_text_model
from nbkv.kv import policy
from nbkv.llama.backend import Batch, Context

pytest.importorskip("PIL.Image")
MAX = 6
SYSTEM = "You describe pictures. Be brief."

#: (text family, projector type): the pairs nbkv serves with exact caching
PAIRS = [("gemma3", "gemma3"), ("lfm2", "lfm2"), ("llama", "idefics3"),
         ("qwen2vl", "qwen2vl_merger"), ("qwen2vl", "qwen2.5vl_merger"),
         ("qwen3vl", "qwen3vl_merger")]
#: image chunks libmtmd makes of one 32-px picture (idefics3: an overview and one slice)
CHUNKS = {"gemma3": 1, "lfm2": 1, "idefics3": 2, "qwen2vl_merger": 1, "qwen2.5vl_merger": 1,
          "qwen3vl_merger": 1}


def picture(seed, size=32):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def image_msg(text, img):
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image", "image": img}]}


@pytest.fixture(scope="module", params=PAIRS, ids=lambda p: f"{p[0]}+{p[1]}")
def pair(request):
    family, proj = request.param
    return str(make_text_model(family, vision=proj)), str(make_mmproj(kind="tiny", projector=proj,
                                                         text_width=64))


def pair_type(pair):
    return next(p for _, p in PAIRS if f"-{p}-" in pair[1])


@pytest.fixture(scope="module")
def engine(pair):
    text, mmproj = pair
    with Engine(text, mmproj=mmproj, n_slots=2, n_ctx=1024, n_threads=1) as e:
        yield e


def scratch(pair, messages):
    text, mmproj = pair
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=1024, cache="off", n_threads=1) as e:
        return e.chat(messages, max_tokens=MAX, temperature=0).text


talk = partial(talk, max_tokens=MAX)


def assert_kv_exact(engine, session, prompt_msgs, probe=42):
    """The session's slot KV equals a from-scratch decode of its units: the prompt of
    ``prompt_msgs`` (text and image chunks, images from the embedding cache) then the reply
    tokens; compared by the logits of a probe token, ``np.array_equal``."""
    engine.settle()
    assert_consistent(engine)
    (slot,) = [s for s in engine.slots() if s.session == session]
    cached = np.array(engine.probe(slot.index, probe))
    prompt = engine.core.call(lambda: engine._prepare(prompt_msgs, "error", 1))
    units = list(slot.tokens)
    assert units[:len(prompt.tokens)] == list(prompt.tokens)
    ctx, batch = Context(engine.model, 2048, 1, 256), Batch(256)
    try:
        pos = 0
        for chunk in prompt.media.chunks:
            if chunk.is_image:
                pos = engine.projector.decode_chunk(ctx, chunk, 0, pos)
            else:
                batch.clear()
                batch.add_run(list(chunk.tokens), pos, 0, False)
                ctx.decode(batch)
                pos += len(chunk.tokens)
        assert pos == len(prompt.tokens)
        tail = units[len(prompt.tokens):] + [probe, probe]
        batch.clear()
        for j, t in enumerate(tail):
            batch.add(t, pos + j, 0, j == len(tail) - 2)
        ctx.decode(batch)
        fresh = np.array(ctx.logits(len(tail) - 2))
    finally:
        batch.close()
        ctx.close()
    assert np.array_equal(cached, fresh), (
        f"slot {slot.index} ({slot.memory}): KV differs from a fresh decode, "
        f"max |diff| {np.abs(cached - fresh).max()}")


def test_four_requests_match_scratch_and_encode_once(engine, pair):
    k = CHUNKS[pair_type(pair)]
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}]
    records = []
    for turn in (image_msg("What is in this picture?", picture(1)), "Describe its colours.",
                 "What is two plus two?", "Back to the picture: is it bright?"):
        r = talk(engine, msgs, turn, "pics")
        assert r.text == scratch(pair, msgs[:-1]), f"turn {len(records) + 1}"
        records.append(r.record)
        assert_kv_exact(engine, "pics", msgs[:-1])
    assert records[0].encoder_runs == 1 and records[0].media_chunks == k
    for r in records[1:]:
        assert r.strategy == policy.HASH_EXTEND
        assert r.encoder_runs == 0 and r.embedding_cache_hits == 0  # the image stays in KV
        assert r.media_chunks == k and r.media_reused == k
    images = [s for s in records[-1].segments if s.kind == "image"]
    assert len(images) == k and all(s.state == "reused" for s in images)


def test_images_added_mid_conversation_extend_the_slot(engine, pair):
    k = CHUNKS[pair_type(pair)]
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}]
    for q in ("Hello!", "What can you do?"):
        r0 = talk(engine, msgs, q, "mid")
    r = talk(engine, msgs, image_msg("Now look at this.", picture(2)), "mid")
    assert r.text == scratch(pair, msgs[:-1])
    assert r.record.strategy == policy.HASH_EXTEND
    # the text conversation was not re-decoded (random replies may re-tokenize differently)
    assert r.record.reused_tokens >= r0.record.prompt_tokens
    assert r.record.encoder_runs == 1
    r2 = talk(engine, msgs, "And the corners?", "mid")
    assert r2.text == scratch(pair, msgs[:-1])
    assert r2.record.encoder_runs == 0 and r2.record.media_reused == k
    r3 = talk(engine, msgs, image_msg("Compare with this one.", picture(3)), "mid")
    assert r3.text == scratch(pair, msgs[:-1])
    assert r3.record.strategy == policy.HASH_EXTEND and r3.record.encoder_runs == 1
    assert r3.record.media_chunks == 2 * k and r3.record.media_reused == k
    assert r3.record.reused_tokens > r2.record.prompt_tokens - 2
    assert_kv_exact(engine, "mid", msgs[:-1])


@pytest.mark.parametrize("family,proj", PAIRS)
def test_a_projector_for_another_width_is_refused(family, proj):
    text = str(make_text_model(family, vision=proj))
    with pytest.raises(ProjectorError, match=r"mismatch between text model \(n_embd = (64|192)\)"):
        Engine(text, mmproj=str(make_mmproj(kind="tiny", projector=proj, text_width=96)))


@pytest.mark.parametrize("family,proj", [p for p in PAIRS if p[1] != "gemma3"])
def test_a_vocabulary_without_the_image_tokens_is_refused(family, proj):
    text = str(make_text_model(family, vision="gemma3"))  # other image tokens
    with pytest.raises(ProjectorError, match="image special token"):
        Engine(text, mmproj=str(make_mmproj(kind="tiny", projector=proj, text_width=64)))


def test_gemma3_images_without_their_delimiter_tokens_load_with_a_warning(caplog):
    """libmtmd inserts Gemma 3's image delimiters as text: without them in the vocabulary they
    are plain text (nothing can abort), so the projector loads, and the log says so."""
    text = str(make_text_model("gemma3", vision="lfm2"))  # other image tokens
    with caplog.at_level("WARNING", logger="nbkv"):
        Engine(text, mmproj=str(make_mmproj(kind="tiny", projector="gemma3",
                                            text_width=64))).close()
    assert "'<start_of_image>' is not a token of the text model" in caplog.text


@pytest.mark.parametrize("family,proj", [("qwen2vl", "qwen2vl_merger"),
                                         ("qwen3vl", "qwen3vl_merger")])
def test_mrope_images_advance_positions_not_tokens(family, proj):
    """Qwen2-VL, Qwen3-VL: an image takes fewer KV positions than embeddings; the slot counts
    positions, the KV map shows both, and the KV holds exactly the recorded positions."""
    text = str(make_text_model(family, vision=proj))
    mmproj = str(make_mmproj(kind="tiny", projector=proj, text_width=64))
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=1024, n_threads=1) as e:
        assert e.projector.uses_mrope
        r = e.chat([image_msg("What?", picture(5))], max_tokens=MAX, temperature=0)
        (img,) = [s for s in r.record.segments if s.kind == "image"]
        assert img.embeddings > img.length > 0  # e.g. 3x3 embeddings on 3 positions
        assert_consistent(e)  # the KV's last position + 1 == the slot's count
        (slot,) = e.slots()
        assert slot.n_tokens == sum(s.length for s in r.record.segments)  # positions


def _variant(tmp_path, family, vision, **changes):
    import dataclasses

    from nbkv import fixtures

    spec = dataclasses.replace(fixtures.text_model_spec(family, 0, vision), **changes)
    return str(fixtures._cached(tmp_path / f"{family}-variant.gguf", spec,
                                fixtures._write_text_model))


@pytest.mark.parametrize("family,proj", [("qwen2vl", "qwen2vl_merger"),
                                         ("qwen3vl", "qwen3vl_merger")])
def test_wrong_dimension_sections_are_refused(tmp_path, family, proj):
    mmproj = str(make_mmproj(kind="tiny", projector=proj, text_width=64))
    text = _variant(tmp_path, family, proj, rope_sections=(4, 4, 4, 0))
    with pytest.raises(ProjectorError, match=r"dimension_sections \[4, 4, 4, 0\] sum to 12"):
        Engine(text, mmproj=mmproj)


def test_a_projector_with_other_deepstack_layers_is_refused(tmp_path):
    """Qwen3-VL: the projector's DeepStack outputs feed the text model's first layers, one
    each; a projector with fewer, or a text model without any, is refused."""
    from test_media import rewrite

    text = str(make_text_model("qwen3vl", vision="qwen3vl_merger"))
    good = make_mmproj(kind="tiny", projector="qwen3vl_merger", text_width=64)
    one = rewrite(good, tmp_path / "one.gguf",
                  drop=[f"v.deepstack.1.{n}.{k}" for n in ("norm", "fc1", "fc2")
                        for k in ("weight", "bias")])
    with pytest.raises(ProjectorError, match=r"\(n_embd = 192\) and mmproj \(n_embd = 128"):
        Engine(text, mmproj=str(one))
    plain = str(make_text_model("qwen2vl", vision="qwen3vl_merger"))  # 64 wide, no DeepStack
    with pytest.raises(ProjectorError, match=r"\(n_embd = 64\) and mmproj \(n_embd = 192"):
        Engine(plain, mmproj=str(good))


def test_mrope_kinds_do_not_mix(tmp_path):
    """Qwen2-VL text models rotate M-RoPE sections in blocks, Qwen3-VL's interleave them: a
    projector of the one family is refused with the other's text model, widths agreeing."""
    from test_media import rewrite

    plain = rewrite(make_mmproj(kind="tiny", projector="qwen3vl_merger", text_width=64),
                    tmp_path / "no-deepstack.gguf",
                    drop=[f"v.deepstack.{i}.{n}.{k}" for i in (0, 1)
                          for n in ("norm", "fc1", "fc2") for k in ("weight", "bias")])
    text = str(make_text_model("qwen2vl", vision="qwen3vl_merger"))  # 64 wide, no DeepStack
    with pytest.raises(ProjectorError, match=r"interleaved M-RoPE \(Qwen3-VL\), but .* uses "
                                             r"M-RoPE \(Qwen2-VL\)"):
        Engine(text, mmproj=str(plain))


@pytest.mark.slow
@pytest.mark.parametrize("family,proj", [p for p in PAIRS if p[0].startswith("qwen")])
def test_realistic_qwen_projectors_serve_their_pair(family, proj):
    """The realistic Qwen projectors (SmolVLM-sized ViT) merge 2x2 as the graphs need: a
    512-px picture is 32 x 32 patches, 256 embeddings on 16 positions, one encoder run."""
    text = str(make_text_model(family, vision=proj))
    mmproj = str(make_mmproj(kind="realistic", projector=proj, text_width=64))
    msgs = [image_msg("What?", picture(10, size=512))]
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=1024, n_threads=1) as e:
        r = e.chat(msgs, session="big", max_tokens=MAX, temperature=0)
        (img,) = [s for s in r.record.segments if s.kind == "image"]
        assert (img.embeddings, img.length, r.record.encoder_runs) == (256, 16, 1)
        assert_kv_exact(e, "big", msgs)


def test_mrope_and_single_position_pairs_do_not_mix():
    qwen_text = str(make_text_model("qwen2vl", vision="qwen2vl_merger"))
    with pytest.raises(ProjectorError, match="multi-axis"):
        Engine(qwen_text, mmproj=str(make_mmproj(kind="tiny", projector="gemma3",
                                                  text_width=64)))
    plain = str(make_text_model("llama", vision="qwen2vl_merger"))
    with pytest.raises(ProjectorError, match="M-RoPE"):
        Engine(plain, mmproj=str(make_mmproj(kind="tiny", projector="qwen2vl_merger",
                                             text_width=64)))


def test_a_micro_batch_too_small_for_a_non_causal_image_is_sized_up(caplog):
    """Gemma 3 decodes an image in one non-causal batch: n_batch is raised to hold it."""
    text = str(make_text_model("gemma3", vision="gemma3"))
    mmproj = str(make_mmproj(kind="tiny", projector="gemma3", text_width=64))
    msgs = [{"role": "system", "content": SYSTEM}, image_msg("What?", picture(6))]
    with caplog.at_level("INFO", logger="nbkv"):
        with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=512, n_batch=2, n_threads=1) as e:
            assert e.ctx.n_batch == e.ctx.n_ubatch == 4  # 4 tokens per tiny gemma3 image
            small = e.chat(msgs, max_tokens=MAX, temperature=0).text
    assert any("n_batch raised from 2 to 4" in r.getMessage() for r in caplog.records)
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=512, n_threads=1) as e:
        assert e.chat(msgs, max_tokens=MAX, temperature=0).text == small


def test_a_big_image_is_decoded_between_other_sessions_tokens():
    """A causal image bigger than n_batch goes into KV one sub-batch per scheduler step, and
    another session's generation runs between them (counted on the scheduler thread: no
    timing). The result is exact."""
    text = str(make_text_model("lfm2", vision="lfm2"))
    mmproj = str(make_mmproj(kind="tiny", projector="lfm2", text_width=64))
    with Engine(text, mmproj=mmproj, n_slots=2, n_ctx=1024, n_batch=16, n_threads=1) as e:
        log = []
        decode_chunk, decode = e.projector.decode_chunk, e.ctx.decode

        def logged_chunk(*a, **k):
            log.append(("piece", k.get("piece")))
            return decode_chunk(*a, **k)

        def logged_decode(batch):
            log.append(("decode", None))
            return decode(batch)

        e.projector.decode_chunk, e.ctx.decode = logged_chunk, logged_decode
        talker = e.chat([{"role": "user", "content": "Tell me a long story."}], session="text",
                        stream=True, max_tokens=120, temperature=0)
        first = next(iter(talker))  # the text session is generating
        msgs = [{"role": "system", "content": SYSTEM}, image_msg("What?", picture(7))]
        r = e.chat(msgs, session="img", max_tokens=MAX, temperature=0)
        rest = list(talker)
        assert first is not None and rest
        pieces = [i for i, (kind, p) in enumerate(log) if kind == "piece"]
        assert [log[i][1] for i in pieces] == [0, 1, 2, 3]  # 64 embeddings, 16 per step
        between = [kind for kind, _ in log[pieces[0]:pieces[-1]] if kind == "decode"]
        assert len(between) >= 3  # the other session's tokens, one step each
        assert r.record.encoder_runs == 1
        e.projector.decode_chunk, e.ctx.decode = decode_chunk, decode
        assert_kv_exact(e, "img", msgs)


#: what ended the pre-flight's child: a named signal, with libmtmd's assert in its stderr tail
KILLED = r"(?s)pre-flight \(bad.gguf with .*\) was killed by SIG[A-Z]+: libmtmd cannot use"
NOT_LOADED = "libmtmd could not load the projector .*: "


@pytest.mark.parametrize("proj,change,reason", [
    ("qwen2vl_merger", {"drop": ("v.patch_embd.weight.1",)}, KILLED),
    ("qwen3vl_merger", {"drop": ("v.patch_embd.bias",)}, KILLED + r".*GGML_ASSERT\(model.patch_b"),
    ("qwen3vl_merger", {"drop": ("v.position_embd.weight",)},
     KILLED + r".*GGML_ASSERT\(model.position_embeddings"),
    ("qwen3vl_merger", {"drop": ("v.blk.1.attn_qkv.bias",)}, KILLED),
    ("qwen3vl_merger", {"tensors": {"v.deepstack.1.fc2.weight": np.zeros((96, 256), np.float16)}},
     KILLED + r".*GGML_ASSERT\(ggml_can_repeat"),
    ("qwen3vl_merger", {"drop": ("v.deepstack.0.fc2.weight",)},
     KILLED + ".*Output buffer size mismatch"),
    ("qwen2vl_merger", {"keys": {"clip.vision.spatial_merge_size": (3, "u32")}},
     KILLED + r".*GGML_ASSERT\(img.nx\(\) % \(patch_size \* 2\)"),
    ("qwen2vl_merger", {"drop": ("mm.2.weight", "mm.2.bias")},
     NOT_LOADED + "unable to find tensor mm.2.weight"),
    ("qwen2.5vl_merger", {"drop": ("clip.vision.n_wa_pattern",)},
     NOT_LOADED + "Key not found: clip.vision.n_wa_pattern"),
    ("lfm2", {"drop": ("mm.1.weight", "mm.1.bias")}, NOT_LOADED + "unable to find tensor mm.1.w"),
    ("lfm2", {"keys": {"clip.vision.projector.scale_factor": (3, "u32")}},
     KILLED + r".*GGML_ASSERT\(ggml_can_repeat"),
])
def test_malformed_projectors_are_refused_with_the_reason(proj, change, reason, tmp_path):
    """Generated malformed files of each new type: a ProjectorError that names what libmtmd
    said, or the signal that ended the pre-flight's child; never an abort of this process."""
    import gguf
    from test_media import rewrite

    family = {"qwen2vl_merger": "qwen2vl", "qwen2.5vl_merger": "qwen2vl",
              "qwen3vl_merger": "qwen3vl", "lfm2": "lfm2"}[proj]
    change = dict(change)
    if "keys" in change:
        change["keys"] = {k: (v, gguf.GGUFValueType.UINT32) for k, (v, _) in
                          change["keys"].items()}
    bad = rewrite(make_mmproj(kind="tiny", projector=proj, text_width=64),
                  tmp_path / "bad.gguf", **change)
    with pytest.raises(ProjectorError, match=reason):
        Engine(str(make_text_model(family, vision=proj)), mmproj=str(bad))


def test_an_edited_question_after_the_image_keeps_the_image(engine, pair):
    """Prefix reuse after an edit lands on a position boundary, never inside the image: the
    image is reused (not re-encoded, not re-decoded) and the KV stays exact."""
    k = CHUNKS[pair_type(pair)]
    engine.clear()
    msgs = [{"role": "system", "content": SYSTEM}]
    talk(engine, msgs, image_msg("What is this?", picture(8)), "ed")
    talk(engine, msgs, "Is it bright?", "ed")
    msgs[-2] = {"role": "user", "content": "Is it dark?"}  # edit the last question
    del msgs[-1]
    r = engine.chat(msgs, session="ed", max_tokens=MAX, temperature=0)
    assert r.record.encoder_runs == 0 and r.record.media_reused == k
    assert r.text == scratch(pair, msgs)
    msgs.append(r.message)
    assert_kv_exact(engine, "ed", msgs[:-1])


def test_the_embedding_cache_skips_the_encoder_after_eviction(pair):
    text, mmproj = pair
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=1024, n_threads=1,
                park_ram=0) as e:  # evicted conversations are lost: rebuilt, not restored
        a = [{"role": "system", "content": SYSTEM}]
        assert talk(e, a, image_msg("What is this?", picture(4)), "a").record.encoder_runs == 1
        talk(e, [{"role": "system", "content": "Unrelated."}], "Hi there", "b")  # evicts a
        r = talk(e, a, "Tell me more.", "a")
        assert r.record.evicted_session == "b"
        assert r.record.encoder_runs == 0 and r.record.embedding_cache_hits == 1
        assert r.text == scratch(pair, a[:-1])
        assert_kv_exact(e, "a", a[:-1])


@pytest.mark.parametrize("family,proj", [("lfm2", "lfm2"), ("qwen2vl", "qwen2vl_merger"),
                                         ("qwen3vl", "qwen3vl_merger")])
def test_cancel_between_the_pieces_of_an_image_leaves_the_slot_exact(family, proj):
    """Cancelled after part of an image is in KV: the part goes (a hybrid model back to its
    checkpoint), the slot stays exact and the next request serves the image."""
    text = str(make_text_model(family, vision=proj))
    mmproj = str(make_mmproj(kind="tiny", projector=proj, text_width=64))
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=1024, n_batch=4, n_threads=1) as e:
        msgs = [{"role": "system", "content": SYSTEM}, image_msg("What?", picture(9))]
        decode_chunk, seen, holder = e.projector.decode_chunk, [], {}

        def cancelling(*a, **k):
            seen.append(k.get("piece"))
            out = decode_chunk(*a, **k)
            if k.get("piece") == 1:
                while "s" not in holder:  # chat() has returned the stream by now, or nearly
                    time.sleep(0.001)
                holder["s"]._job.cancel.set()  # on the scheduler thread: no waiting
            return out

        e.projector.decode_chunk = cancelling
        holder["s"] = s = e.chat(msgs, session="c", stream=True, max_tokens=MAX, temperature=0)
        assert list(s) == []  # ends when cancelled
        assert s.finish_reason == "cancelled" and seen[:2] == [0, 1] and 2 not in seen
        e.projector.decode_chunk = decode_chunk
        assert_consistent(e)
        r = e.chat(msgs, session="c", max_tokens=MAX, temperature=0)
        assert r.text == scratch((text, mmproj), msgs)
        assert_kv_exact(e, "c", msgs)


@pytest.mark.parametrize("proj", ["qwen2vl_merger", "qwen2.5vl_merger"])
def test_mrope_image_kv_equals_libmtmd_helper_decode(proj):
    """nbkv builds an M-RoPE image's 4-axis position batch itself; libmtmd's own helper
    (``mtmd_helper_decode_image_chunk``) decodes the same embeddings into another context.
    Both end at the same next position, and a probe token after the prompt gets the same
    logits (``np.array_equal``) in both."""
    import ctypes

    import llama_cpp
    from llama_cpp import mtmd_cpp as M

    text = str(make_text_model("qwen2vl", vision=proj))
    mmproj = str(make_mmproj(kind="tiny", projector=proj, text_width=64))
    msgs = [{"role": "system", "content": SYSTEM},
            image_msg("What is here?", picture(3, size=48))]
    with Engine(text, mmproj=mmproj, n_slots=1, n_ctx=512, n_threads=1) as e:
        p = e.projector
        prompt = e.core.call(lambda: e._prepare(msgs, "error", 1))
        logits, ends = [], []
        for via_helper in (False, True):
            ctx, batch = Context(e.model, 512, 1, 256), Batch(256)
            try:
                pos = 0
                for chunk in prompt.media.chunks:
                    if not chunk.is_image:
                        batch.clear()
                        batch.add_run(list(chunk.tokens), pos, 0, False)
                        ctx.decode(batch)
                        pos += len(chunk.tokens)
                    elif not via_helper:
                        pos = p.decode_chunk(ctx, chunk, 0, pos)
                    else:
                        emb = p.embedding(chunk.image, _prompt=chunk._prompt)
                        arr = np.ascontiguousarray(emb.arrays[chunk.sub_index], np.float32)
                        assert arr.shape[0] > chunk.n_pos  # M-RoPE: fewer positions
                        new = llama_cpp.llama_pos(-1)
                        rc = M.mtmd_helper_decode_image_chunk(
                            p._native(), ctx.ptr, chunk.native(),
                            arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), pos, 0,
                            ctx.n_batch, ctypes.byref(new), M.mtmd_helper_post_decode_callback(),
                            None)
                        assert rc == 0
                        pos = new.value
                ends.append(pos)
                batch.clear()
                batch.add(42, pos, 0, True)
                batch.add(42, pos + 1, 0, False)
                ctx.decode(batch)
                logits.append(np.array(ctx.logits(0)))
            finally:
                batch.close()
                ctx.close()
    assert ends[0] == ends[1] == len(prompt.tokens)
    assert np.array_equal(logits[0], logits[1]), np.abs(logits[0] - logits[1]).max()
