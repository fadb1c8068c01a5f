"""Step planning and checkpoint choice: pure logic, no model."""

from __future__ import annotations

from nbkv.kv.invariance import Prefilling, StepPlan, plan_step
from nbkv.kv.slot_kv import CheckpointSet


def test_shortest_prompt_first_and_last_chunk_alone():
    long = Prefilling(key=1, remaining=900, take=256)
    short = Prefilling(key=2, remaining=40, take=40)
    plan = plan_step([long, short], generating=3)
    # the short prompt finishes in this chunk: it runs alone, its first token waits for nobody
    assert plan == StepPlan(prefill=2, take=40, image=False, generate=False)
    plan = plan_step([long], generating=3)
    assert plan == StepPlan(prefill=1, take=256, image=False, generate=True)


def test_ties_go_to_the_first_come_and_waiting_requests_are_skipped():
    a, b = Prefilling(key=5, remaining=40, take=40), Prefilling(key=3, remaining=40, take=40)
    assert plan_step([a, b], 0).prefill == 3
    waiting = Prefilling(key=3, remaining=10, ready=False, take=10)
    assert plan_step([a, waiting], 0).prefill == 5


def test_images_and_idle_steps():
    img = Prefilling(key=1, remaining=20, image_next=True)
    assert plan_step([img], 2) == StepPlan(prefill=1, take=0, image=True, generate=True)
    assert plan_step([], 2) == StepPlan(generate=True)
    assert plan_step([], 0).idle
    assert plan_step([Prefilling(key=1, remaining=20, ready=False, take=20)], 0).idle


def test_checkpoint_choice_is_the_newest_at_or_before_the_target():
    cps = CheckpointSet(max_entries=8)
    for pos in (40, 10, 25):
        cps.add(pos, object(), 100)
    assert cps.positions == (10, 25, 40)
    assert cps.at_or_before(9) is None
    assert cps.at_or_before(10).pos == 10
    assert cps.at_or_before(39).pos == 25
    assert cps.at_or_before(1000).pos == 40
    assert cps.nbytes == 300
    cps.drop_after(30)
    assert cps.positions == (10, 25)


def test_checkpoints_keep_the_newest_and_thin_the_older_where_densest():
    cps = CheckpointSet(max_entries=6)  # the newest 3 are never thinned
    for pos in (100, 110, 300, 500, 505, 510):
        cps.add(pos, pos, 1)
    assert cps.add(520, 520, 1) == [110]  # 10 after its predecessor: the densest old spot
    assert cps.positions == (100, 300, 500, 505, 510, 520)
    # 510 sits 5 after 505 but is one of the newest three (510, 520, 530): 505 goes
    assert cps.add(530, 530, 1) == [505]
    assert cps.positions == (100, 300, 500, 510, 520, 530)
    cps.add(300, "new", 1)  # same position: replaced, not duplicated
    assert cps.positions == (100, 300, 500, 510, 520, 530)
    assert cps.at_or_before(404).data == "new"


def test_equal_gaps_evict_the_least_recently_used():
    cps = CheckpointSet(max_entries=4)  # the newest 2 stay
    for pos in (50, 100, 150, 200):
        cps.add(pos, pos, 1)
    cps.at_or_before(60)  # 50 restored: now the most recently used of the equal gaps
    assert cps.add(250, 250, 1) == [100]


def test_a_copied_set_is_independent():
    cps = CheckpointSet(max_entries=4)
    cps.add(5, "a", 1)
    other = cps.copy()
    other.add(9, "b", 1)
    other.drop_after(4)
    assert cps.positions == (5,)
    assert other.positions == ()


def test_message_boundaries_outlive_the_newest_checkpoints():
    cps = CheckpointSet(max_entries=4)  # the newest 2 stay
    cps.pin((30, 90))  # the system prompt's end, the second message's start
    for pos in (30, 40, 90, 100, 150, 200, 250, 300):  # turns go on: 8 checkpoints for 4 places
        cps.add(pos, pos, 1)
    assert cps.positions == (30, 90, 250, 300)  # unpinned: (90, 150, 250, 300), the system end lost
    cps.pin((30, 90, 150))  # more boundaries than room: the system prompt's end stays longest
    cps.add(350, 350, 1)
    assert cps.positions == (30, 90, 300, 350)
    cps.pin((30, 150, 250, 300))
    cps.add(400, 400, 1)
    assert 30 in cps.positions and cps.copy().pinned == cps.pinned
