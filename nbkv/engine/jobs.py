"""A request in flight, as the engines and :class:`~nbkv.core.streams.ChatStream` see it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nbkv.core.requests import Request, SamplingParams

if TYPE_CHECKING:
    from nbkv.engine.drafts import NgramDrafter
    from nbkv.engine.scheduler import EngineSlot
    from nbkv.llama.sampling import Sampler
    from nbkv.prompt.builder import Prompt
    from nbkv.prompt.textstream import TextStream


class Job(Request):
    """A request inside the in-kernel scheduler."""

    def __init__(self, prompt: Prompt, session: str | None, params: SamplingParams,
                 timeout: float, text: TextStream) -> None:
        super().__init__(session, params, timeout)
        self.prompt = prompt
        self.text = text
        self.slot: EngineSlot | None = None
        self.todo: list[Any] = []  # prompt positions still to prefill
        self.reuse = 0
        self.capture_at: int | None = None  # SPC: save the slot's state at this length
        self.spc_key: str | None = None
        self.sampler: Sampler | None = None
        self.next_token: int | None = None
        self.t_prefill = 0.0
        self.t_last_progress = 0.0
        self.drafter: NgramDrafter | None = None
        self.drafted = 0  # guesses decoded (speculative, exact mode)
        self.accepted = 0  # ... that the model confirmed
        self.encoding: Future | None = None  # the vision encoder working for this request
        self.image_piece = 0  # sub-batches of the image at the head of todo already in KV
        self.embeddings: dict[str, Any] = {}  # image hash -> its embeddings, once known
        self.encoder_runs = 0  # images this request sent through the vision encoder
        self.embedding_hits = 0  # images whose embeddings came from the cache
        self.stops: tuple[int, ...] = ()  # KV positions where a checkpoint is taken
