"""Chat template rendering: the model's own Jinja2 template in a sandbox.

Hugging Face chat templates expect a few helpers (``raise_exception``, ``strftime_now``) and
the ``tojson`` filter; llama.cpp and transformers both provide them, and so do we.
"""

from __future__ import annotations

import datetime
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nbkv.core.codes import common_prefix
from nbkv.core.errors import TemplateError
from nbkv.core.messages import for_template

#: Used only when a model ships no template at all.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


#: ChatML that renders the current time into the system turn, so the same messages render
#: differently on every call (as some real templates do): a demo of prefix salvage.
CLOCK_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% if m['role'] == 'system' %}{{ '\\nCurrent time: ' + strftime_now('%H:%M:%S') }}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _now() -> datetime.datetime:
    """The clock templates see (tests replace it to make time-dependent templates repeatable)."""
    return datetime.datetime.now()


def _raise(message: str) -> None:
    raise TemplateError(f"chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns messages into prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.remember = 4096  # renderings of message prefixes kept by :meth:`boundaries`
        self._seen: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (length, hash)
        self._lock = threading.Lock()
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: _now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render ``messages``; ``extra`` variables (e.g. ``tools``) are passed to the template.

        A content list of text parts is rendered as its text
        (:func:`~nbkv.core.messages.for_template`); a malformed part raises
        :class:`~nbkv.core.errors.InvalidRequestError` first.
        """
        msgs = for_template(messages)
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError:
            raise
        except Exception as e:  # jinja2 errors, and anything a template's own code raises
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    def boundaries(self, messages: Sequence[Mapping[str, Any]], full: str,
                   keys: Sequence[str] | None = None) -> list[int]:
        """Character offset in ``full`` where each message's rendering ends.

        ``full`` is the rendering of all of ``messages``. Offset ``k`` is how much of ``full``
        the rendering of ``messages[:k + 1]`` (without a generation prompt) shares with it;
        for templates that render prefixes stably that is exactly where message ``k`` ends.
        ``keys`` (one per message, identifying ``messages[:k + 1]``, e.g. cumulative prefix
        hashes) let earlier renderings be remembered: a growing conversation then renders
        only its new messages instead of every prefix again. A remembered rendering is used
        only if ``full`` still starts with it, so time-dependent templates stay correct.
        """
        out: list[Any] = []
        for k in range(1, len(messages) + 1):
            n = None
            key = keys[k - 1] if keys is not None else None
            if key is not None:
                with self._lock:
                    seen = self._seen.get(key)
                    if seen is not None:
                        self._seen.move_to_end(key)
                if seen is not None and hash(full[: seen[0]]) == seen[1]:
                    n = seen[0]
            if n is None:
                part = self.render(messages[:k], add_generation_prompt=False)
                stable = full.startswith(part)
                n = len(part) if stable else common_prefix(part, full)
                if key is not None and stable:
                    with self._lock:
                        self._seen[key] = (n, hash(part))
                        while len(self._seen) > self.remember:
                            self._seen.popitem(last=False)
            out.append(max(n, out[-1] if out else 0))
        return out
