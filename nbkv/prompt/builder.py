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
from typing import TYPE_CHECKING, Any, NamedTuple

from nbkv.core.config import check_overflow
from nbkv.core.errors import ContextOverflowError, MediaError
from nbkv.core.messages import normalize, prefix_hashes
from nbkv.llama.backend import Model
from nbkv.llama.tokens import longest_piece, tokenize_up_to
from nbkv.media.messages import contains_images, extract_images
from nbkv.media.units import MediaUnit, position_units

if TYPE_CHECKING:
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


#: Bytes one token may stand for, where the vocabulary cannot say (a remote server's): a prompt
#: text longer than this times the slot's size cannot fit it, whatever it tokenizes to.
TOKEN_BYTES = 1024


class _Over(NamedTuple):
    """A prompt too long to fit its slot: its tokens, or a lower bound on them."""

    tokens: int
    at_least: bool


@dataclass
class _Tokens:
    """A rendering and its tokens, before message boundaries are found (see ``_finish``)."""

    msgs: list[dict[str, Any]]  # as the template saw them (images replaced by markers)
    hashed: list[dict[str, Any]]
    head: str
    body: str
    units: list[Any]
    media: MediaPrompt | None


@dataclass(frozen=True)
class PromptBuilder:
    """What preparing a prompt needs from the engine: model, template, projector, slot size.

    The work is bounded by the slot's size, not by the history's: a rendering is read only
    until it is too long to fit (:meth:`_tokenize`), nothing is tokenized that cannot fit, and
    ``overflow="slide"`` searches the cut from the newest messages back (:meth:`_slide`).
    """

    model: Model
    template: ChatTemplate
    projector: Projector | None
    n_ctx: int

    def prepare(self, messages: Sequence[Mapping[str, Any]], overflow: str = "error",
                max_tokens: int = 1) -> Prompt:
        """Validate and tokenize ``messages``; make them fit a slot per ``overflow``.

        ``"error"`` raises :class:`ContextOverflowError` when the prompt fills the slot;
        ``"slide"`` drops the oldest turns (keeping a system prompt) until the prompt and
        ``min(max_tokens, n_ctx // 4)`` reply tokens fit. A prompt whose text alone is too
        long to fit is refused untokenized (the error's count is then a lower bound).
        """
        check_overflow(overflow)
        msgs = normalize(messages)
        got = self._tokenize(msgs)
        if isinstance(got, _Tokens) and len(got.units) < self.n_ctx:
            return self._finish(got)
        if overflow == "error":
            raise self._overflow(got)
        return self._slide(msgs, got, min(max_tokens, self.n_ctx // 4))

    def _overflow(self, got: _Tokens | _Over, reserve: int = 0) -> ContextOverflowError:
        if isinstance(got, _Over):
            return ContextOverflowError(got.tokens, self.n_ctx, reserve, at_least=got.at_least)
        return ContextOverflowError(len(got.units), self.n_ctx, reserve)

    def _slide(self, msgs: list[dict[str, Any]], full: _Tokens | _Over, reserve: int) -> Prompt:
        """Drop the fewest oldest turns so that the prompt and ``reserve`` tokens fit.

        A turn is a message and the replies after it up to the next user message; the last
        message is always kept, and so is a leading system prompt. The cut is searched from
        the newest end (galloping, then halving), so the work is that of a few prompts about
        the slot's size, however long the history; a longer kept history is taken to need
        at least as many tokens as a shorter one.
        """
        if isinstance(full, _Tokens) and len(full.units) + reserve <= self.n_ctx:
            return self._finish(full)  # a slot filled to the last position, no reply reserved
        head = 1 if msgs[0]["role"] == "system" else 0
        starts: list[int] = []  # where the kept messages start after each dropped turn
        i, n_msgs = head, len(msgs)
        while n_msgs - i > 1:
            n = 1
            while i + n < n_msgs - 1 and msgs[i + n]["role"] != "user":
                n += 1
            i += n
            starts.append(i)
        if not starts:
            raise self._overflow(full, reserve)
        tried: dict[int, _Tokens | _Over] = {}

        def fits(j: int) -> bool:
            got = tried[j] = self._tokenize(msgs[:head] + msgs[starts[j]:])
            return isinstance(got, _Tokens) and len(got.units) + reserve <= self.n_ctx

        ok, bad, step = len(starts) - 1, -1, 1  # bad -1: the whole history, known not to fit
        if not fits(ok):
            raise self._overflow(tried[ok], reserve)
        while ok - bad > 1:  # gallop back from the newest end until a cut does not fit
            j = max(ok - step, bad + 1)
            if not fits(j):
                bad = j
                break
            ok, step = j, step * 2
        while ok - bad > 1:
            j = (ok + bad) // 2
            ok, bad = (j, bad) if fits(j) else (ok, j)
        got = tried[ok]
        assert isinstance(got, _Tokens)
        prompt = self._finish(got)
        prompt.dropped = starts[ok] - head
        log.info("overflow: dropped the %d oldest messages to fit %d tokens", prompt.dropped,
                 self.n_ctx)
        return prompt

    def _longest(self) -> int:
        """Bytes the longest token of the vocabulary stands for (:data:`TOKEN_BYTES` if unknown)."""
        if isinstance(self.model, Model):
            return longest_piece(self.model)
        return int(getattr(self.model, "longest_piece", TOKEN_BYTES))

    def _tokenize(self, msgs: list[dict[str, Any]]) -> _Tokens | _Over:
        """Render and tokenize ``msgs``, or say by how much they cannot fit the slot.

        Each token stands for at most :meth:`_longest` bytes, so a text longer than that times
        the slot's size cannot fit: it is neither read whole nor tokenized. A model's text is
        tokenized holding no more token ids than the slot has room for.
        """
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
        cap = self.n_ctx * self._longest()
        body = self.template.render_within(msgs, cap, add_generation_prompt=True)
        if body is None:
            return _Over(self.n_ctx + 1, True)
        model = self.model
        bos = model.bos_text
        head = bos if model.add_bos and bos and not body.startswith(bos) else ""
        if images is not None:
            assert projector is not None
            media = projector.tokenize(head + body, images)
            units: list[Any] = position_units(media.keys())
        elif isinstance(model, Model):
            got = tokenize_up_to(model, head + body, self.n_ctx)
            if isinstance(got, int):
                return _Over(got, False)
            units = got
        else:
            units = model.tokenize(head + body)
        return _Tokens(msgs, hashed, head, body, units, media)

    def _finish(self, t: _Tokens) -> Prompt:
        """The prompt of ``t``: where each message ends, in KV positions, and the hashes."""
        model, projector = self.model, self.projector
        # map the template's character boundaries onto the byte length of each position's
        # text (an image stands for its marker)
        unit_ends, n = [], 0
        for u in t.units:
            if isinstance(u, MediaUnit):
                n += len(projector.marker.encode()) if projector and u.offset == 0 else 0
            else:
                n += len(model.piece(u))
            unit_ends.append(n)
        hashes = prefix_hashes(t.hashed)
        ends, at, size = [], 0, len(t.head.encode())
        for c in self.template.boundaries(t.msgs, t.body, hashes):  # never decreasing
            size += len(t.body[at:c].encode())
            at = c
            ends.append(bisect.bisect_right(unit_ends, size))
        return Prompt(t.hashed, tuple(t.units), hashes, ends, media=t.media)
