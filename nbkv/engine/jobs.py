"""A request in flight, as the engines and :class:`~nbkv.core.streams.ChatStream` see it.

A request's life in its slot is one named state (:class:`JobState`, as llama.cpp's server
keeps a ``slot_state`` per slot), changed only by the :class:`Job`'s own methods; the
scheduler's step dispatches on it (:mod:`nbkv.engine.scheduler`)::

    QUEUED --place--> PREFILL, IMAGE (prompt positions left: text first, an image first)
           |          IMAGE --wait_encoder--> ENCODING --take_encoding--> IMAGE
           |          IMAGE --piece_read--> IMAGE_PART (a big image, one sub-batch a step)
           |          PREFILL, IMAGE, IMAGE_PART --read--> the state of what is left, or
           |          SAMPLE --sampled--> GENERATE --take_token--> SAMPLE --> ...
           +--place (a reply its slot holds)--> REPLAY
    any state --finished--> DONE
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nbkv.core.errors import NbkvError
from nbkv.core.events import RequestCounts, RequestRecord
from nbkv.core.streams import Request, SamplingParams
from nbkv.media.units import MediaUnit

if TYPE_CHECKING:
    from nbkv.core.streams import TextStream
    from nbkv.engine.drafts import NgramDrafter
    from nbkv.engine.slots import EngineSlot
    from nbkv.llama.tokens import Sampler
    from nbkv.prompt.builder import Prompt


class JobState(enum.Enum):
    """Where a request is in its life (one at a time)."""

    QUEUED = "queued"  # waiting for a slot
    PREFILL = "prefill"  # prompt positions left to read, text first
    IMAGE = "image"  # an image first, none of it in the KV yet
    ENCODING = "encoding"  # an image first, its embeddings being computed on the encoder's thread
    IMAGE_PART = "image part"  # an image first, some of its sub-batches in the KV (``image_piece``)
    SAMPLE = "sample"  # the logits of its last position are computed: sample a token
    GENERATE = "generate"  # a sampled token waits to be decoded (``next_token``)
    REPLAY = "replay"  # answered with a reply its slot holds: nothing to decode
    DONE = "done"  # finished, failed or cancelled


#: the states in which a request reads prompt positions (a prefill chunk or an image)
READING = frozenset({JobState.PREFILL, JobState.IMAGE, JobState.ENCODING,
                     JobState.IMAGE_PART})
_IMAGE = frozenset({JobState.IMAGE, JobState.ENCODING, JobState.IMAGE_PART})


class JobStateError(NbkvError):
    """A request was asked to change state from a state that does not allow it (a bug)."""


class Job(Request):
    """A request inside the in-kernel scheduler."""

    def __init__(self, prompt: Prompt, session: str | None, params: SamplingParams,
                 timeout: float, text: TextStream, *, replay: bool = False,
                 drafter: NgramDrafter | None = None) -> None:
        super().__init__(session, params, timeout)
        self.prompt = prompt
        self.text = text
        self.state = JobState.QUEUED
        self.slot: EngineSlot | None = None
        self.todo: list[Any] = []  # prompt positions still to prefill (read only: read())
        self.reuse = 0
        self._capture_at: int | None = None  # SPC: save the slot's state at this length
        self._spc_key: str | None = None
        self.sampler: Sampler | None = None
        self._next: int | None = None  # GENERATE: the token to decode
        self._encoding: Future[Any] | None = None  # ENCODING: the vision encoder's work
        self._pieces = 0  # IMAGE_PART: sub-batches of the image already in KV
        self.t_prefill = 0.0
        self.first_decode_s = 0.0  # sampling the first token from the prefill's last logits
        self.absorbed_s = 0.0  # of the prefill: re-reading the previous reply (not rewritten)
        self.t_last_progress = 0.0
        self.drafter = drafter  # speculative guesses from the prompt and reply (None: off)
        self.drafted = 0  # guesses decoded (speculative, exact mode)
        self.accepted = 0  # guesses the model confirmed
        self.embeddings: dict[str, Any] = {}  # image hash -> its embeddings, once known
        self.encoder_runs = 0  # images this request sent through the vision encoder
        self.embedding_hits = 0  # images whose embeddings came from the cache
        self.stops: tuple[int, ...] = ()  # KV positions where a checkpoint is taken
        self.replay = replay  # may be answered with a reply the cache holds (nbkv.engine.decoder)
        self._memo: Any = None  # the nbkv.kv.replies.ReplyMemo a replay answers it with
        self._memo_held = 0  # how many of the memo's tokens the slot holds after the prompt
        self.counts = RequestCounts()  # its decodes, rows, host time, bytes (nbkv.core.events)

    # ------------------------------------------------------------------ reading

    @property
    def next_token(self) -> int | None:
        """The sampled token waiting for its decode (GENERATE), else None."""
        return self._next

    @property
    def encoding(self) -> Future[Any] | None:
        """The vision encoder's work for the image at the head of the prompt (ENCODING)."""
        return self._encoding

    @property
    def image_piece(self) -> int:
        """Sub-batches of the image at the head of the prompt already in the KV."""
        return self._pieces

    @property
    def memo(self) -> Any:
        """The :class:`~nbkv.kv.replies.ReplyMemo` it is answered with (REPLAY), else None."""
        return self._memo

    @property
    def memo_held(self) -> int:
        """How many of the memo's reply tokens the slot holds after the prompt."""
        return self._memo_held

    @property
    def capture_at(self) -> int | None:
        """SPC: the KV length at which the slot's state is saved (None: not, or done)."""
        return self._capture_at

    @property
    def spc_key(self) -> str | None:
        """SPC: the system prompt's hash its state is saved under."""
        return self._spc_key

    def capture_spc(self, at: int, key: str) -> None:
        """SPC: save the slot's state under ``key`` when its prefill reaches ``at``."""
        self._capture_at, self._spc_key = at, key

    def spc_captured(self) -> None:
        """SPC: the prefill passed the capture point (saved, or not exactly there)."""
        self._capture_at = None

    @property
    def placed_slot(self) -> EngineSlot:
        """The slot serving this request (once placed)."""
        if self.slot is None:
            raise JobStateError(f"request {self.id} has no slot ({self.state.value})")
        return self.slot

    @property
    def started(self) -> RequestRecord:
        """The record started when it was placed."""
        if self.record is None:
            raise JobStateError(f"request {self.id} has no record ({self.state.value})")
        return self.record

    def ready(self) -> bool:
        """Whether a step can advance it now (not waiting for the vision encoder)."""
        return self._encoding is None or self._encoding.done()

    # -------------------------------------------------------------- transitions

    def _expect(self, *states: JobState) -> None:
        if self.state not in states:
            raise JobStateError(f"request {self.id}: {self.state.value}, expected "
                                f"{' or '.join(s.value for s in states)}")

    def _reading(self) -> JobState:
        """The state its prompt positions left put it in."""
        if not self.todo:
            return JobState.SAMPLE
        return JobState.IMAGE if isinstance(self.todo[0], MediaUnit) else JobState.PREFILL

    def place(self, slot: EngineSlot, reuse: int, memo: Any = None, held: int = 0) -> None:
        """QUEUED: it is served by ``slot``, which holds its first ``reuse`` positions.

        With ``memo`` (a reply the slot holds, ``held`` of its tokens after the prompt) it
        is answered without a decode (REPLAY).
        """
        self._expect(JobState.QUEUED)
        self.slot, self.reuse, self._memo, self._memo_held = slot, reuse, memo, held
        self.todo = list(self.prompt.tokens[reuse:])
        self.state = JobState.REPLAY if memo is not None else self._reading()

    def read(self, n: int) -> None:
        """Its next ``n`` prompt positions are in the KV now (text, or a whole image)."""
        self._expect(*READING)
        if self.state is JobState.ENCODING:
            raise JobStateError(f"request {self.id}: its image is still being encoded")
        del self.todo[:n]
        self._pieces = 0
        self.state = self._reading()

    def wait_encoder(self, fut: Future[Any]) -> None:
        """IMAGE: the encoder computes its image's embeddings on its thread (``fut``)."""
        self._expect(JobState.IMAGE, JobState.IMAGE_PART)
        self._encoding = fut
        self.state = JobState.ENCODING

    def take_encoding(self) -> Future[Any] | None:
        """The encoder's work, if it waited for it (then IMAGE again); None otherwise."""
        self._expect(*_IMAGE)
        fut, self._encoding = self._encoding, None
        if self.state is JobState.ENCODING:
            self.state = JobState.IMAGE_PART if self._pieces else JobState.IMAGE
        return fut

    def piece_read(self) -> None:
        """One more sub-batch of the image at its head is in the KV (IMAGE_PART)."""
        self._expect(JobState.IMAGE, JobState.IMAGE_PART)
        self._pieces += 1
        self.state = JobState.IMAGE_PART

    def drop_pieces(self) -> bool:
        """Forget the sub-batches of an image decoded so far; True if there were any.

        The caller then trims the KV back to the slot's tokens (``kv.resync()``).
        """
        if not self._pieces:
            return False
        self._pieces = 0
        if self.state is JobState.IMAGE_PART:
            self.state = JobState.IMAGE
        return True

    def sampled(self, token: int) -> None:
        """SAMPLE: ``token`` was sampled and streamed; it waits for its decode."""
        self._expect(JobState.SAMPLE)
        self._next = token
        self.state = JobState.GENERATE

    def take_token(self) -> int:
        """GENERATE: the token to decode now (its logits come next: SAMPLE)."""
        self._expect(JobState.GENERATE)
        assert self._next is not None
        tok, self._next = self._next, None
        self.state = JobState.SAMPLE
        return tok

    def finished(self) -> None:
        """It ends (from any state): nothing more is decoded for it."""
        self._next = None
        self._encoding = None
        self.state = JobState.DONE


def finished_record(job: Job, rec: Any, reason: str, error: BaseException | None, now: float,
                    segments: Any, mixed: int = 0) -> Any:
    """``rec`` completed with what the request did: tokens, timings, encoder and guesses.

    ``mixed``: the reply rows the shadow rewrote as the reply was generated.
    """
    t_first = job.t_first or now
    return rec.evolve(
        first_decode_s=job.first_decode_s if job.t_first else rec.first_decode_s,
        rewrite_absorbed_s=rec.rewrite_absorbed_s + job.absorbed_s,
        generated_tokens=len(job.generated),
        prefilled_tokens=rec.prefilled_tokens - len(job.todo),
        ttft_s=(t_first - job.t_submit) if job.t_first else 0.0,
        prefill_s=(t_first - job.t_prefill) if job.t_prefill and job.t_first else 0.0,
        wait_s=max(job.t_prefill - job.t_submit - rec.restore_s, 0.0) if job.t_prefill
        else 0.0,
        decode_s=(now - t_first) if job.t_first else 0.0,
        finish_reason=reason,
        encoder_runs=job.encoder_runs,
        embedding_cache_hits=job.embedding_hits,
        draft_tokens=job.drafted,
        draft_accepted=job.accepted,
        error=None if error is None else f"{type(error).__name__}: {error}",
        segments=segments,
        decode_calls=job.counts.decode_calls,
        rows_computed=job.counts.rows,
        prefill_calls=job.counts.prefill_calls,
        prefill_rows=job.counts.prefill_rows,
        kv_bytes=job.counts.kv_bytes,
        host_parts=tuple(sorted(job.counts.host_s.items())),
        rewrite_mixed=mixed,
    )
