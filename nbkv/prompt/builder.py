"""Request preparation: messages in, a prepared prompt out (in the caller's thread).

One pass, one direction: validate the messages, take their images out (resolved and
hashed), render the chat template, tokenize (images become one
:class:`~nbkv.media.units.MediaUnit` per KV position), locate each message's end, and apply the
overflow policy. The engine then only schedules the result.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbkv.core.config import check_overflow
from nbkv.core.errors import ContextOverflowError, MediaError
from nbkv.core.messages import normalize, prefix_hashes
from nbkv.media.messages import contains_images, extract_images
from nbkv.media.units import MediaUnit, position_units

if TYPE_CHECKING:
    from nbkv.llama.backend import Model
    from nbkv.media.projector import Projector
    from nbkv.media.prompt import MediaChunk, MediaPrompt
    from nbkv.prompt.templates import ChatTemplate

log = logging.getLogger("nbkv")

@dataclass
class Prompt:
    """A prepared request.

    ``tokens`` has one entry per KV position: a token id, or a :class:`~nbkv.media.units.MediaUnit`
    for each position an image occupies (so prefix comparisons see images by content hash).
    """

    messages: list[dict[str, Any]]  # as hashed: images named by content hash
    tokens: tuple[Any, ...]
    hashes: list[str]
    ends: list[int]  # KV position where each message ends (the generation prompt excluded)
    dropped: int = 0  # oldest messages left out to fit the slot (overflow="slide")
    media: MediaPrompt | None = None  # the tokenized chunks when the prompt has images

    def chunk_for(self, unit: MediaUnit) -> MediaChunk:
        """The image chunk a media position belongs to."""
        assert self.media is not None
        return next(c for c in self.media.chunks if c.is_image and c.key == unit.key)

    @property
    def image_chunks(self) -> int:
        """Image chunks in the prompt."""
        return len(self.media.image_chunks()) if self.media is not None else 0


@dataclass(frozen=True)
class PromptBuilder:
    """What preparing a prompt needs from the engine: model, template, projector, slot size."""

    model: Model
    template: ChatTemplate
    projector: Projector | None
    n_ctx: int

    def prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str = "error",
                max_tokens: int = 1) -> Prompt:
        """Validate and tokenize ``messages``; make them fit a slot per ``overflow``.

        ``"error"`` raises :class:`ContextOverflowError` when the prompt fills the slot;
        ``"slide"`` drops the oldest turns (keeping a system prompt) until the prompt and
        ``min(max_tokens, n_ctx // 4)`` reply tokens fit.
        """
        check_overflow(overflow)
        msgs = normalize(messages)
        prompt = self._tokenize(msgs)
        if len(prompt.tokens) < self.n_ctx:
            return prompt
        if overflow == "error":
            raise ContextOverflowError(len(prompt.tokens), self.n_ctx)
        reserve = min(max_tokens, self.n_ctx // 4)
        keep_head = 1 if msgs[0]["role"] == "system" else 0
        dropped = 0
        while len(prompt.tokens) + reserve > self.n_ctx:
            if len(msgs) - keep_head <= 1:
                raise ContextOverflowError(len(prompt.tokens), self.n_ctx, reserve)
            # drop the oldest turn: a user message and the replies that follow it
            n = 1
            while keep_head + n < len(msgs) - 1 and msgs[keep_head + n]["role"] != "user":
                n += 1
            del msgs[keep_head : keep_head + n]
            dropped += n
            prompt = self._tokenize(msgs)
        prompt.dropped = dropped
        log.info("overflow: dropped the %d oldest messages to fit %d tokens", dropped, self.n_ctx)
        return prompt

    def _tokenize(self, msgs: list[dict[str, Any]]) -> Prompt:
        media, images = None, None
        hashed = msgs
        projector = self.projector
        if contains_images(msgs):
            if projector is None:
                raise MediaError(
                    "the messages contain images but this engine has no vision projector: "
                    "create it with Engine(model, mmproj='...mmproj.gguf')"
                )
            mm = extract_images(msgs, projector.marker)
            msgs, hashed, images = mm.messages, mm.for_hashing(), mm.images
        body = self.template.render(msgs, add_generation_prompt=True)
        model = self.model
        bos = model.bos_text
        head = bos if model.add_bos and bos and not body.startswith(bos) else ""
        if images is not None:
            assert projector is not None
            media = projector.tokenize(head + body, images)
            units: list[Any] = position_units(media.keys())
        else:
            units = model.tokenize(head + body)
        # where each message ends, in KV positions: map the template's character boundaries
        # onto the byte length of each position's text (an image stands for its marker)
        unit_ends, n = [], 0
        for u in units:
            if isinstance(u, MediaUnit):
                n += len(projector.marker.encode()) if projector and u.offset == 0 else 0
            else:
                n += len(model.piece(u))
            unit_ends.append(n)
        skip = len(head.encode())
        hashes = prefix_hashes(hashed)
        ends = [
            bisect.bisect_right(unit_ends, skip + len(body[:c].encode()))
            for c in self.template.boundaries(msgs, body, hashes)
        ]
        return Prompt(hashed, tuple(units), hashes, ends, media=media)
