"""%kvcache park / unpark and the parking options of %kvcache load and %config, through a
real IPython shell, with an engine stand-in (no model)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from conftest import ipython_shell
from nbkv.core.errors import InvalidRequestError
from nbkv.notebook.commands import parse_bytes
from nbkv.notebook.magics import Nbkv
from nbkv.notebook.sessions import SessionStore


class Parker:
    """An engine that parks: records the calls."""

    def __init__(self):
        self.calls = []

    def park(self, session=None, all=False):  # noqa: A002 - the engine's keyword
        self.calls.append(("park", session, all))
        return f"parked {session or 'every conversation'}"

    def unpark(self, session=None, all=False):  # noqa: A002
        self.calls.append(("unpark", session, all))
        return f"restored {session or 'every conversation'}"

    def parked(self):
        return ()

    def clear_parked(self):
        self.calls.append(("clear_parked",))
        return "forgot 1 parked conversation"


class Loaded(Exception):
    """Raised by the stand-in loader with the engine arguments it was given."""


@pytest.fixture
def magics():
    store = SessionStore()
    m = Nbkv(shell=ipython_shell(), store=store)
    m.frontend = "terminal"
    yield m
    store.engine = None


def test_park_and_unpark_a_session_or_all(magics):
    eng = magics.store.engine = Parker()
    assert str(magics.kvcache("park alice")) == "parked alice"
    assert str(magics.kvcache("unpark --all")) == "restored every conversation"
    magics.kvcache("park --all")
    assert eng.calls == [("park", "alice", False), ("unpark", None, True),
                         ("park", None, True)]


@pytest.mark.parametrize("line, says", [("park", "name a session"),
                                        ("unpark alice --all", "not both"),
                                        ("park alice --slots 2", "does not take --slots")])
def test_park_refuses_what_it_cannot_do(magics, line, says):
    magics.store.engine = Parker()
    with pytest.raises(UsageError, match=says):
        magics.kvcache(line)


def test_park_needs_an_engine_that_parks(magics):
    magics.store.engine = object()
    with pytest.raises(UsageError, match="needs the in-kernel engine"):
        magics.kvcache("park alice")


def test_load_passes_the_parking_options(magics, tmp_path, monkeypatch):
    def load(path=None, **kwargs):
        raise Loaded(kwargs)

    monkeypatch.setattr(magics.store, "load", load)
    with pytest.raises(Loaded) as got:
        magics.kvcache(f"load --park-ram 1.5G --park-dir {tmp_path}")
    assert got.value.args[0]["park_ram"] == 3 << 29 and got.value.args[0]["park_dir"] == str(
        tmp_path)
    with pytest.raises(Loaded) as got:  # not set: the engine's defaults
        magics.kvcache("load")
    assert "park_ram" not in got.value.args[0] and "park_dir" not in got.value.args[0]
    magics.park_ram = 0  # %config Nbkv.park_ram = 0
    magics.park_dir = str(tmp_path / "d")
    with pytest.raises(Loaded) as got:
        magics.kvcache("load")
    assert got.value.args[0]["park_ram"] == 0
    assert got.value.args[0]["park_dir"] == str(tmp_path / "d")
    with pytest.raises(UsageError, match="--park-ram: 'lots' is not a size"):
        magics.kvcache("load --park-ram lots")


@pytest.mark.parametrize("text, n", [("0", 0), ("2G", 2 << 30), ("512MiB", 512 << 20),
                                     ("1.5 gb", 3 << 29), ("100", 100), ("4k", 4096)])
def test_parse_bytes(text, n):
    assert parse_bytes(text, "--park-ram") == n


def test_parse_bytes_refuses_what_is_not_a_size():
    for bad in ("", "-1G", "2X", "G"):
        with pytest.raises(InvalidRequestError):
            parse_bytes(bad, "--park-ram")


class Clearer(Parker):
    """An engine that clears and parks: records the calls; a real parking lot."""

    def __init__(self):
        from nbkv.store.parking import ParkedEntry, ParkingLot

        super().__init__()
        self.parking = ParkingLot(ram_bytes=1500)
        for s in ("ann", "bob"):  # the second evicts the first: an announced drop
            self.parking.park(ParkedEntry(s, (1, 2, 3), ("h",), (3,), bytes(1000)))

    def parked(self):
        return self.parking.entries()

    def clear(self, slot=None, parked=False):
        self.calls.append(("clear", slot, parked))
        return f"cleared {'every idle slot' if slot is None else f'slot {slot}'}"


def test_clear_keeps_or_forgets_the_parked_conversations(magics):
    eng = magics.store.engine = Clearer()
    assert "sessions keep their messages" in str(magics.kvcache("clear --all"))
    magics.kvcache("clear --all --parked")
    assert str(magics.kvcache("clear --parked")) == "forgot 1 parked conversation"
    assert eng.calls == [("clear", None, False), ("clear", None, True), ("clear_parked",)]
    with pytest.raises(UsageError, match="--parked"):
        magics.kvcache("clear")


def test_kvcache_parked_lists_the_lot_and_what_it_dropped(magics):
    magics.store.engine = Clearer()
    table = magics.kvcache("parked")
    assert [r[0] for r in table.rows] == ["bob"] and "RAM" in table.rows[0][1]
    assert "dropped: ann (3 tokens, ram): over the RAM budget (no disk tier)" in table.note
    magics.store.engine = object()
    assert "parking is off" in str(magics.kvcache("parked"))
