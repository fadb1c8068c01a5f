"""A request's named state and its transitions (nbkv.engine.jobs), with no model."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from nbkv.core.streams import SamplingParams, TextStream
from nbkv.engine.jobs import READING, Job, JobState, JobStateError
from nbkv.media.units import MediaKey, position_units

IMAGE = MediaKey("h", 0, 3, 3)


def job(units: list[Any]) -> Job:
    """A queued request for a prompt of ``units`` (a stand-in prompt: only its tokens)."""
    prompt: Any = SimpleNamespace(tokens=units)
    return Job(prompt, None, SamplingParams(), 1.0,
               TextStream())


SLOT: Any = SimpleNamespace(index=0)


def test_text_prompt_reads_then_samples_and_generates() -> None:
    j = job([1, 2, 3, 4, 5])
    assert j.state is JobState.QUEUED and j.next_token is None
    j.place(SLOT, 2)
    assert j.state is JobState.PREFILL and j.todo == [3, 4, 5] and j.placed_slot is SLOT
    j.read(2)
    assert j.state is JobState.PREFILL and j.todo == [5]
    j.read(1)
    assert j.state is JobState.SAMPLE and not j.todo
    j.sampled(42)
    assert j.state is JobState.GENERATE and j.next_token == 42
    assert j.take_token() == 42
    assert j.state is JobState.SAMPLE and j.next_token is None
    j.finished()
    assert j.state is JobState.DONE


def test_image_in_pieces_and_the_encoder() -> None:
    units = position_units([(1, 2), IMAGE, (7,)])
    j = job(units)
    j.place(SLOT, 0)
    j.read(2)
    assert j.state is JobState.IMAGE  # an image at the head now
    fut: Future[Any] = Future()
    j.wait_encoder(fut)
    assert j.state is JobState.ENCODING and j.state in READING and not j.ready()
    with pytest.raises(JobStateError):
        j.read(3)  # not while it is encoded
    fut.set_result("emb")
    assert j.ready()
    assert j.take_encoding() is fut
    assert j.state is JobState.IMAGE and j.encoding is None
    j.piece_read()
    j.piece_read()
    assert j.state is JobState.IMAGE_PART and j.image_piece == 2
    assert j.drop_pieces()  # cancelled mid-image: the caller trims the KV
    assert j.state is JobState.IMAGE and j.image_piece == 0 and not j.drop_pieces()
    j.piece_read()
    j.read(3)  # the whole image is in
    assert j.state is JobState.PREFILL and j.image_piece == 0 and j.todo == [7]


def test_a_cached_reply_replays() -> None:
    j = job([1, 2, 3])
    memo = object()
    j.place(SLOT, 3, memo=memo, held=2)
    assert j.state is JobState.REPLAY and j.state not in READING
    assert j.memo is memo and j.memo_held == 2


def test_the_system_prompt_capture_is_set_and_cleared_by_the_request() -> None:
    j = job([1, 2, 3, 4])
    assert j.capture_at is None and j.spc_key is None
    j.capture_spc(2, "h")
    assert (j.capture_at, j.spc_key) == (2, "h")
    j.spc_captured()
    assert j.capture_at is None
    with pytest.raises(AttributeError):  # read-only: changed by its transitions only
        j.capture_at = 3  # type: ignore[misc]


def test_transitions_from_the_wrong_state_are_refused() -> None:
    j = job([1, 2])
    with pytest.raises(JobStateError):
        _ = j.placed_slot  # not placed yet
    with pytest.raises(JobStateError):
        _ = j.started
    with pytest.raises(JobStateError):
        j.read(1)
    with pytest.raises(JobStateError):
        j.take_token()
    j.place(SLOT, 0)
    with pytest.raises(JobStateError):
        j.place(SLOT, 0)  # placed once
    with pytest.raises(JobStateError):
        j.sampled(1)  # its prompt is not read yet
    with pytest.raises(JobStateError):
        j.wait_encoder(Future())  # text at its head
    j.finished()
    with pytest.raises(JobStateError):
        j.read(1)


def test_a_slots_phase_is_named_from_what_it_holds() -> None:
    from nbkv.engine.slots import TO_REWRITE, EngineSlot, SlotPhase

    kv: Any = SimpleNamespace(tokens=[], needs_rewrite=False)
    s = EngineSlot(0, 64, kv=kv)
    assert s.phase is SlotPhase.EMPTY
    kv.tokens = [1, 2, 3]
    assert s.phase is SlotPhase.SETTLED
    kv.needs_rewrite = True  # its reply decoded token by token
    assert s.phase is SlotPhase.UNSETTLED and s.phase in TO_REWRITE
    s.redo = [3]  # cut back: its rewrite has begun
    assert s.phase is SlotPhase.REWRITING and s.phase in TO_REWRITE
    s.pending = True  # a request is placed in it: nothing else counts
    assert s.phase is SlotPhase.SERVING and s.phase not in TO_REWRITE
