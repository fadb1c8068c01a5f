"""The media layer: image loading, messages, caches, and the real mtmd pipeline.

The pipeline runs the embedded SmolLM2-135M with a generated projector (``nbkv.fixtures``):
a 32-px image in 8-px patches, 16 image tokens, fixed-seed random weights.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import textwrap
import time

import llama_cpp
import numpy as np
import pytest

from conftest import eval_prompt
from nbkv.core.errors import (
    ContextOverflowError,
    MediaError,
    ProjectorError,
)
from nbkv.fixtures import fixture_spec, make_mmproj
from nbkv.kv.policy import common_prefix
from nbkv.media.embeddings import EmbeddingCache
from nbkv.media.images import Image, load_image
from nbkv.media.messages import MARKER, contains_images, extract_images
from nbkv.media.units import MediaKey, MediaUnit, position_units, snap_to_media_boundary

PIL = pytest.importorskip("PIL.Image")
gguf = pytest.importorskip("gguf")


def picture(seed: int = 0, h: int = 32, w: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def png_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def prompt_text(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


# -- images ---------------------------------------------------------------------------------


def test_load_image_from_every_kind(tmp_path):
    a = picture(1, 24, 40)
    raw = png_bytes(a)
    path = tmp_path / "pic.png"
    path.write_bytes(raw)
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    sources = [a, raw, bytearray(raw), memoryview(raw), str(path), path, path.as_uri(), uri,
               PIL.fromarray(a)]
    images = [load_image(s) for s in sources]
    assert {im.hash for im in images} == {images[0].hash}
    im = images[0]
    assert (im.width, im.height, im.nbytes) == (40, 24, 24 * 40 * 3)
    assert np.array_equal(im.array(), a)
    assert load_image(im) is im
    # gray and RGBA arrays are normalized to RGB
    assert load_image(a[:, :, 0]).array().shape == (24, 40, 3)
    rgba = np.concatenate([a, np.full((24, 40, 1), 7, np.uint8)], axis=2)
    assert load_image(rgba).hash == im.hash
    # the hash is about pixels, not the container
    assert load_image(picture(2, 24, 40)).hash != im.hash
    assert Image.from_rgb(a).hash == im.hash


@pytest.mark.parametrize(
    "source, match",
    [
        ("https://example.com/cat.png", "does not fetch"),
        ("http://example.com/cat.png", "does not fetch"),
        ("ftp://example.com/cat.png", "unsupported image URL scheme"),
        ("/no/such/picture.png", "no image file"),
        (b"", "empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "cannot decode"),
        (b"this is not an image", "cannot decode"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:image/png;base64,@@@", "base64"),
        ("data:image/png;base64", "malformed"),
        (np.zeros((4, 4, 3), np.float32), "uint8"),
        (np.zeros((4, 4, 2), np.uint8), "HxWx3"),
        (np.zeros((0, 4, 3), np.uint8), "empty"),
        (42, "cannot use a int"),
    ],
)
def test_load_image_errors(source, match):
    with pytest.raises(MediaError, match=match):
        load_image(source)


def test_truncated_and_unreadable_files(tmp_path):
    raw = png_bytes(picture(3))
    cut = tmp_path / "cut.png"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(MediaError, match="cannot decode"):
        load_image(cut)
    text = tmp_path / "notes.png"
    text.write_text("hello")
    with pytest.raises(MediaError, match="cannot decode"):
        load_image(str(text))


def test_extract_images_from_messages(tmp_path):
    a, b = picture(4), picture(5)
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(a))
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(b)).decode()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": str(path)}},
            {"type": "text", "text": " with "},
            {"type": "image_url", "image_url": uri},
        ]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image", "image": b}, PIL.fromarray(a), "Again?"]},
    ]
    out = extract_images(messages)
    assert out.messages[0] == messages[0]
    assert out.messages[1]["content"] == f"Compare {MARKER} with {MARKER}"
    assert out.messages[3]["content"] == f"{MARKER}{MARKER}Again?"
    ha, hb = load_image(a).hash, load_image(b).hash
    assert [im.hash for im in out.images] == [ha, hb, hb, ha]
    assert out.image_hashes == [(), (ha, hb), (), (hb, ha)]
    assert messages[1]["content"][0] == {"type": "text", "text": "Compare "}  # not mutated
    hashed = out.for_hashing()
    assert hashed[1]["images"] == [ha, hb] and "images" not in hashed[0]
    assert contains_images(messages) and not contains_images(out.messages)


@pytest.mark.parametrize(
    "content, match",
    [
        ([{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}], "does not fetch"),
        ([{"type": "audio", "audio": "x"}], "unsupported content part"),
        ([{"type": "image_url"}], "needs an 'image_url'"),
        ([{"type": "text", "text": f"a {MARKER} b"}], "reserved"),
        (f"typed {MARKER} by hand", "reserved"),
    ],
)
def test_extract_images_errors(content, match):
    with pytest.raises(MediaError, match=match) as e:
        extract_images([{"role": "user", "content": content}])
    assert "messages[0]" in str(e.value)


# -- caches and prompt comparison -----------------------------------------------------------


class Blob:
    def __init__(self, n: int) -> None:
        self.nbytes = n


def test_embedding_cache_is_an_lru_bounded_by_bytes():
    c = EmbeddingCache(max_bytes=100)
    c.put("a", Blob(40))
    c.put("b", Blob(40))
    assert c.get("a") is not None  # a is now the most recent
    c.put("c", Blob(40))  # evicts b, the least recently used
    assert c.keys() == ["a", "c"] and c.nbytes == 80
    assert c.get("b") is None
    assert not c.put("huge", Blob(101)) and "huge" not in c
    c.put("a", Blob(10))  # replacing updates the size
    assert c.nbytes == 50
    assert (c.stats.hits, c.stats.misses, c.stats.evictions, c.stats.rejected) == (1, 1, 1, 1)
    c.clear()
    assert len(c) == 0 and c.nbytes == 0


def test_embedding_service_asks_once_and_counts_once():
    import threading
    from types import SimpleNamespace

    from nbkv.media.embeddings import EmbeddingService, ImageEmbedding

    gate, calls = threading.Event(), []

    def encode(img, context):
        calls.append((img.hash, context, threading.current_thread().name))
        assert gate.wait(10)
        return ImageEmbedding(img.hash, "p", (np.zeros((2, 3), np.float32),))

    svc = EmbeddingService("p", encode)
    img, tally = Image.from_rgb(picture(3)), SimpleNamespace(encoder_runs=0, embedding_hits=0)
    assert not svc.cached(img)
    fut = svc.fetch(img, "ctx", tally=tally, wait=False)  # a run, on the service's thread
    assert (tally.encoder_runs, tally.embedding_hits) == (1, 0)
    gate.set()
    emb = fut.result(10)
    assert calls == [(img.hash, "ctx", calls[0][2])] and calls[0][2].startswith("nbkv-encoder")
    assert svc.cached(img) and svc.cache.peek(svc.key(img.hash)) is emb
    again = svc.fetch(img, tally=tally, wait=False)  # a hit: done at once, counted once
    assert again.done() and again.result() is emb and len(calls) == 1
    other = Image.from_rgb(picture(4))  # held by the request: a hit without the cache
    assert svc.fetch(other, held={other.hash: emb}, tally=tally).result() is emb
    assert (tally.encoder_runs, tally.embedding_hits) == (1, 2)
    s = svc.stats
    assert (s.cache_hits, s.cache_misses, s.images_encoded) == (1, 1, 1)
    assert svc.get(img, use_cache=False) is not emb and len(calls) == 2  # in this thread
    svc.close()
    svc.close()
    assert svc.closed and svc.get(img) is not None  # the cache still answers
    with pytest.raises(MediaError, match="closed"):
        svc.fetch(Image.from_rgb(picture(5)), wait=False)


def test_prefix_comparison_treats_images_as_opaque_runs():
    img1 = MediaKey("h1", 0, 3, 3)
    img2 = MediaKey("h2", 0, 3, 3)
    a = position_units([(1, 2), img1, (5, 6)])
    assert a[2] == MediaUnit(img1, 0) and len(a) == 7
    def shared_prefix(x, y):  # what the engine keeps: the common prefix, images whole
        return snap_to_media_boundary(x, common_prefix(x, y))

    same_but_longer = position_units([(1, 2), img1, (5, 6, 7)])
    other_image = position_units([(1, 2), img2, (5, 6)])
    assert shared_prefix(a, same_but_longer) == 7
    assert shared_prefix(a, other_image) == 2  # diverges at the image: keep the text before
    assert shared_prefix(a, position_units([(1, 9)])) == 1
    # a prefix never cuts an image in two
    assert snap_to_media_boundary(a, 4) == 2
    assert snap_to_media_boundary(a, 5) == 5
    assert shared_prefix(a, a[:4]) == 2


# -- the fixture ----------------------------------------------------------------------------


def test_fixture_is_deterministic_cached_and_repaired(tmp_path):
    p1 = make_mmproj(tmp_path / "one.gguf")
    p2 = make_mmproj(tmp_path / "two.gguf")
    assert p1.read_bytes() == p2.read_bytes()
    assert p1.stat().st_size < 1_000_000
    mtime = p1.stat().st_mtime_ns
    assert make_mmproj(p1) == p1 and p1.stat().st_mtime_ns == mtime  # reused, not rewritten
    data = p1.read_bytes()
    p1.write_bytes(data[: len(data) // 2])  # truncated: regenerated
    assert make_mmproj(p1).read_bytes() == p2.read_bytes()
    make_mmproj(p1, seed=1)  # other parameters: rewritten with other weights
    assert p1.read_bytes() != p2.read_bytes()
    assert fixture_spec("tiny").image_tokens == 16
    assert fixture_spec("realistic").image_tokens == 1024
    assert fixture_spec("realistic", "gemma3").image_tokens == 64


def test_fixture_default_location(tmp_path, monkeypatch):
    monkeypatch.setenv("NBKV_CACHE_DIR", str(tmp_path))
    p = make_mmproj(projector="gemma3")
    assert p.parent == tmp_path and "gemma3" in p.name
    assert make_mmproj(projector="gemma3") == p


# -- the pipeline ---------------------------------------------------------------------------
# Model decodes are the slow part on shared CPUs: the tests share one baseline evaluation and
# use one thread per context.

TEXT = prompt_text(f"What is {MARKER}?")


@pytest.fixture(scope="module")
def model(model_path):
    from nbkv.llama.backend import Model

    m = Model(model_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tiny_path():
    return make_mmproj()


@pytest.fixture(scope="module")
def projector(model, tiny_path):
    from nbkv.media.projector import Projector

    with Projector(tiny_path, model, n_threads=1) as p:
        yield p


@pytest.fixture(scope="module")
def ctx(model):
    from nbkv.llama.backend import Context

    c = Context(model, n_ctx=512, n_seq_max=2, n_batch=64, flash_attn=0, n_threads=1)
    yield c
    c.close()


@pytest.fixture(scope="module")
def baseline(projector, ctx):
    """Logits after TEXT with picture(9), computed once through the encoder, in sequence 0."""
    img = Image.from_rgb(picture(9))
    projector.cache.clear()
    ctx.clear()
    s0 = projector.stats.snapshot()
    with projector.tokenize(TEXT, [img]) as p:
        assert not p.image_chunks()[0].placeholder
        pos, logits = eval_prompt(projector, ctx, p, seq=0)
    s1 = projector.stats.snapshot()
    assert s1["encoder_runs"] == s0["encoder_runs"] + 1
    assert s1["cache_misses"] == s0["cache_misses"] + 1
    assert pos == ctx.seq_pos_max(0) + 1
    assert np.isfinite(logits).all()
    return img, logits


def test_projector_info(projector, model):
    info = projector.info
    assert (info.projector_type, info.n_embd_out, info.tokens_per_tile) == ("mlp", 576, 16)
    assert projector.marker == MARKER
    assert not projector.uses_mrope and not projector.non_causal
    assert projector.n_embd == llama_cpp.llama_model_n_embd(model.ptr) == 576


def test_chunking_gives_16_image_tokens(projector, model):
    img = Image.from_rgb(picture(6, 20, 50))
    text = prompt_text(f"Look: {MARKER} what is it?")
    with projector.tokenize(text, [img], use_cache=False) as p:
        kinds = [c.kind for c in p]
        assert kinds == ["text", "image", "text"]
        first, image, last = p.chunks
        assert (image.n_tokens, image.n_pos, image.image, image.sub_index) == (16, 16, img, 0)
        assert not image.placeholder
        before, after = text.split(MARKER)
        assert list(first.tokens) == model.tokenize(before)
        assert list(last.tokens) == model.tokenize(after)
        assert p.n_tokens == p.n_pos == len(first.tokens) + 16 + len(last.tokens)
        assert image.key == MediaKey(img.hash, 0, 16, 16)
        spans = p.spans(start=10)
        assert [(s.kind, s.start, s.end) for s in spans] == [
            ("text", 10, 10 + len(first.tokens)),
            ("image", 10 + len(first.tokens), 26 + len(first.tokens)),
            ("text", 26 + len(first.tokens), 10 + p.n_pos),
        ]
        assert len(position_units(p.keys())) == p.n_pos
        n0 = len(first.tokens)
        assert p.locate(0) == (0, 0) and p.locate(n0 - 1) == (0, n0 - 1)
        assert p.locate(n0) == (1, 0) and p.locate(n0 + 16) == (2, 0)
        assert p.locate(p.n_pos) == (3, 0)
        with pytest.raises(MediaError, match="inside an image"):
            p.locate(n0 + 3)
    with pytest.raises(MediaError, match="closed"):
        image.native()
    with pytest.raises(MediaError, match="1 media marker"):
        projector.tokenize(text, [img, img])
    with pytest.raises(MediaError, match="does not fetch"):
        projector.tokenize(text, ["https://example.com/a.png"])


def test_same_image_twice_is_encoded_once(projector):
    img = Image.from_rgb(picture(7))
    runs = projector.stats.encoder_runs
    with projector.tokenize(f"{MARKER} and {MARKER}", [img, img]) as p:
        assert [c.image_index for c in p.image_chunks()] == [0, 1]
        embeds = projector.embed(p)
    assert list(embeds) == [img.hash]
    assert embeds[img.hash].arrays[0].shape == (16, 576)
    assert projector.stats.encoder_runs == runs + 1


def test_repeated_runs_are_bit_identical(projector, ctx, baseline):
    img, expected = baseline
    ctx.seq_rm(1)
    runs = projector.stats.encoder_runs
    with projector.tokenize(TEXT, [img], use_cache=False) as p:
        embeds = projector.embed(p, use_cache=False)  # through the encoder again
        _, logits = eval_prompt(projector, ctx, p, seq=1, embeddings=embeds)
    assert projector.stats.encoder_runs == runs + 1
    assert np.array_equal(logits, expected)


def test_cached_embeddings_skip_the_encoder_bit_for_bit(model, projector, tiny_path, ctx,
                                                         baseline):
    from nbkv.media.projector import Projector

    img, expected = baseline
    ctx.seq_rm(1)
    s0 = projector.stats.snapshot()
    # rebuilding a slot (another sequence, later): no pixels preprocessed, no encoder run
    with projector.tokenize(TEXT, [img]) as p:
        assert p.image_chunks()[0].placeholder
        _, logits = eval_prompt(projector, ctx, p, seq=1)
    s1 = projector.stats.snapshot()
    assert s1["encoder_runs"] == s0["encoder_runs"]
    assert s1["cache_hits"] == s0["cache_hits"] + 1
    assert s1["placeholders"] == s0["placeholders"] + 1
    assert s1["embeddings_decoded"] == s0["embeddings_decoded"] + 16
    assert np.array_equal(logits, expected)
    # another projector instance (another engine) sharing the cache: no encoder run either
    with Projector(tiny_path, model, cache=projector.cache, n_threads=1) as other:
        assert other.identity == projector.identity
        with other.tokenize(TEXT, [img]) as p:
            embeds = other.embed(p)
        assert other.stats.encoder_runs == 0 and other.stats.cache_hits == 1
        assert embeds[img.hash] is projector.embedding(img)


def test_placeholder_chunk_reencodes_after_eviction(projector, ctx):
    img = Image.from_rgb(picture(10))
    projector.embedding(img)
    with projector.tokenize(MARKER, [img]) as p:
        assert p.image_chunks()[0].placeholder
        projector.cache.clear()  # evicted between tokenize and decode
        runs = projector.stats.encoder_runs
        embeds = projector.embed(p)
        assert projector.stats.encoder_runs == runs + 1
        assert embeds[img.hash].arrays[0].shape == (16, 576)


def test_copied_sequence_continues_bit_for_bit(model, projector, ctx, baseline):
    from nbkv.llama.backend import Batch

    ctx.seq_rm(1)
    pos = ctx.seq_pos_max(0) + 1  # the baseline prompt is in sequence 0
    llama_cpp.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)
    follow = model.tokenize("More.")
    out = []
    batch = Batch(8)
    for seq in (0, 1):
        batch.clear()
        i = batch.add_run(follow, pos, seq, logits_last=True)
        ctx.decode(batch)
        out.append(np.array(ctx.logits(i)))
        ctx.seq_rm(seq, pos)
    batch.close()
    assert np.array_equal(out[0], out[1])


def test_sub_batch_split_does_not_change_results(model, projector, ctx):
    # multi-row batches compute the same numbers whatever their size; a lone row does not
    # (docs/concepts/exactness.md), so an image is never split with a lone last embedding: 16 in
    # sub-batches of 15 decodes as 14 + 2
    from nbkv.llama.backend import Batch

    img = Image.from_rgb(picture(16))
    follow = model.tokenize(" ok")
    out = []
    batch = Batch(8)
    with projector.tokenize(MARKER, [img]) as p:
        (chunk,) = p.chunks
        for n_batch in (64, 5, 15):
            ctx.seq_rm(1)
            projector.decode_chunk(ctx, chunk, seq=1, pos=0, n_batch=n_batch)
            batch.clear()
            i = batch.add_run(follow, 16, 1, logits_last=True)
            ctx.decode(batch)
            out.append(np.array(ctx.logits(i)))
    batch.close()
    assert all(np.array_equal(out[0], o) for o in out[1:])


def test_the_image_is_really_used(projector, ctx, baseline):
    img, expected = baseline
    ctx.seq_rm(1)
    with projector.tokenize(TEXT, [Image.from_rgb(255 - img.array())]) as p:
        _, logits = eval_prompt(projector, ctx, p, seq=1)
    assert not np.array_equal(logits, expected)


def test_decode_errors_leave_the_sequence_alone(model, projector, ctx):
    from nbkv.llama.backend import Context
    from nbkv.media.projector import Projector

    ctx.seq_rm(1)
    img = Image.from_rgb(picture(13))
    with projector.tokenize(MARKER, [img]) as p:
        chunk = p.image_chunks()[0]
        with pytest.raises(ContextOverflowError):
            projector.decode_chunk(ctx, chunk, seq=1, pos=ctx.n_ctx_seq - 4)
        with pytest.raises(MediaError, match="sequence 7"):
            projector.decode_chunk(ctx, chunk, seq=7, pos=0)
        assert ctx.seq_pos_max(1) == -1
        assert projector.decode_chunk(ctx, chunk, seq=1, pos=0) == 16
        assert ctx.seq_pos_max(1) == 15
    ctx.seq_rm(1)
    # gemma3 attends over an image non-causally: the image must fit one micro-batch, else
    # llama.cpp would abort; nbkv refuses before calling it
    with Projector(make_mmproj(projector="gemma3"), model, n_threads=1) as g:
        assert g.non_causal
        small = Context(model, n_ctx=256, n_seq_max=1, n_batch=2, flash_attn=0, n_threads=1)
        try:
            with g.tokenize(MARKER, [img]) as p:
                chunk = p.image_chunks()[0]
                assert chunk.n_tokens == 4
                with pytest.raises(MediaError, match="n_batch >= 4"):
                    g.decode_chunk(small, chunk, seq=0, pos=0)
                assert small.seq_pos_max(0) == -1
        finally:
            small.close()


# -- wrong projectors -----------------------------------------------------------------------


def rewrite(src, dst, *, drop=(), keys=None, tensors=None):
    """Copy a GGUF, dropping tensors/keys, overriding keys and tensors."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "clip")
    keys = keys or {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        if name in keys:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(name, f.contents())
        else:
            w.add_key_value(name, f.contents(), vt)
    for name, (value, vt) in keys.items():
        w.add_key_value(name, value, vt)
    tensors = tensors or {}
    for t in r.tensors:
        if t.name in drop:
            continue
        w.add_tensor(t.name, tensors.get(t.name, np.array(t.data)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_wrong_projectors_are_refused_by_the_preflight(model, tiny_path, model_path, tmp_path):
    """The header check refuses what is no projector; libmtmd, in the pre-flight's child,
    refuses the rest with a named error (its own message, or the signal that ended the child
    and its stderr), and the test process lives on. What libmtmd encodes without complaint
    loads."""
    from nbkv.media.projector_check import inspect_projector

    U32, I32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32
    pos = gguf.GGUFReader(tiny_path).get_tensor(2)
    assert pos.name == "v.position_embd.weight"
    killed = r"(?s)pre-flight \(.*\) was killed by SIG[A-Z]+: libmtmd cannot use this projector"
    cases = {
        "512 wide": (make_mmproj(text_width=512),
                     r"mismatch between text model \(n_embd = 576\) and mmproj \(n_embd = 512"),
        "idefics3": (make_mmproj(projector="idefics3"), "lacks an image special token"),
        "text model": (model_path, "not a vision projector"),
        "key type": (rewrite(tiny_path, tmp_path / "k.gguf",
                             keys={"clip.vision.image_size": (32, I32)}),
                     killed + ".*stderr tail: .*GGML_ASSERT"),
        "no mm.2": (rewrite(tiny_path, tmp_path / "m.gguf", drop=("mm.2.weight", "mm.2.bias")),
                    killed),
        "no vision": (rewrite(tiny_path, tmp_path / "v.gguf",
                              keys={"clip.has_vision_encoder": (False, gguf.GGUFValueType.BOOL)}),
                      "no vision encoder"),
        "other type": (rewrite(tiny_path, tmp_path / "u.gguf",
                               keys={"clip.projector_type": ("ldp", gguf.GGUFValueType.STRING)}),
                       "libmtmd could not load the projector .*unable to find tensor"),
    }
    for path, match in cases.values():
        with pytest.raises(ProjectorError, match=match):
            inspect_projector(path, model)
    accepted = {  # the graph reads them without complaint: nothing to refuse
        "f16 pos": rewrite(tiny_path, tmp_path / "p.gguf",
                           tensors={pos.name: np.array(pos.data).astype(np.float16)}),
        "patch 16": rewrite(tiny_path, tmp_path / "s.gguf",
                            keys={"clip.vision.patch_size": (16, U32)}),
    }
    for path in accepted.values():
        assert inspect_projector(path, model).n_embd_out == 576
    data = tiny_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ProjectorError, match="not a whole GGUF file"):
        inspect_projector(cut, model)
    with pytest.raises(ProjectorError, match="no projector file"):
        inspect_projector(tmp_path / "missing.gguf", model)


def test_the_preflight_runs_once_per_pair_of_files(model, tiny_path, tmp_path, monkeypatch):
    """A second check of the same files asks no child; a refusal is kept too; a file
    changed on disk is probed again."""
    import shutil

    from nbkv.media import projector_check

    runs = []
    real = projector_check._run_child

    def counted(projector, model_path):
        runs.append(projector)
        return real(projector, model_path)

    monkeypatch.setattr(projector_check, "_run_child", counted)
    copy = shutil.copy(tiny_path, tmp_path / "copy.gguf")
    first = projector_check.inspect_projector(copy, model)
    assert projector_check.inspect_projector(copy, model) == first and len(runs) == 1
    bad = rewrite(tiny_path, tmp_path / "bad.gguf", drop=("mm.2.weight", "mm.2.bias"))
    for _ in range(2):
        with pytest.raises(ProjectorError, match="killed by"):
            projector_check.inspect_projector(bad, model)
    assert len(runs) == 2
    os.utime(copy, ns=(1, 1))  # another modification time: another file as far as it knows
    projector_check.inspect_projector(copy, model)
    assert len(runs) == 3


_SUBPROCESS = textwrap.dedent(
    """
    import sys
    import numpy as np
    from nbkv.llama.backend import Context, Model
    from nbkv.core.errors import ProjectorError
    from nbkv.fixtures import make_mmproj
    from nbkv.media.images import Image
    from nbkv.llama.models import default_model_path
    from nbkv.media.projector import Projector

    model = Model(default_model_path())
    ctx = Context(model, n_ctx=256, n_seq_max=1, n_batch=64, flash_attn=0, n_threads=1)
    img = Image.from_rgb(np.zeros((32, 32, 3), np.uint8))
    if sys.argv[1] == "nbkv":
        try:
            Projector(make_mmproj(projector="idefics3"), model)
        except ProjectorError as e:
            print("refused:", e)
        with Projector(make_mmproj(), model, n_threads=1) as p:
            with p.tokenize("<__media__>", [img]) as pr:
                print("still works:", p.decode_chunk(ctx, pr.image_chunks()[0], 0, 0))
    else:  # the same projector straight through libmtmd, as a caller without nbkv would
        import ctypes
        import llama_cpp
        from llama_cpp import mtmd_cpp as M
        params = M.mtmd_context_params_default()
        params.use_gpu = False
        path = str(make_mmproj(projector="idefics3")).encode()
        m = M.mtmd_init_from_file(path, model.ptr, params)
        buf = (ctypes.c_uint8 * img.nbytes).from_buffer_copy(img.data)
        bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(M.mtmd_bitmap_init(32, 32, buf))
        chunks = M.mtmd_input_chunks_init()
        text = M.mtmd_default_marker()
        M.mtmd_tokenize(m, chunks, ctypes.byref(M.mtmd_input_text(text, len(text), False, True)),
                        bitmaps, 1)
        n_past = llama_cpp.llama_pos(0)
        M.mtmd_helper_eval_chunks(m, ctx.ptr, chunks, 0, 0, 64, True, ctypes.byref(n_past))
        print("survived")
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    return subprocess.run([sys.executable, "-c", _SUBPROCESS, mode], capture_output=True,
                          text=True, timeout=300, env=env)


def test_mismatched_projector_is_refused_and_the_process_survives():
    r = _run("nbkv")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "lacks an image special token" in r.stdout
    assert "still works:" in r.stdout


@pytest.mark.slow
def test_without_the_check_libmtmd_aborts_the_process():
    # the control experiment: what nbkv's pre-flight check prevents
    r = _run("raw")
    assert r.returncode != 0 and "survived" not in r.stdout
    assert "GGML_ASSERT" in r.stderr


# -- a projector of realistic size ----------------------------------------------------------


@pytest.fixture(scope="module")
def realistic_path():
    return make_mmproj(kind="realistic")


def test_realistic_projector_loads(model, realistic_path):
    from nbkv.media.projector import Projector

    with Projector(realistic_path, model) as p:
        info = p.info
        assert (info.n_embd, info.n_layer, info.image_size, info.patch_size) == (768, 12, 512, 16)
        assert info.n_embd_out == 576 and info.tokens_per_tile == 1024
        with p.tokenize(MARKER, [Image.from_rgb(picture(14, 300, 400))]) as pr:
            (chunk,) = pr.image_chunks()
            assert chunk.n_tokens == chunk.n_pos == 1024


@pytest.mark.slow
def test_realistic_projector_encodes(model, realistic_path):
    from nbkv.media.projector import Projector

    with Projector(realistic_path, model) as p:
        img = Image.from_rgb(picture(15, 480, 640))
        t0 = time.perf_counter()
        emb = p.embedding(img)
        dt = time.perf_counter() - t0
        (arr,) = emb.arrays
        assert arr.shape == (1024, 576) and np.isfinite(arr).all()
        assert p.stats.encoder_runs == 1
        print(f"realistic encode: {dt:.2f}s for 1024 embeddings")
        assert p.embedding(img) is emb and p.stats.encoder_runs == 1
