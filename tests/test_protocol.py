"""The in-kernel Engine and both remote engines satisfy the engine Protocol."""

import inspect

import pytest

from nbkv.engine import Engine
from nbkv.protocol import EngineLike
from nbkv.remote import LlamaServerEngine, OpenAIEngine


@pytest.mark.parametrize("cls", [Engine, LlamaServerEngine, OpenAIEngine])
def test_engine_has_every_protocol_member(cls):
    wanted = {n for n in dir(EngineLike) if not n.startswith("_")}
    assert {"chat", "chat_many", "achat", "slots", "stats", "history", "subscribe",
            "clear", "close", "n_slots", "explain"} <= wanted
    missing = sorted(n for n in wanted if not hasattr(cls, n))
    assert missing == []
    assert inspect.iscoroutinefunction(cls.achat)


def test_an_object_lacking_methods_is_not_an_engine():
    assert not isinstance(object(), EngineLike)
