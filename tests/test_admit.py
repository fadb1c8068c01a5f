"""The admission executor with fake parts, no model: steps run in the admission's order."""

from types import SimpleNamespace

import pytest

from nbkv.core.config import EngineSettings
from nbkv.engine.admit import Executor
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
    def __init__(self, log, fail=None):
        self.log, self.fail = log, fail

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


def executor(log, cache="imc", fail=None, parking=None):
    table = SimpleNamespace(serve=lambda s, on: log.append(f"serve {on}"),
                            drop_rewrite=lambda s: None)
    res = SimpleNamespace(rule=RULE, ctx=SimpleNamespace(recycle=lambda st: True))
    settings = EngineSettings.of(cache=cache, exact=False, cache_min_tokens=1)
    replays = SimpleNamespace(match=lambda job, slot: None)
    return Executor(res, settings, table, None, parking, FakeParker(log, fail), replays)


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
    assert adm.steps == (ad.PARK, ad.RESTORE, ad.TRIM) and adm.taken
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
    job = SimpleNamespace(prompt=SimpleNamespace(tokens=list(range(12))))
    out = executor(log).run(adm, job, target, None, entry)
    assert log == ["serve True", "restore", "trim 6"]
    assert (out.reuse, out.planned) == (6, 6) and out.restored.tier == "ram"
    assert entry.state is None  # taken back: its buffers are the slot's now
