"""One conversation record (issue 30): its checks, and the codec that writes it (no model)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from nbkv.core.errors import RestoreError
from nbkv.core.events import Segment
from nbkv.kv.slot_table import Conversation, SlotState
from nbkv.store.blobstore import Blobs
from nbkv.store.parked import ParkedEntry, entry_from_json, entry_json, info_from_json

SEGS = (Segment(0, 5, 0, "user", "kept", "hi"), Segment(5, 9, 1, "assistant", "generated"))


def test_the_record_checks_its_parts():
    c = Conversation("ann", [1, 2, 3, 4], ["a", "b"], [2, 4], checkpoints=[2])
    assert (c.tokens, c.hashes, c.msg_ends, c.checkpoints) == ((1, 2, 3, 4), ("a", "b"),
                                                               (2, 4), (2,))
    assert c.settled == 4 == c.n_tokens  # -1: every token
    # boundaries known without their hashes (an OpenAI-compatible server's cache row)
    assert Conversation(None, (1, 2, 3), (), (3,)).msg_ends == (3,)
    bad = [dict(msg_ends=(2, 5)),  # a boundary past the tokens
           dict(msg_ends=(0, 4)),  # ... or at nothing
           dict(hashes=("a",)),  # one hash, two boundaries
           dict(checkpoints=(5,)),
           dict(settled=5)]
    for kw in bad:
        with pytest.raises(ValueError):
            replace(c, **kw)


def test_held_keeps_what_the_kv_holds_and_cut_clips_the_map():
    # a live slot's bookkeeping ahead of its KV (cut back to a checkpoint): not kept
    c = Conversation.held("ann", range(6), ("a", "b"), (5, 9), SEGS, 3, 7, 1.5, 8, (4, 8))
    assert (c.hashes, c.msg_ends, c.checkpoints, c.settled) == (("a",), (5,), (4,), 6)
    assert c.segments == SEGS  # the map stays as the slot shows it
    full = Conversation("ann", range(9), ("a", "b"), (5, 9), SEGS, 3, 7, 1.5, 8, (4, 8))
    cut = full.cut(6)
    assert (cut.tokens, cut.hashes, cut.msg_ends, cut.checkpoints, cut.settled) == (
        tuple(range(6)), ("a",), (5,), (4,), 6)
    assert [(g.start, g.end) for g in cut.segments] == [(0, 5), (5, 6)]
    assert (cut.session, cut.last_used, cut.last_request, cut.used_at) == ("ann", 3, 7, 1.5)
    # a saved slot's record cut where its restored KV ends (the engine's held_state)
    st = SlotState(0, full, None)
    assert replace(st, conversation=st.conversation.cut(5)).msg_ends == (5,)


def _entry() -> ParkedEntry:
    return ParkedEntry("ann", list(range(1, 10)), ["h1", "h2"], [5, 9], b"state-bytes",
                       [(5, b"cp5")], SEGS, 7, 8, 3, 11, "ann#1", 1234.5)


def _name(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() + ".bin"


#: what nbkv wrote for :func:`_entry` before the record existed (the save format, as is)
SAVED = {
    "key": "ann#1", "session": "ann", "tokens": list(range(1, 10)), "n_tokens": 9,
    "hashes": ["h1", "h2"], "msg_ends": [5, 9],
    "segments": [{"start": 0, "end": 5, "message": 0, "role": "user", "state": "kept",
                  "preview": "hi", "kind": "text", "image_hash": None, "image_name": "",
                  "embeddings": 0},
                 {"start": 5, "end": 9, "message": 1, "role": "assistant",
                  "state": "generated", "preview": "", "kind": "text", "image_hash": None,
                  "image_name": "", "embeddings": 0}],
    "settled": 7, "exact_len": 8, "last_request": 3, "last_used": 11, "used_at": 1234.5,
    "nbytes": 14, "state": _name(b"state-bytes"),
    "checkpoints": [{"pos": 5, "blob": _name(b"cp5")}],
}


def test_one_codec_writes_the_record_in_the_save_format_as_it_was():
    e = _entry()
    assert e.info("ram").conversation is e.conversation  # one record, carried
    blobs = Blobs()
    assert entry_json(e, blobs) == SAVED
    data = {_name(b"state-bytes"): b"state-bytes", _name(b"cp5"): b"cp5"}
    back = entry_from_json(SAVED, data.__getitem__, 50_000)
    assert back.conversation == e.conversation and back.exact_len == 8
    assert entry_json(back, Blobs()) == SAVED
    info = info_from_json(SAVED, 50_000, "disk")
    assert info.conversation == e.conversation and (info.nbytes, info.tier) == (14, "disk")
    # a record of nbkv 0.1: no key, last_request, used_at or exact_len
    old = {k: v for k, v in SAVED.items()
           if k not in ("key", "last_request", "used_at", "exact_len")}
    e0 = entry_from_json(old, data.__getitem__, 50_000, used_at=99.0)
    assert (e0.key, e0.last_request, e0.used_at, e0.exact_len, e0.settled) == (
        "", None, 99.0, 9, 7)


def test_a_record_whose_parts_disagree_is_refused_by_name():
    with pytest.raises(ValueError, match="parked entry: message hashes and boundaries"):
        ParkedEntry("ann", [1, 2, 3], [], [3], b"s")  # a parked conversation knows them all
    with pytest.raises(ValueError, match="parked entry: a checkpoint lies outside"):
        ParkedEntry("ann", [1, 2, 3], ["a"], [3], b"s", [(4, b"c")])
    for broken in ({**SAVED, "msg_ends": [5, 10]}, {**SAVED, "hashes": ["h1"]}):
        with pytest.raises(RestoreError):
            info_from_json(broken, 50_000, "disk")


def test_an_unnamed_branch_keeps_whose_it_was_through_its_json():
    """An edit's old branch is parked unnamed; the views name it after its session."""
    from nbkv.ui.vocabulary import parked_name

    e = ParkedEntry(None, list(range(1, 10)), ["h1", "h2"], [5, 9], b"state-bytes",
                    [(5, b"cp5")], SEGS, 7, 8, 3, 11, "b#2", 1234.5, branch_of="bob")
    blobs = Blobs()
    saved = entry_json(e, blobs)
    assert saved["branch_of"] == "bob" and saved["session"] is None
    data = {_name(b"state-bytes"): b"state-bytes", _name(b"cp5"): b"cp5"}
    back = entry_from_json(saved, data.__getitem__, 50_000)
    info = info_from_json(saved, 50_000, "disk")
    assert (back.branch_of, e.info("ram").branch_of, info.branch_of) == ("bob",) * 3
    assert [parked_name(x) for x in (info, e.info("ram"), _entry().info("ram"))] == [
        "bob's earlier branch", "bob's earlier branch", "ann"]
    assert parked_name(ParkedEntry(None, [1], ["a"], [1], b"s").info("ram")) == (
        "an earlier branch")
