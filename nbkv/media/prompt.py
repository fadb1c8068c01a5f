"""A tokenized media prompt: text chunks and image chunks.

:meth:`nbkv.media.projector.Projector.tokenize` makes a :class:`MediaPrompt`; its chunks are what
the engine decodes, one KV span each. (The encoder's output for a picture is
:class:`nbkv.media.embeddings.ImageEmbedding`.)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbkv.core.errors import MediaError
from nbkv.llama.backend import mtmd_lib
from nbkv.media.images import Image
from nbkv.media.units import MediaKey, MediaSpan, position_units, spans


@dataclass(frozen=True, eq=False)
class MediaChunk:
    """One chunk of a :class:`MediaPrompt`: text tokens, or one image's embeddings slot.

    ``n_tokens`` is what the chunk feeds to the model; ``n_pos`` how far it advances the KV
    position (equal, except for M-RoPE models). For an image chunk, ``image`` is the picture,
    ``image_index`` its place among the prompt's images and ``sub_index`` its place among the
    chunks that picture became (tiling projectors make several). ``placeholder`` chunks were
    tokenized without pixels because the embeddings were cached; they cannot be encoded.
    """

    index: int
    kind: str
    n_tokens: int
    n_pos: int
    tokens: tuple[int, ...] = ()
    image: Image | None = None
    image_index: int = -1
    sub_index: int = 0
    placeholder: bool = False
    _prompt: MediaPrompt | None = field(default=None, repr=False)
    _ptr: int | None = field(default=None, repr=False)

    @property
    def is_image(self) -> bool:
        """True for an image chunk."""
        return self.kind == "image"

    @property
    def key(self) -> tuple[int, ...] | MediaKey:
        """What prompt comparisons see: the text tokens, or a :class:`MediaKey`."""
        if self.image is None:
            return self.tokens
        return MediaKey(self.image.hash, self.sub_index, self.n_tokens, self.n_pos)

    def native(self) -> int:
        """The ``mtmd_input_chunk *`` (valid while the prompt is open)."""
        if self._prompt is None or self._prompt.closed or not self._ptr:
            raise MediaError("this chunk's prompt was closed; tokenize again")
        return self._ptr


class MediaPrompt:
    """The chunks of one tokenized prompt; owns the native ``mtmd_input_chunks``.

    Close it (or use ``with``) to free native memory early; garbage collection does too.
    """

    def __init__(self, projector: Any, native: int, images: Sequence[Image]) -> None:
        self.projector = projector  # the nbkv.media.projector.Projector that made it
        self.images = tuple(images)
        self._native = native
        self._finalizer = weakref.finalize(self, mtmd_lib().mtmd_input_chunks_free, native)
        self.chunks: tuple[MediaChunk, ...] = ()

    @property
    def closed(self) -> bool:
        """True once the native chunks were freed."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the native chunks."""
        self._finalizer()

    def __enter__(self) -> MediaPrompt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[MediaChunk]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def n_tokens(self) -> int:
        """Tokens and embeddings fed to the model."""
        return sum(c.n_tokens for c in self.chunks)

    @property
    def n_pos(self) -> int:
        """KV positions the prompt occupies."""
        return sum(c.n_pos for c in self.chunks)

    def keys(self) -> list[tuple[int, ...] | MediaKey]:
        """Chunk keys for :func:`nbkv.media.units.position_units` / prefix comparisons."""
        return [c.key for c in self.chunks]

    def spans(self, start: int = 0) -> list[MediaSpan]:
        """KV span of each chunk when the prompt is decoded from position ``start``."""
        return spans(position_units(self.keys()), start)

    def locate(self, n_pos: int) -> tuple[int, int]:
        """Where KV position ``n_pos`` (relative to the prompt start) falls: (chunk, offset).

        For resuming after a salvaged prefix of ``n_pos`` positions: decode the rest of chunk
        ``chunk`` from ``offset`` (a text chunk), then the following chunks. An image is
        never entered midway: a position inside one raises :class:`MediaError` (snap it with
        :func:`nbkv.media.units.snap_to_media_boundary` first). ``n_pos == self.n_pos`` returns
        ``(len(self.chunks), 0)``.
        """
        if not 0 <= n_pos <= self.n_pos:
            raise MediaError(f"position {n_pos} is outside the prompt (0..{self.n_pos})")
        at = 0
        for i, c in enumerate(self.chunks):
            if n_pos < at + c.n_pos:
                off = n_pos - at
                if c.is_image and off:
                    raise MediaError(f"position {n_pos} falls inside an image (chunk {i})")
                return i, off
            at += c.n_pos
        return len(self.chunks), 0

    def image_chunks(self) -> list[MediaChunk]:
        """The image chunks, in order."""
        return [c for c in self.chunks if c.is_image]

    def __repr__(self) -> str:
        return (
            f"MediaPrompt({len(self.chunks)} chunks, {self.n_tokens} tokens, "
            f"{self.n_pos} positions, {len(self.images)} images)"
        )
