"""The admission executor with fake parts, no model: steps run in the admission's order."""

from types import SimpleNamespace

import pytest

from nbkv.core.config import EngineSettings
from nbkv.engine.placement import Executor
from nbkv.kv import admission as ad
from nbkv.kv import policy
from nbkv.kv.invariance import PrefillRule

RULE = PrefillRule(1, 1)


class FakeKV:
    """Records what is done to it; holds ``tokens``."""

    def __init__(self, log, tokens):
        self.log, self.tokens, self.last_restore = log, list(tokens), None
        self.settled = len(tokens)

    def __len__(self):
        return len(self.tokens)

    def copy_from(self, other, n):
        self.log.append("copy")
        self.tokens = list(other.tokens[:n])
        return n

    def clear(self):
        self.log.append("clear")
        self.tokens = []

    def trim_to(self, n):
        self.log.append(f"trim {n}")
        del self.tokens[n:]
        return n

    def resync(self):
        self.log.append("resync")


class FakeParker:
    def __init__(self, log, fail=None, keeps=False):
        self.log, self.fail, self.keeps = log, fail, keeps

    def park_slot(self, slot):
        self.log.append("park")
        if self.fail == "park":
            raise RuntimeError("the park failed")
        return SimpleNamespace(n_tokens=len(slot.kv), tier="ram")

    def restore_into(self, slot, entry):
        self.log.append("restore")
        slot.kv.tokens = list(entry.tokens)
        return len(entry.tokens)

    def park_branch(self, slot, at):
        self.log.append(f"park-branch {at}")

    def keep_branch(self, entry, at, prompt, replay):
        self.log.append(f"keep-branch {at}")
        return SimpleNamespace(n_tokens=len(entry.tokens), tier="ram") if self.keeps else None


def executor(log, cache="imc", fail=None, parking=None, keeps=False, replay=None):
    table = SimpleNamespace(serve=lambda s, on: log.append(f"serve {on}"),
                            drop_rewrite=lambda s: None)
    res = SimpleNamespace(rule=RULE, ctx=SimpleNamespace(recycle=lambda st: True))
    settings = EngineSettings.of(cache=cache, exact=False, cache_min_tokens=1)
    replays = SimpleNamespace(match=lambda job, slot: replay)
    return Executor(res, settings, table, None, parking, FakeParker(log, fail, keeps), replays)


def slot(log, tokens, session=None):
    return SimpleNamespace(kv=FakeKV(log, tokens), index=0, session=session, msg_ends=[],
                           redo=[])


def test_a_displaced_conversation_is_parked_before_the_copy_and_the_trim():
    log = []
    target, donor = slot(log, [5] * 8, "bob"), slot(log, list(range(20)), "alice")
    donor.index = 1
    prompt = list(range(12)) + [99, 98]
    plan = policy.Plan(policy.PREFIX_SALVAGE, 0, 12, donor=1)
    adm = ad.admit(plan, ad.Holder(tuple(target.kv.tokens), "bob"),
                   ad.Holder(tuple(donor.kv.tokens), "alice"), "carol", prompt, RULE,
                   cache="imc", exact=False)
    assert adm.steps == (ad.PARK, ad.COPY, ad.TRIM)
    job = SimpleNamespace(prompt=SimpleNamespace(tokens=prompt))
    out = executor(log).run(adm, job, target, donor, None)
    assert log == ["serve True", "park", "copy", "trim 12"]
    assert out.reuse == 12 and out.parked_to.n_tokens == 8 and out.trimmed == 0


def test_a_restored_entry_taken_back_is_parked_again_when_a_step_fails():
    log, parked_again = [], []
    target = slot(log, [5] * 8, "bob")
    entry = SimpleNamespace(tokens=list(range(10)), session="alice", tier="disk", hashes=(),
                            msg_ends=(), state=object())
    plan = policy.Plan(policy.HASH_EXTEND, 0, 9, parked="alice")
    adm = ad.admit(plan, ad.Holder(tuple(target.kv.tokens), "bob"), None, "alice",
                   list(range(12)), RULE, cache="imc", exact=False, taken=True)
    assert adm.steps == (ad.PARK, ad.RESTORE, ad.PARK_BRANCH, ad.TRIM) and adm.taken
    lot = SimpleNamespace(park=parked_again.append)
    job = SimpleNamespace(prompt=SimpleNamespace(tokens=list(range(12))))
    with pytest.raises(RuntimeError, match="the park failed"):
        executor(log, fail="park", parking=lot).run(adm, job, target, None, entry)
    assert log == ["serve True", "park", "resync", "serve False"]  # nothing after the failure
    assert parked_again == [entry]  # taken from the lot: not lost


def test_a_restore_keeps_what_the_restored_state_holds_then_trims_there():
    log = []
    target = slot(log, [])
    entry = SimpleNamespace(tokens=list(range(6)), session="alice", tier="ram", hashes=("h",),
                            msg_ends=(6,), state=object())
    plan = policy.Plan(policy.HASH_EXTEND, 0, 9, parked="alice")
    adm = ad.admit(plan, ad.Holder(()), None, "alice", list(range(12)), RULE, cache="imc",
                   exact=False, taken=True)
    job = SimpleNamespace(prompt=SimpleNamespace(tokens=list(range(12))), replay=False)
    out = executor(log).run(adm, job, target, None, entry)
    assert log == ["serve True", "restore", "keep-branch 6", "trim 6"]  # nothing cut: not kept
    assert (out.reuse, out.planned) == (6, 6) and out.restored.tier == "ram"
    assert entry.state is None and out.branch is None  # taken back: its buffers are the slot's


def taken_back(prompt):
    """alice's parked conversation of 10 tokens, taken back by her request for ``prompt``."""
    entry = SimpleNamespace(tokens=list(range(10)), session="alice", tier="ram", hashes=("h",),
                            msg_ends=(10,), state=object())
    plan = policy.Plan(policy.HASH_EXTEND, 0, 4, parked="alice")
    adm = ad.admit(plan, ad.Holder(()), None, "alice", prompt, RULE, cache="imc",
                   exact=False, taken=True)
    return entry, adm, SimpleNamespace(prompt=SimpleNamespace(tokens=prompt), replay=True)


def test_an_edit_of_a_conversation_taken_back_keeps_the_entry_as_its_branch():
    """The entry is parked again as alice's earlier branch once the request proves no replay,
    before the trim cuts it: its buffers are the branch's, not recycled into the slot's."""
    log = []
    entry, adm, job = taken_back([0, 1, 2, 3, 99, 98])
    state = entry.state
    out = executor(log, keeps=True).run(adm, job, slot(log, []), None, entry)
    assert log == ["serve True", "restore", "keep-branch 4", "trim 4"]
    assert out.branch is not None and out.reuse == 4
    assert entry.state is state  # the branch's state: not recycled


def test_a_replay_of_a_conversation_taken_back_parks_no_branch():
    """The same prompt answered before: the reply is replayed, nothing is cut, so nothing is
    parked (the session's entry is the slot's now, as for a plain restore)."""
    log = []
    entry, adm, job = taken_back([0, 1, 2, 3])
    out = executor(log, keeps=True, replay=("memo", 6)).run(adm, job, slot(log, []), None,
                                                              entry)
    assert log == ["serve True", "restore"]
    assert out.memo == "memo" and out.branch is None and entry.state is None


def test_a_failure_after_the_branch_was_kept_does_not_park_the_entry_twice():
    log, parked_again = [], []
    entry, adm, job = taken_back([0, 1, 2, 3, 99, 98])
    target = slot(log, [])

    def trim_fails(n):
        raise RuntimeError("the trim failed")

    target.kv.trim_to = trim_fails
    lot = SimpleNamespace(park=parked_again.append)
    with pytest.raises(RuntimeError, match="the trim failed"):
        executor(log, keeps=True, parking=lot).run(adm, job, target, None, entry)
    assert parked_again == [] and entry.state is not None  # the branch holds it: not lost
