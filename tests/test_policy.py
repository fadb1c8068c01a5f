"""Slot selection, LRU and pending rules, and admissions, with fake slots and no model."""

from dataclasses import dataclass, field

import pytest

from nbkv.core.messages import prefix_hashes
from nbkv.kv import admission as ad
from nbkv.kv import policy
from nbkv.kv.invariance import PrefillRule


@dataclass
class FakeSlot:
    index: int
    tokens: list = field(default_factory=list)
    hashes: list = field(default_factory=list)
    msg_ends: list = field(default_factory=list)
    session: str | None = None
    last_used: int = 0
    pending: bool = False
    checkpoints: tuple = ()
    settled: int = 1 << 30
    cut_floor: int = 0


def conv(*contents):
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return [{"role": r, "content": c} for r, c in zip(roles, contents)]


def slot_with(index, msgs, tokens, ends, **kw):
    return FakeSlot(index, list(tokens), prefix_hashes(msgs), list(ends), **kw)


SYS = list(range(1000, 1150))  # 150 system tokens


def test_common_prefix():
    assert policy.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert policy.common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert policy.common_prefix([], [1]) == 0
    assert policy.common_prefix((5,), [6]) == 0
    a = list(range(5000))
    b = a[:3333] + [-1] + a[3334:]
    assert policy.common_prefix(a, b) == 3333


def test_empty_engine_is_a_miss_on_first_empty_slot():
    slots = [FakeSlot(0), FakeSlot(1)]
    msgs = conv("sys", "hi")
    plan = policy.select(slots, SYS + [1, 2], prefix_hashes(msgs))
    assert plan.strategy == policy.MISS and plan.slot == 0 and plan.reuse == 0


def test_hash_extend_reuses_whole_slot():
    msgs = conv("sys", "hi", "hello!")
    cached = SYS + [1, 2] + [7, 7]  # prompt (2 msgs) + generated reply
    s = slot_with(0, msgs[:3], cached, [150, 152, 152], session="a", last_used=5)
    req = msgs[:3] + [{"role": "user", "content": "more"}]
    tokens = cached + [9, 3, 4]
    plan = policy.select([FakeSlot(1), s], tokens, prefix_hashes(req), session="a")
    assert plan.strategy == policy.HASH_EXTEND
    assert plan.slot == 0 and plan.reuse == len(cached) and plan.donor is None
    assert plan.matched_messages == 3


def test_best_hash_coverage_wins():
    msgs = conv("sys", "q1", "a1", "q2")
    short = slot_with(0, msgs[:2], SYS + [1], [150, 151], last_used=9)
    long = slot_with(1, msgs[:4], SYS + [1, 2, 3], [150, 151, 152, 153], last_used=1)
    plan = policy.select([short, long], SYS + [1, 2, 3, 4], prefix_hashes(msgs))
    assert plan.slot == 1 and plan.matched_messages == 4


def test_pending_slots_are_skipped_and_all_pending_returns_none():
    msgs = conv("sys", "q1")
    s0 = slot_with(0, msgs, SYS + [1], [150, 151], pending=True)
    s1 = FakeSlot(1)
    more = msgs + [{"role": "user", "content": "x"}]
    plan = policy.select([s0, s1], SYS + [1, 2], prefix_hashes(more))
    assert plan.slot == 1  # the matching slot is pending: never shared
    s1.pending = True
    assert policy.select([s0, s1], SYS + [1, 2], prefix_hashes(msgs)) is None


def test_hash_match_with_drifting_tokens_falls_back_to_prefix_salvage():
    msgs = conv("sys", "q1")
    cached = SYS + [1, 2, 3]
    s = slot_with(0, msgs, cached, [150, 153], session="a")
    drifted = SYS[:120] + [-5] * 30 + [1, 2, 3, 4]  # same messages, template drift at 120
    plan = policy.select([s], drifted, prefix_hashes(msgs + [{"role": "user", "content": "n"}]),
                         session="a", min_tokens=100)
    assert plan.strategy == policy.PREFIX_SALVAGE and plan.reuse == 120 and plan.slot == 0


def test_prefix_below_min_tokens_is_a_miss():
    s = slot_with(0, conv("sys", "q"), SYS[:50] + [1], [50, 51], session="a", last_used=3)
    other = conv("other", "x")
    plan = policy.select([s, FakeSlot(1)], SYS[:50] + [8, 9], prefix_hashes(other),
                         min_tokens=100)
    assert plan.strategy == policy.MISS and plan.slot == 1


def test_lru_eviction_when_full():
    a = slot_with(0, conv("a", "q"), [1, 2], [1, 2], session="a", last_used=7)
    b = slot_with(1, conv("b", "q"), [3, 4], [1, 2], session="b", last_used=2)
    c = slot_with(2, conv("c", "q"), [5, 6], [1, 2], session="c", last_used=5)
    plan = policy.select([a, b, c], [9, 9, 9], prefix_hashes(conv("d", "q")), session="d")
    assert plan.strategy == policy.MISS and plan.slot == 1
    assert plan.evicted == "b" and plan.evicted_tokens == 2


def test_lru_skips_pending():
    a = FakeSlot(0, [1], session="a", last_used=1, pending=True)
    b = FakeSlot(1, [2], session="b", last_used=2)
    assert policy.lru([s for s in (a, b) if not s.pending]).index == 1


def test_shared_system_prompt_is_copied_to_an_empty_slot_not_trimmed_in_place():
    a_msgs = conv("long system", "question A", "answer A")
    a = slot_with(0, a_msgs, SYS + [1, 2, 3], [150, 152, 153], session="A", last_used=4)
    b_req = conv("long system", "question B")
    plan = policy.select([a, FakeSlot(1)], SYS + [5, 6], prefix_hashes(b_req), session="B")
    assert plan.strategy == policy.HASH_EXTEND  # the system message hash matches
    assert plan.reuse == 150 and plan.slot == 1 and plan.donor == 0


def test_same_session_edit_trims_in_place():
    msgs = conv("sys", "q1", "a1", "q2", "a2")
    s = slot_with(0, msgs, SYS + [1, 2, 3, 4], [150, 151, 152, 153, 154], session="A")
    edited = msgs[:3] + [{"role": "user", "content": "q2 edited"}]
    plan = policy.select([s, FakeSlot(1)], SYS + [1, 2, 8], prefix_hashes(edited), session="A")
    assert plan.slot == 0 and plan.donor is None and plan.reuse == 152
    assert plan.matched_messages == 3


def test_copy_into_lru_victim_when_no_empty_slot():
    a = slot_with(0, conv("sys", "qa", "aa"), SYS + [1, 2], [150, 151, 152], session="A",
                  last_used=9)
    z = slot_with(1, conv("z", "q"), [7, 7], [1, 2], session="Z", last_used=1)
    plan = policy.select([a, z], SYS + [4], prefix_hashes(conv("sys", "qb")), session="B")
    assert plan.slot == 1 and plan.donor == 0 and plan.reuse == 150 and plan.evicted == "Z"


def test_pure_hit_keeps_the_last_prompt_token_for_logits():
    msgs = conv("sys", "q")
    tokens = SYS + [1, 2]
    s = slot_with(0, msgs, tokens + [5, 5], [150, 151], session="A")
    plan = policy.select([s], tokens, prefix_hashes(msgs), session="A")
    assert plan.strategy == policy.HASH_HIT and plan.reuse == len(tokens) - 1


def test_pick_free_prefers_own_then_empty_then_lru():
    a = FakeSlot(0, [1], session="a", last_used=5)
    b = FakeSlot(1, [2], session="b", last_used=1)
    e = FakeSlot(2)
    assert policy.pick_free([a, b, e], "a").index == 0
    assert policy.pick_free([a, b, e], "x").index == 2
    assert policy.pick_free([a, b], "x").index == 1
    a.pending = b.pending = True
    assert policy.pick_free([a, b], "a") is None


@pytest.mark.parametrize("n", [0, 1, 7])
def test_prefix_hashes_chain(n):
    msgs = conv(*[f"m{i}" for i in range(n + 1)])
    h = prefix_hashes(msgs)
    assert len(h) == len(msgs) and len(set(h)) == len(h)
    assert prefix_hashes(msgs, h[:2]) == h
    changed = [dict(m) for m in msgs]
    changed[0]["content"] = "other"
    assert not set(prefix_hashes(changed)) & set(h)
    role_changed = [dict(m) for m in msgs]
    role_changed[0]["role"] = "user"
    assert prefix_hashes(role_changed)[0] != h[0]


def test_salvaging_another_conversation_in_its_own_slot_takes_that_slot():
    # the donor is also the LRU slot: its conversation is cut short, and the plan says whose
    donor = FakeSlot(0, list(range(300)), ["h1", "h2"], [150, 300], "alice", last_used=1)
    busy = FakeSlot(1, list(range(1000, 1100)), ["x"], [100], "carol", last_used=2,
                    pending=True)
    plan = policy.select([donor, busy], list(range(150)) + [7, 8, 9], ["z"], "bob",
                         min_tokens=100)
    assert plan.slot == 0 and plan.donor is None and plan.reuse == 150
    assert plan.evicted == "alice" and plan.evicted_tokens == 150


# ------------------------------------------------------------------ parked conversations


@dataclass(frozen=True)
class FakeParked:
    key: str
    tokens: tuple
    hashes: tuple
    msg_ends: tuple
    session: str | None = None
    last_used: int = 0
    checkpoints: tuple = ()
    settled: int = 1 << 30


def parked_with(key, msgs, tokens, ends, **kw):
    return FakeParked(key, tuple(tokens), tuple(prefix_hashes(msgs)), tuple(ends), **kw)


ALICE = conv("sys", "qa", "aa")  # alice's conversation: system, question, answer
ALICE_TOKENS = SYS + list(range(1, 61)) + list(range(61, 91))  # 150 + 60 + 30
ALICE_ENDS = [150, 210, 240]


def full_slots():
    """Two slots held by bob and carol, who share nothing with alice but the system prompt."""
    bob = slot_with(0, conv("sys", "qb"), SYS + [500, 501], [150, 152], session="bob",
                    last_used=5)
    carol = slot_with(1, conv("other", "qc"), [7, 7, 7], [2, 3], session="carol", last_used=3)
    return [bob, carol]


def test_a_returning_conversation_is_restored_into_the_lru_slot():
    p = parked_with("alice#1", ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice", last_used=1)
    req = ALICE + [{"role": "user", "content": "more"}]
    tokens = ALICE_TOKENS + [95, 96]
    plan = policy.select(full_slots(), tokens, prefix_hashes(req), "alice", parked=[p])
    assert plan.parked == "alice#1" and plan.strategy == policy.HASH_EXTEND
    assert plan.slot == 1 and plan.reuse == 240 and plan.matched_messages == 3
    assert plan.donor is None and plan.evicted == "carol" and plan.evicted_tokens == 3
    # without it, bob's system prompt would have been copied: 150 tokens
    plain = policy.select(full_slots(), tokens, prefix_hashes(req), "alice")
    assert plain.parked is None and plain.reuse == 150 and plain.donor == 0


def test_a_restore_goes_to_an_empty_slot_first():
    p = parked_with("alice#1", ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice")
    slots = [full_slots()[0], FakeSlot(1)]
    plan = policy.select(slots, ALICE_TOKENS + [1], prefix_hashes(ALICE + [{"role": "user",
                         "content": "x"}]), "alice", parked=[p])
    assert plan.parked == "alice#1" and plan.slot == 1 and plan.evicted is None
    assert plan.evicted_tokens == 0


def test_any_session_whose_prompt_starts_with_a_parked_conversation_restores_it():
    p = parked_with("alice#1", ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice")
    fork = ALICE + [{"role": "user", "content": "dave's own question"}]
    plan = policy.select(full_slots(), ALICE_TOKENS + [42], prefix_hashes(fork), "dave",
                         parked=[p])
    assert plan.parked == "alice#1" and plan.reuse == 240


def test_a_parked_entry_wins_only_with_strictly_more_tokens():
    # alice's slot is still there and holds as much as her parked entry: the slot wins
    own = slot_with(0, ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice", last_used=4)
    p = parked_with("alice#1", ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice", last_used=9)
    req = ALICE + [{"role": "user", "content": "more"}]
    plan = policy.select([own, FakeSlot(1)], ALICE_TOKENS + [1], prefix_hashes(req), "alice",
                         parked=[p])
    assert plan.parked is None and plan.slot == 0 and plan.reuse == 240
    # a slot with a shorter prefix of it loses to the longer parked entry
    short = slot_with(0, ALICE[:2], ALICE_TOKENS[:210], ALICE_ENDS[:2], session="alice")
    plan = policy.select([short, FakeSlot(1)], ALICE_TOKENS + [1], prefix_hashes(req),
                         "alice", parked=[p])
    assert plan.parked == "alice#1" and plan.slot == 1 and plan.reuse == 240


def test_on_a_tie_the_sessions_own_parked_entry_beats_another_sessions_slot():
    """Another session (02's "ttft") holds the same start as alice's parked conversation:
    alice restores her own, and the other conversation keeps its slot."""
    theirs = slot_with(0, ALICE, ALICE_TOKENS, ALICE_ENDS, session="ttft", last_used=4)
    p = parked_with("alice#1", ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice", last_used=1)
    req = ALICE + [{"role": "user", "content": "more"}]
    plan = policy.select([theirs, FakeSlot(1)], ALICE_TOKENS + [1], prefix_hashes(req),
                         "alice", parked=[p])
    assert plan.parked == "alice#1" and plan.slot == 1 and plan.reuse == 240
    # a third session gets no such preference: ttft's slot serves it, its copy, or trim
    plan = policy.select([theirs, FakeSlot(1)], ALICE_TOKENS + [1], prefix_hashes(req),
                         "dave", parked=[p])
    assert plan.parked is None


def test_the_parked_entry_sharing_more_messages_is_chosen():
    short = parked_with("a#1", ALICE[:2], ALICE_TOKENS[:210], ALICE_ENDS[:2], session="a",
                        last_used=9)
    long = parked_with("a2#2", ALICE, ALICE_TOKENS, ALICE_ENDS, session="a2", last_used=1)
    req = ALICE + [{"role": "user", "content": "more"}]
    plan = policy.select(full_slots(), ALICE_TOKENS + [1], prefix_hashes(req), "x",
                         parked=[short, long])
    assert plan.parked == "a2#2"


def test_a_parked_entry_with_template_drift_is_only_a_token_prefix():
    drifted = SYS[:120] + [-5] * 30 + ALICE_TOKENS[150:]  # same messages, other tokens at 120
    p = parked_with("alice#1", ALICE, drifted, ALICE_ENDS, session="alice")
    req = ALICE + [{"role": "user", "content": "more"}]
    plan = policy.select(full_slots(), ALICE_TOKENS + [1], prefix_hashes(req), "alice",
                         parked=[p], min_tokens=100)
    assert plan.parked is None and plan.reuse == 150  # 120 from it is less than bob's 150
    lone = [FakeSlot(0, [7, 7], ["z"], [2], "zed", last_used=1)]
    plan = policy.select(lone, ALICE_TOKENS + [1], prefix_hashes(req), "alice", parked=[p],
                         min_tokens=100)
    assert plan.parked == "alice#1" and plan.strategy == policy.PREFIX_SALVAGE
    assert plan.reuse == 120 and plan.evicted == "zed"
    plan = policy.select(lone, ALICE_TOKENS + [1], prefix_hashes(req), "alice", parked=[p],
                         min_tokens=121)
    assert plan.parked is None and plan.strategy == policy.MISS


def test_no_free_slot_means_no_restore_either():
    p = parked_with("alice#1", ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice")
    slots = full_slots()
    for s in slots:
        s.pending = True
    assert policy.select(slots, ALICE_TOKENS + [1], prefix_hashes(ALICE), "alice",
                         parked=[p]) is None


def test_a_whole_parked_prompt_keeps_its_last_token_for_logits():
    p = parked_with("alice#1", ALICE, ALICE_TOKENS, ALICE_ENDS, session="alice")
    plan = policy.select(full_slots(), ALICE_TOKENS, prefix_hashes(ALICE), "alice", parked=[p])
    assert plan.parked == "alice#1" and plan.strategy == policy.HASH_HIT
    assert plan.reuse == len(ALICE_TOKENS) - 1


# ------------------------------------------------------------------ what a candidate serves


GROUPED = PrefillRule(threshold=8, align=4)  # Q4_K_M-like: 8+ rows in 4-aligned chunks


def test_reach_follows_the_grouping_the_memory_and_its_checkpoints():
    units = list(range(200))
    one = PrefillRule()
    assert policy.reach(units, 150, one, 180, floor=0) == 150  # plain: cut anywhere
    assert policy.reach(units, 150, GROUPED, 180, floor=0) == 148  # 4-aligned
    # a state put back whole cuts only at its end, else at a checkpoint that is itself a
    # valid start (a checkpoint at 97 is not: back to the one at 60)
    assert policy.reach(units, 150, one, 180, floor=180, checkpoints=(60, 97, 170)) == 97
    assert policy.reach(units, 150, GROUPED, 180, floor=180, checkpoints=(60, 97, 170)) == 60
    assert policy.reach(units, 150, one, 180, floor=180) == 0
    assert policy.reach(units, 180, one, 180, floor=policy.NO_CUT) == 180  # no cut needed
    # a run too short after the cut for one chunk: the cut moves back
    assert policy.reach(units[:153], 150, GROUPED, 180, floor=0) == 144


def test_a_restored_sliding_window_state_holds_only_the_window_before_its_end():
    # ... in the sequence's first cells: later tokens compute as from scratch only when it
    # starts a multiple of SWA_CELLS cells in
    assert policy.restorable(policy.SWA, 512, 400) and policy.restorable(policy.SWA, 512, 528)
    assert not policy.restorable(policy.SWA, 512, 520)
    assert policy.restorable(policy.PLAIN, 0, 521) and policy.restorable(policy.HYBRID, 0, 3)
    units = list(range(600))
    assert policy.restore_point(units, 527, GROUPED, policy.SWA, 512) == 512
    assert policy.restore_point(units, 527, GROUPED, policy.PLAIN, 0) == 524
    assert policy.restored_floor(policy.PLAIN, 0, 900) == 0
    assert policy.restored_floor(policy.SWA, 512, 400) == 0  # all of it is in the window
    assert policy.restored_floor(policy.SWA, 512, 900) == 900
    assert policy.restored_floor(policy.HYBRID, 0, 900) == policy.NO_CUT
    assert policy.window_floor(policy.SWA, 512, 0) == 0  # a live slot keeps every cell
    assert policy.window_floor(policy.SWA, 512, 388) == 900


@dataclass
class Held:
    tokens: list
    settled: int
    checkpoints: tuple = ()
    cut_floor: int = 0


def test_the_judge_scores_each_way_of_serving_on_sliding_window_memory():
    units = list(range(300))
    judge = policy.Judge(units, PrefillRule(), True, policy.SWA, 8)
    live = Held(units[:250], settled=240, checkpoints=(100, 200))
    assert judge(live, 249, policy.IN_PLACE) == 240  # only settled KV serves (exact mode)
    assert judge(live, 230, policy.COPY) == 230
    assert judge(live, 230, policy.RESTORE) == 200  # put back whole: to its checkpoint
    put_back = Held(units[:250], settled=250, checkpoints=(100, 200), cut_floor=250)
    assert judge(put_back, 230, policy.IN_PLACE) == 200
    assert judge(put_back, 230, policy.COPY) == 0  # a copy never restores a checkpoint
    assert policy.Judge(units, PrefillRule(), False, policy.SWA, 8)(live, 249,
                                                                   policy.IN_PLACE) == 249


def test_a_parked_state_the_prompt_leaves_never_beats_a_copy():
    """Gemma 3 after parking: the prompt leaves the parked conversation inside its reply;
    put back whole it cannot be cut there, so without a checkpoint the shared system
    prompt is copied from a slot instead; with one, the checkpoint is what counts."""
    msgs = conv("sys", "qa", "aa", "qa2")
    tokens = SYS + list(range(1, 61)) + list(range(61, 91)) + [5, 5]
    bob = slot_with(0, conv("sys", "qb"), SYS + [500, 501], [150, 152], session="bob",
                    last_used=5)
    carol = slot_with(1, conv("other", "qc"), [7, 7, 7], [2, 3], session="carol", last_used=3)
    drifted = ALICE_TOKENS[:-3] + [-1, -1, -1]  # its reply's end re-tokenized differently
    judge = policy.Judge(tokens, PrefillRule(), True, policy.SWA, 16)  # windows of 16
    for cps, restored in (((), False), ((144, 208), True)):
        p = FakeParked("alice#1", tuple(drifted), tuple(prefix_hashes(ALICE[:2])),
                       (150, 210), "alice", checkpoints=cps)
        plan = policy.select([bob, carol], tokens, prefix_hashes(msgs), "alice", parked=[p],
                             judge=judge)
        if restored:
            assert plan.parked == "alice#1" and plan.served == 208 and plan.reuse == 237
        else:
            assert plan.parked is None and plan.donor == 0 and plan.served == 150


def test_a_copy_must_serve_clearly_more_than_the_own_slot_in_place():
    """An edited question that another session's slot shares a few tokens more of: the
    own slot serves in place (a copy moves a whole KV stream); far more, and it is copied."""
    msgs = conv("sys", "q1")
    own = slot_with(0, msgs, SYS + [1, 2, 3, 4, 5], [150, 155], session="a", last_used=1)
    edited = conv("sys", "q1 edited")
    for extra, copied in ((4, False), (policy.COPY_MARGIN + 10, True)):
        other = slot_with(1, conv("sys", "qb"), SYS + [1, 2] + [8] * extra + [9] * 40,
                          [150, 192 + extra], session="b", last_used=2)
        tokens = SYS + [1, 2] + [8] * extra + [7, 7, 7]
        plan = policy.select([own, other], tokens, prefix_hashes(edited), "a", min_tokens=20)
        assert (plan.donor == 1) == copied and plan.slot == 0
        assert plan.served == (152 + extra if copied else 152)


def test_a_rerun_of_an_unnamed_prompt_is_served_in_the_slot_that_holds_it_whole():
    """A cell run again sends the prompt its slot holds (plus the reply): the cap that keeps
    its last token for logits must not make that slot look cut short. Found by the stateful
    test's long profile: the rerun went to the old branch's slot (31 of 44 tokens) because
    the slot holding all 44 was judged a copy, which has no margin over serving in place."""
    old = slot_with(1, conv("sys", "q1"), SYS + [1, 2, 3] + [5, 5], [150, 153], last_used=1)
    msgs = conv("sys", "q1 edited")
    prompt = SYS + [1, 2, 4]
    held = slot_with(2, msgs, prompt + [6, 6], [150, 153], last_used=2)
    plan = policy.select([FakeSlot(0, SYS + [8] * 9, session="c", last_used=3), old, held],
                         prompt, prefix_hashes(msgs), min_tokens=20)
    assert plan.slot == 2 and plan.donor is None and plan.reuse == len(prompt) - 1
    assert plan.evicted is None


def test_a_reply_start_that_merges_keeps_the_own_slot_and_its_checkpoint():
    """Hybrid memory: the reply's first newline merges with the template's last token, so
    the prompt leaves the own slot one token before its old prompt's end although the
    reply's hash matches. The own slot's checkpoint 3 tokens earlier beats copying the
    system prompt from another slot and restoring another conversation's."""
    msgs = conv("sys", "q1", "reply")
    old = SYS + [1, 2, 3, 4, 5, 6, 7, 8]  # its prompt: the question, then 3 of the template
    own = slot_with(0, msgs, old + [9, 9, 9], [150, 155, 158], session="x", last_used=2,
                    checkpoints=(150, 154, 158), settled=161, cut_floor=policy.NO_CUT)
    other = slot_with(1, conv("sys", "qo"), SYS + [40, 41], [150, 152], session="o",
                      last_used=3, checkpoints=(150,), settled=152, cut_floor=policy.NO_CUT)
    parked = FakeParked("p#1", tuple(SYS + [60, 61]), tuple(prefix_hashes(conv("sys", "qp"))),
                        (150, 152), "p", checkpoints=(150,))
    req = msgs + [{"role": "user", "content": "q2"}]
    tokens = old[:-1] + [77, 9, 9, 20, 21, 22]  # the merge: a new token at 157
    judge = policy.Judge(tokens, PrefillRule(), True, policy.HYBRID)
    plan = policy.select([own, other], tokens, prefix_hashes(req), "x", min_tokens=20,
                         parked=[parked], judge=judge)
    assert plan.slot == 0 and plan.donor is None and plan.parked is None
    assert plan.evicted is None and plan.served == 154 and plan.reuse == 157
    assert plan.matched_messages == 2  # the reply's hash matches, its tokens do not


# -- admissions: the policy's choice as one decision (nbkv.kv.admission), no model ---------

ANY = PrefillRule(1, 1)  # every position is a canonical start


def held(slot, **kw):
    return ad.Holder(tuple(slot.tokens), slot.session, tuple(slot.msg_ends), **kw)


def admit_for(slots, tokens, msgs, session, *, cache="imc", exact=False, rule=ANY, parked=(),
              taken=False, **kw):
    """select() then admit(), as the engine's placer does, over fake slots."""
    plan = policy.select(slots, tokens, prefix_hashes(msgs), session, parked=parked)
    by_index = {s.index: s for s in slots}
    donor = held(by_index[plan.donor], **kw) if plan.donor is not None else None
    return ad.admit(plan, held(by_index[plan.slot], **kw), donor, session, tokens, rule,
                    cache=cache, exact=exact, taken=taken)


def test_a_continuation_keeps_its_slot_in_place_and_trims_nothing_it_shares():
    msgs = conv("sys", "hi", "hello!")
    cached = SYS + [1, 2, 7, 7]
    s = slot_with(0, msgs[:3], cached, [150, 152, 152], session="a", last_used=5)
    tokens = cached + [9, 3, 4]
    a = admit_for([s, FakeSlot(1)], tokens, msgs + [{"role": "user", "content": "more"}], "a")
    assert a.source == ad.IN_PLACE and a.keep == len(cached) == a.wanted
    # its own conversation: nothing is parked first; an edit's branch would be, then the trim
    assert a.steps == (ad.PARK_BRANCH, ad.TRIM) and not a.parks
    assert ad.reply_reuse(a, a.keep) == (2, 2)  # the reply's two tokens, both reused


def test_another_sessions_conversation_is_parked_before_its_slot_is_reused():
    msgs = conv("sys", "hi")
    s = slot_with(0, conv("other")[:1], [5] * 20, [20], session="bob", last_used=1)
    a = admit_for([s], SYS + [1, 2], msgs, "alice")
    assert a.source == ad.MISS and a.keep == 0
    assert a.steps[0] == ad.PARK and a.steps[-1] == ad.TRIM and a.parks


def test_an_unnamed_request_carrying_an_unnamed_conversation_on_does_not_park_it():
    msgs = conv("sys", "hi")
    s = slot_with(0, msgs[:1], SYS, [150])
    a = admit_for([s], SYS + [1, 2], msgs, None)
    assert a.source == ad.IN_PLACE and a.keep == 150 and not a.parks
    named = admit_for([s], SYS + [1, 2], msgs, "alice")  # a named one takes it over: parked
    assert named.parks and named.keep == 150


def test_a_shared_start_is_copied_into_a_free_slot_and_nothing_is_parked_or_branched():
    msgs_a = conv("sys", "question A", "answer A")
    a_tokens = SYS + [1, 2, 3] + [4, 4]
    donor = slot_with(0, msgs_a, a_tokens, [150, 153, 155], session="alice", last_used=2)
    msgs_b = conv("sys", "question B")
    a = admit_for([donor, FakeSlot(1)], SYS + [9, 9], msgs_b, "bob")
    assert a.plan.donor == 0 and a.plan.slot == 1
    assert a.source == ad.COPY_SOURCE and a.steps == (ad.COPY, ad.TRIM) and a.keep == 150
    assert ad.reply_reuse(a, a.keep) == (0, 0)  # a copy reuses no reply of its own slot


def test_a_parked_conversation_is_restored_after_the_slots_own_is_parked():
    @dataclass
    class Parked(FakeSlot):
        key: str = ""

    msgs = conv("sys", "hi", "hello!")
    cached = SYS + [1, 2, 7, 7]
    entry = Parked(-1, list(cached), prefix_hashes(msgs), [150, 152, 152], "alice", 3,
                   key="alice")
    other = slot_with(0, conv("x")[:1], [8] * 30, [30], session="bob", last_used=9)
    tokens = cached + [9]
    a = admit_for([other], tokens, msgs + [{"role": "user", "content": "more"}], "alice",
                  parked=[entry], taken=True)
    assert a.plan.parked == "alice" and a.source == ad.RESTORE_SOURCE and a.taken
    # taken back, the entry is parked again as her earlier branch if the trim cuts it
    assert a.steps == (ad.PARK, ad.RESTORE, ad.PARK_BRANCH, ad.TRIM)
    copy = admit_for([other], tokens, msgs + [{"role": "user", "content": "more"}], "carol",
                     parked=[entry])
    assert copy.plan.parked == "alice" and not copy.taken  # a copy read: the entry stays
    assert copy.steps == (ad.PARK, ad.RESTORE, ad.TRIM)
    assert (a.prev_len, a.prev_prompt_len) == (0, 0)  # what it reuses is the entry's, not bob's


def test_cache_modes_have_their_own_steps_and_sources():
    msgs = conv("sys", "hi")
    s = slot_with(0, msgs[:1], SYS, [150], session="a")
    plan = policy.Plan("spc", 0, 0)
    spc = ad.admit(plan, held(s), None, "a", SYS + [1, 2], ANY, cache="spc", exact=False)
    off = ad.admit(policy.Plan("off", 0, 0), held(s), None, "a", SYS + [1, 2], ANY,
                   cache="off", exact=False)
    assert spc.source == ad.SPC and spc.steps == (ad.LOAD_SPC, ad.TRIM)
    assert off.source == ad.MISS and off.steps == (ad.CLEAR, ad.TRIM)


def test_exact_mode_keeps_settled_kv_and_counts_what_a_rewrite_would_have_served():
    msgs = conv("sys", "hi", "hello!")
    cached = SYS + [1, 2, 7, 7]
    s = slot_with(0, msgs[:3], cached, [150, 152, 152], session="a")
    tokens = cached + [9, 3]
    req = msgs + [{"role": "user", "content": "more"}]
    a = admit_for([s], tokens, req, "a", exact=True, settled=152, exact_len=152)
    assert a.wanted == len(cached) and a.keep == 152  # the reply's KV is not settled yet
    assert a.absorbed == 2  # its two positions, decoded one at a time
    lax = admit_for([s], tokens, req, "a", exact=False, settled=152, exact_len=152)
    assert lax.keep == len(cached) and lax.absorbed == 0


def test_the_length_kept_is_where_a_canonical_prefill_may_begin():
    msgs = conv("sys", "hi", "hello!")
    cached = SYS + [1, 2, 7, 7]
    s = slot_with(0, msgs[:3], cached, [150, 152, 152], session="a")
    tokens = cached + [9, 3, 4, 5, 6, 7, 8, 9, 10]
    a = admit_for([s], tokens, msgs + [{"role": "user", "content": "more"}], "a",
                  rule=PrefillRule(8, 4))
    # chunks start 4 apart and leave 8 rows or more: 152 (a multiple of 4) leaves 11
    assert a.wanted == 154 and a.keep == 152


def test_steps_out_of_order_are_refused():
    with pytest.raises(ValueError, match="out of order"):
        ad.Admission(policy.Plan(policy.MISS, 0, 0), ad.MISS, (ad.TRIM, ad.PARK), 0, 0)
    with pytest.raises(ValueError, match="out of order"):
        ad.Admission(policy.Plan(policy.MISS, 0, 0), ad.MISS, (ad.PARK, ad.PARK), 0, 0)
