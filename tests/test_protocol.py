"""The in-kernel Engine satisfies the engine Protocol that remote engines will implement."""

import inspect

from nbkv.engine import Engine
from nbkv.protocol import EngineLike


def test_engine_has_every_protocol_member():
    wanted = {n for n in dir(EngineLike) if not n.startswith("_")}
    assert {"chat", "chat_many", "achat", "slots", "stats", "history", "subscribe",
            "clear", "close", "n_slots"} <= wanted
    missing = sorted(n for n in wanted if not hasattr(Engine, n))
    assert missing == []
    assert inspect.iscoroutinefunction(Engine.achat)


def test_an_object_lacking_methods_is_not_an_engine():
    assert not isinstance(object(), EngineLike)
