"""Vision projectors through libmtmd (llama-cpp-python's ``mtmd_cpp`` bindings).

A :class:`Projector` pairs a projector (mmproj) GGUF with a loaded text :class:`~nbkv.llama.backend.
Model`. It tokenizes prompt text carrying media markers plus images into chunks
(:class:`~nbkv.media.prompt.MediaPrompt`), runs the vision encoder on image chunks (its
:class:`~nbkv.media.embeddings.EmbeddingService` takes embeddings from the cache when it can), and
decodes embeddings into any sequence of a :class:`~nbkv.llama.backend.Context` at any position, so
the engine can rebuild a slot, or serve the same picture in another session, without
re-running the encoder. The file is checked first (:mod:`nbkv.media.projector_check`: its header,
then libmtmd in a child process), and every call's arguments before native code runs: a wrong
one would abort the process.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from nbkv.core.errors import ContextOverflowError, MediaError, ProjectorError
from nbkv.llama.backend import Context, Model, default_threads, mtmd_lib, take_native_errors
from nbkv.media.embeddings import EmbeddingCache, EmbeddingService, ImageEmbedding, MediaStats
from nbkv.media.images import Image, load_image
from nbkv.media.messages import MARKER
from nbkv.media.projector_check import file_identity, inspect_projector
from nbkv.media.prompt import MediaChunk, MediaPrompt


class Projector:
    """A vision projector bound to a text model: tokenize, encode (cached), decode embeddings.

    Args:
        path: the projector (mmproj) GGUF.
        model: the loaded text model it must fit (:class:`nbkv.llama.backend.Model`).
        cache: where embeddings are kept between requests (shared by several projectors or
            engines if you like); default a private 256 MiB one.
        n_threads: encoder threads (default: all cores). On CPUs shared with other work,
            1 can be much faster: ggml's threads spin at barriers and stall when a core is
            taken.
        trust_projector: skip the checks of what a projector and a text model must agree on
            that native code does not check (see :func:`inspect_projector`).
        flash_attn: the encoder's flash attention, llama.cpp's convention (-1 auto, 0 off).

    Embeddings come from :attr:`embeddings` (an :class:`~nbkv.media.embeddings.EmbeddingService`
    over ``cache``, with this projector's encoder); :meth:`embedding` and :meth:`embed` ask it.

    The projector keeps pointers into ``model``: close it before the model. Thread safety:
    tokenizing may run in any thread (not concurrently with :meth:`close`); encoding is
    serialized by a lock (it never touches a llama context, so the engine can encode in the
    caller's thread while its scheduler decodes); :meth:`decode_chunk` must run where the
    context is used.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: Model,
        *,
        cache: EmbeddingCache | None = None,
        n_threads: int | None = None,
        trust_projector: bool = False,
        flash_attn: int = -1,
        warmup: bool = True,
        preflight: bool = True,
    ) -> None:
        # preflight=False: the pre-flight's own child, which may abort
        self.info = inspect_projector(path, model if preflight else None, trust=trust_projector)
        self.model = model
        self.path = self.info.path
        self.identity = f"{self.info.projector_type}:{file_identity(self.path)[:32]}"
        self.stats = MediaStats()
        self.embeddings = EmbeddingService(self.identity, self._encode_image, cache=cache,
                                           stats=self.stats)
        self.cache = self.embeddings.cache
        self.n_embd = model.n_embd_inp
        self._lock = threading.Lock()
        M = mtmd_lib()
        params = M.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = n_threads or default_threads()
        params.flash_attn_type = flash_attn
        params.warmup = warmup
        take_native_errors()
        ptr = M.mtmd_init_from_file(str(self.path).encode(), model.ptr, params)
        if not ptr:
            detail = take_native_errors()
            raise ProjectorError(
                f"libmtmd could not load the projector {self.path}"
                + (f": {detail}" if detail else "")
            )
        self._ctx = ptr
        self._finalizer = weakref.finalize(self, M.mtmd_free, ptr)
        if not M.mtmd_support_vision(ptr):
            self.close()
            raise ProjectorError(f"{self.path} has no vision encoder")
        self.marker = (M.mtmd_get_marker(ptr) or MARKER.encode()).decode()
        self.uses_mrope = bool(M.mtmd_decode_use_mrope(ptr))
        self.non_causal = bool(M.mtmd_decode_use_non_causal(ptr, None))

    # lifecycle

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the native projector (prompts tokenized with it become unusable).

        Its embedding service's thread stops first, after the encodes already queued.
        """
        self.embeddings.close()
        with self._lock:
            self._finalizer()

    def __enter__(self) -> Projector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _native(self) -> int:
        if self.closed:
            raise MediaError("the projector was closed")
        return self._ctx

    def __repr__(self) -> str:
        i = self.info
        return (
            f"Projector({i.projector_type}, {self.path.name}, vision {i.n_embd}x{i.n_layer}, "
            f"{i.image_size}px/{i.patch_size}px, out {self.n_embd})"
        )

    # the embedding cache

    def cache_key(self, image_hash: str) -> tuple[str, str]:
        """An image's key in the cache (:meth:`nbkv.media.embeddings.EmbeddingService.key`)."""
        return self.embeddings.key(image_hash)

    # tokenize

    def tokenize(
        self,
        text: str,
        images: Sequence[Any] = (),
        *,
        add_special: bool = False,
        parse_special: bool = True,
        use_cache: bool = True,
    ) -> MediaPrompt:
        """Split ``text`` at its media markers into chunks, one image per marker, in order.

        ``images`` may be :class:`~nbkv.media.images.Image` objects or anything
        :func:`~nbkv.media.images.load_image` takes. The marker is :attr:`marker` (libmtmd's
        ``<__media__>``). Images whose embeddings are cached are tokenized as placeholders
        (``use_cache=True``): only their size is passed, skipping the pixel preprocessing.
        """
        M = mtmd_lib()
        imgs = [load_image(i) for i in images]
        n_markers = text.count(self.marker)
        if n_markers != len(imgs):
            raise MediaError(
                f"the prompt has {n_markers} media marker(s) and {len(imgs)} image(s); each "
                f"image needs exactly one {self.marker!r} in the text"
            )
        ctx = self._native()
        bitmaps = []
        keep: list[Any] = []  # pixel buffers must outlive the bitmaps
        placeholders: set[int] = set()
        try:
            for i, img in enumerate(imgs):
                cached = use_cache and self.embeddings.cached(img)
                if cached:
                    bm = M.mtmd_bitmap_init(img.width, img.height, None)
                    placeholders.add(i)
                else:
                    buf = (ctypes.c_uint8 * img.nbytes).from_buffer_copy(img.data)
                    keep.append(buf)
                    bm = M.mtmd_bitmap_init(img.width, img.height, buf)
                if not bm:
                    raise MediaError(f"libmtmd could not create a bitmap for {img!r}")
                bitmaps.append(bm)
                M.mtmd_bitmap_set_id(bm, f"{i}:{img.hash}".encode())
            data = text.encode("utf-8")
            inp = M.mtmd_input_text(data, len(data), add_special, parse_special)
            arr = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
            native = M.mtmd_input_chunks_init()
            prompt = MediaPrompt(self, native, imgs)
            take_native_errors()
            rc = M.mtmd_tokenize(ctx, native, ctypes.byref(inp), arr, len(bitmaps))
        finally:
            for bm in bitmaps:
                M.mtmd_bitmap_free(bm)
        if rc != 0:
            prompt.close()
            detail = take_native_errors()
            raise MediaError(
                f"libmtmd could not tokenize the prompt (code {rc}"
                + (f": {detail}" if detail else "") + ")"
            )
        prompt.chunks = self._read_chunks(prompt, native, imgs, placeholders)
        n_img = [c for c in prompt.chunks if c.is_image]
        self.stats.add(
            images_tokenized=len(imgs), image_chunks=len(n_img),
            image_tokens=sum(c.n_tokens for c in n_img),
            image_positions=sum(c.n_pos for c in n_img), placeholders=len(placeholders),
        )
        return prompt

    def _read_chunks(
        self, prompt: MediaPrompt, native: int, imgs: list[Image], placeholders: set[int]
    ) -> tuple[MediaChunk, ...]:
        M = mtmd_lib()
        out = []
        sub: dict[int, int] = {}
        for i in range(M.mtmd_input_chunks_size(native)):
            ch = M.mtmd_input_chunks_get(native, i)
            kind = M.mtmd_input_chunk_get_type(ch)
            n_pos = int(M.mtmd_input_chunk_get_n_pos(ch))
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                toks = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                tokens = tuple(toks[: n.value]) if n.value else ()
                bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
                if bad:  # an unknown special token: evaluating it would abort natively
                    prompt.close()
                    raise MediaError(
                        f"libmtmd produced invalid token id(s) {bad[:3]} for the text model: "
                        "it lacks an image special token the projector looks up, so the "
                        "projector does not fit it"
                    )
                out.append(MediaChunk(i, "text", len(tokens), n_pos, tokens, _prompt=prompt,
                                      _ptr=ch))
            elif kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                cid = (M.mtmd_input_chunk_get_id(ch) or b"").decode()
                idx_s, _, h = cid.partition(":")
                idx = int(idx_s)
                if not (0 <= idx < len(imgs)) or imgs[idx].hash != h:
                    prompt.close()
                    raise MediaError(f"libmtmd returned an image chunk with unknown id {cid!r}")
                k = sub.get(idx, 0)
                sub[idx] = k + 1
                out.append(MediaChunk(
                    i, "image", int(M.mtmd_input_chunk_get_n_tokens(ch)), n_pos,
                    image=imgs[idx], image_index=idx, sub_index=k,
                    placeholder=idx in placeholders,
                    _prompt=prompt, _ptr=ch,
                ))
            else:
                prompt.close()
                raise MediaError("audio chunks are not supported")
        return tuple(out)

    # encode

    def embed(self, prompt: MediaPrompt, *, use_cache: bool = True) -> dict[str, ImageEmbedding]:
        """Embeddings of every picture in ``prompt``, by image hash: cached, else encoded.

        Each distinct picture counts one cache hit or one encode (however many times it
        appears). The result holds references, so a later cache eviction cannot take
        embeddings away from a request that already has them. ``use_cache=False`` always
        runs the encoder (the fresh result still replaces the cached one).
        """
        out: dict[str, ImageEmbedding] = {}
        for c in prompt.chunks:
            if c.is_image and c.image is not None and c.image.hash not in out:
                out[c.image.hash] = self.embedding(c.image, use_cache=use_cache, _prompt=prompt)
        return out

    def embedding(
        self, image: Any, *, use_cache: bool = True, _prompt: MediaPrompt | None = None
    ) -> ImageEmbedding:
        """The embeddings of one picture: from the cache, else by running the encoder.

        ``_prompt``: a prompt where the picture was tokenized, whose chunks the encoder reuses.
        """
        return self.embeddings.get(image, _prompt, use_cache=use_cache)

    def _encode_image(self, img: Image, prompt: MediaPrompt | None) -> ImageEmbedding:
        """The service's encoder: ``img`` through the encoder, on ``prompt``'s chunks if any."""
        chunks = []
        if prompt is not None:
            chunks = [c for c in prompt.chunks if c.image is not None
                      and c.image.hash == img.hash and not c.placeholder]
            first = chunks[0].image_index if chunks else -1
            chunks = [c for c in chunks if c.image_index == first]
        if chunks:
            return self._encode(img, chunks)
        # tokenized as a placeholder, or not tokenized at all: tokenize it alone
        with self.tokenize(self.marker, [img], use_cache=False) as solo:
            return self._encode(img, solo.image_chunks())

    def encode_chunk(self, chunk: MediaChunk) -> np.ndarray:
        """Run the encoder on one image chunk; a read-only ``(n_tokens, n_embd)`` copy.

        Counts an encoder call; does not consult or fill the cache (see :meth:`embedding`).
        """
        M = mtmd_lib()
        if not chunk.is_image:
            raise MediaError("only image chunks can be encoded")
        if chunk.placeholder:
            raise MediaError("a placeholder chunk (tokenized without pixels) cannot be encoded")
        ptr = chunk.native()
        with self._lock:
            ctx = self._native()
            take_native_errors()
            t0 = time.perf_counter()
            rc = M.mtmd_encode_chunk(ctx, ptr)
            dt = time.perf_counter() - t0
            if rc != 0:
                detail = take_native_errors()
                raise MediaError(
                    f"the vision encoder failed on {chunk.image!r} (code {rc}"
                    + (f": {detail}" if detail else "") + ")"
                )
            out = M.mtmd_get_output_embd(ctx)
            n = chunk.n_tokens
            arr = np.ctypeslib.as_array(out, shape=(n, self.n_embd)).copy()
        arr.setflags(write=False)
        self.stats.add(encoder_runs=1, encode_seconds=dt)
        if not np.isfinite(arr).all():
            raise MediaError(f"the vision encoder produced non-finite values for {chunk.image!r}")
        return arr

    def _encode(self, img: Image, chunks: list[MediaChunk]) -> ImageEmbedding:
        t0 = time.perf_counter()
        arrays = tuple(self.encode_chunk(c) for c in sorted(chunks, key=lambda c: c.sub_index))
        return ImageEmbedding(img.hash, self.identity, arrays, time.perf_counter() - t0)

    # decode

    def decode_chunk(
        self,
        ctx: Context,
        chunk: MediaChunk,
        seq: int,
        pos: int,
        *,
        embedding: ImageEmbedding | None = None,
        logits_last: bool = False,
        n_batch: int | None = None,
        piece: int | None = None,
    ) -> int:
        """Decode an image chunk's embeddings into sequence ``seq`` from KV position ``pos``.

        ``piece`` decodes only that sub-batch (0 .. :meth:`pieces` - 1), so that a scheduler
        can interleave a big image with other work; the pieces together decode exactly what
        one call does. A failing piece removes the whole image from ``pos`` on.

        The embeddings come from ``embedding`` (as returned by :meth:`embed`), else from the
        cache, else the encoder runs. Returns the next free position (``pos + chunk.n_pos``).
        ``logits_last`` computes logits for the last embedding (:meth:`decode_chunk_logits`
        returns them). Causal projectors are decoded in sub-batches of ``n_batch`` (default
        the context's); non-causal ones (gemma3) in one batch, which must fit the context's
        micro-batch.

        On failure nothing stays in ``seq`` from ``pos`` on (whatever was decoded is
        removed) and :class:`~nbkv.core.errors.DecodeError` (or a pre-flight
        :class:`~nbkv.core.errors.MediaError` / :class:`~nbkv.core.errors.ContextOverflowError`,
        before anything ran) is raised.
        """
        self._decode(ctx, chunk, seq, pos, embedding, logits_last, n_batch, piece)
        return pos + chunk.n_pos

    def pieces(self, ctx: Context, chunk: MediaChunk, n_batch: int | None = None) -> int:
        """Sub-batches :meth:`decode_chunk` splits ``chunk`` into (1 for a non-causal one)."""
        M = mtmd_lib()
        n = chunk.n_tokens
        if M.mtmd_decode_use_non_causal(self._native(), chunk.native()):
            return 1
        return len(_split(n, max(1, min(n_batch or ctx.n_batch, ctx.n_ubatch, n))))

    def decode_chunk_logits(
        self, ctx: Context, chunk: MediaChunk, seq: int, pos: int, *,
        embedding: ImageEmbedding | None = None, n_batch: int | None = None,
    ) -> np.ndarray:
        """Like :meth:`decode_chunk` with ``logits_last``; returns a copy of those logits."""
        idx = self._decode(ctx, chunk, seq, pos, embedding, True, n_batch)
        return np.array(ctx.logits(idx), dtype=np.float32)

    def _decode(
        self, ctx: Context, chunk: MediaChunk, seq: int, pos: int,
        embedding: ImageEmbedding | None, logits_last: bool, n_batch: int | None,
        piece: int | None = None,
    ) -> int:
        M = mtmd_lib()
        if not chunk.is_image or chunk.image is None:
            raise MediaError("decode_chunk takes image chunks (text is decoded with a Batch)")
        if not 0 <= seq < ctx.n_seq_max:
            raise MediaError(f"sequence {seq} does not exist (the context has {ctx.n_seq_max})")
        if pos < 0:
            raise MediaError(f"position {pos} is negative")
        end = pos + chunk.n_pos
        if end > ctx.n_ctx_seq:
            raise ContextOverflowError(end, ctx.n_ctx_seq)
        ptr = chunk.native()
        ctx_m = self._native()
        if embedding is None:
            embedding = self.embeddings.get(chunk.image, chunk._prompt)
        if embedding.image_hash != chunk.image.hash or embedding.projector_id != self.identity:
            raise MediaError("these embeddings belong to another image or projector")
        if chunk.sub_index >= len(embedding.arrays):
            raise MediaError("the embeddings have fewer chunks than the image")
        embd = embedding.arrays[chunk.sub_index]
        n = chunk.n_tokens
        if embd.shape != (n, self.n_embd) or embd.dtype != np.float32:
            raise MediaError(
                f"embeddings of shape {embd.shape} do not fit a chunk of {n} x {self.n_embd}"
            )
        embd = np.ascontiguousarray(embd)
        non_causal = bool(M.mtmd_decode_use_non_causal(ctx_m, ptr))
        n_ubatch = ctx.n_ubatch
        if non_causal and n > n_ubatch:
            # llama.cpp asserts (aborts) on this: non-causal attention needs the whole image in
            # one micro-batch
            raise MediaError(
                f"this projector attends over a whole image at once ({n} embeddings), but the "
                f"context's micro-batch holds {n_ubatch}: create it with n_batch >= {n}"
            )
        step = n if non_causal else max(1, min(n_batch or ctx.n_batch, n_ubatch, n))
        n_pos_per = 4 if self.uses_mrope else 1
        positions = np.empty((n_pos_per, n), dtype=np.int32)
        if self.uses_mrope:
            imgt = M.mtmd_input_chunk_get_tokens_image(ptr)
            for i in range(n):
                d = M.mtmd_image_tokens_get_decoder_pos(imgt, pos, i)
                positions[:, i] = (d.t, d.y, d.x, d.z)
        else:
            positions[0] = np.arange(pos, pos + n, dtype=np.int32)
        last_index = -1
        t0 = time.perf_counter()
        try:
            off = 0
            sizes = _split(n, step)
            for i, k in enumerate(sizes):
                if piece is not None and i != piece:
                    off += k
                    continue
                last = logits_last and off + k == n
                ctx.decode_embeddings(embd[off : off + k], positions[:, off : off + k], seq,
                                      logits_last=last, causal=not non_causal)
                if last:
                    last_index = k - 1
                off += k
        except BaseException:
            ctx.try_seq_rm(seq, pos, -1)
            raise
        if piece is None or piece == len(sizes) - 1:  # the last piece completes the chunk
            self.stats.add(chunks_decoded=1, embeddings_decoded=n, positions_decoded=chunk.n_pos)
        self.stats.add(decode_seconds=time.perf_counter() - t0)
        return last_index


def _split(n: int, step: int) -> list[int]:
    """Sub-batch sizes for ``n`` embeddings, at most ``step`` each, never a lone last one.

    llama.cpp's CPU kernels compute a one-row batch differently from larger ones (see the
    docs/concepts/exactness.md); this keeps an image's decode on the multi-row path whenever
    ``n >= 2`` and ``step >= 3``, whatever ``n % step`` is.
    """
    sizes = [step] * (n // step) + ([n % step] if n % step else [])
    if len(sizes) >= 2 and sizes[-1] == 1 and step >= 3:
        sizes[-2] -= 1
        sizes[-1] = 2
    return sizes
