"""The in-kernel Engine and both remote engines satisfy the engine Protocol."""

import inspect

import pytest

from nbkv.core.protocol import EngineLike
from nbkv.engine.facade import Engine
from nbkv.remote.connect import LlamaServerEngine, OpenAIEngine


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


def test_openai_messages_carry_images_as_png_data_urls():
    import base64
    import io

    import numpy as np
    from PIL import Image

    from nbkv.remote.openai import _openai_message

    pixels = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    msg = _openai_message({"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image", "image": pixels}]})
    text, image = msg["content"]
    assert text == {"type": "text", "text": "What is this?"}
    url = image["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    back = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    assert np.array_equal(back, pixels)
    assert _openai_message({"role": "user", "content": "hi"}) == {"role": "user",
                                                                  "content": "hi"}
