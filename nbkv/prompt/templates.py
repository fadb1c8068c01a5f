"""Chat template rendering: the model's own Jinja2 template in a sandbox.

Hugging Face chat templates expect a few helpers (``raise_exception``, ``strftime_now``) and
the ``tojson`` filter; llama.cpp and transformers both provide them, and so do we.

A template is code someone else wrote, so each rendering is bounded: it may take
:data:`RENDER_SECONDS` (10 s), its ``range()`` calls may yield :data:`RANGE_ITEMS` (a million)
items together, and it may produce, or build by repetition (``*``, ``**``), :data:`OUTPUT_CHARS`
(2**26) characters, or fewer where the caller asks. Past a bound it stops with
:class:`~nbkv.core.errors.TemplateLimitError`. The time is checked as the template calls,
subscripts, reads attributes and counts: a loop that does none of these (an empty loop over
the messages within a loop over them) and a single huge filter call run unchecked.
"""

from __future__ import annotations

import datetime
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nbkv.core.errors import TemplateError, TemplateLimitError
from nbkv.core.events import common_prefix
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


#: Seconds one rendering may take (checked as the template calls, subscripts and loops).
RENDER_SECONDS = 10.0

#: Items the ``range()`` calls of one rendering may yield, all together.
RANGE_ITEMS = 1_000_000

#: Characters one rendering may produce; also the longest string or list it may build.
OUTPUT_CHARS = 1 << 26


class _Budget(threading.local):
    """What the rendering running in this thread has left (see the module's bounds)."""

    deadline = math.inf
    items = 0
    ticks = 0
    max_chars = OUTPUT_CHARS


_budget = _Budget()


def _check_time() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateLimitError(f"chat template ran past {RENDER_SECONDS:g} s and was stopped")


def _tick() -> None:
    b = _budget
    b.ticks += 1
    if not b.ticks & 255:
        _check_time()


class _Range:
    """``range`` for templates: it counts what it yields against :data:`RANGE_ITEMS`."""

    def __init__(self, *args: int) -> None:
        self._r = range(*args)

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        got = self._r[i]
        return _Range(got.start, got.stop, got.step) if isinstance(got, range) else got

    def __contains__(self, x: Any) -> bool:
        return x in self._r

    def __iter__(self) -> Any:
        return self._yield(self._r)

    def __reversed__(self) -> Any:
        return self._yield(self._r[::-1])

    def __repr__(self) -> str:
        return repr(self._r)

    @staticmethod
    def _yield(r: range) -> Any:
        for start in range(0, len(r), 1024):
            part = r[start : start + 1024]
            _budget.items += len(part)
            if _budget.items > RANGE_ITEMS:
                raise TemplateLimitError(f"chat template's range() calls yielded more than "
                                         f"{RANGE_ITEMS} items in one rendering; stopped")
            _check_time()
            yield from part


class _TooLong(TemplateLimitError):
    """A value built past the rendering's character bound: the output would pass it too."""


def _too_big(operator: str, left: Any, right: Any) -> bool:
    """Whether ``left operator right`` would build more than the rendering may hold."""
    cap = _budget.max_chars
    seq = (str, list, tuple)
    if operator == "*":
        n, s = (right, left) if isinstance(left, seq) else (left, right)
        return isinstance(s, seq) and isinstance(n, int) and len(s) * n > cap
    return (operator == "**" and isinstance(left, int) and isinstance(right, int)
            and abs(left) > 1 and right * abs(left).bit_length() > 8 * cap)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, checking the module's bounds on time, ``range()`` items and built values."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals["range"] = _Range

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if _too_big(operator, left, right):
            raise _TooLong(f"chat template built a value of more than {_budget.max_chars} "
                           f"characters with {operator!r}; stopped")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        return super().call(__context, __obj, *args, **kwargs)


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
        env = _Sandbox(
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
        :class:`~nbkv.core.errors.InvalidRequestError` first. A rendering past a bound of the
        module's raises :class:`~nbkv.core.errors.TemplateLimitError`.
        """
        out = self.render_within(messages, OUTPUT_CHARS, add_generation_prompt, **extra)
        if out is None:
            raise TemplateLimitError(f"chat template produced more than {OUTPUT_CHARS} "
                                     "characters; stopped")
        return out

    def render_within(
        self,
        messages: Sequence[Mapping[str, Any]],
        max_chars: int,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str | None:
        """:meth:`render`, or None as soon as the output passes ``max_chars`` characters.

        The output is read as the template produces it, so a rendering too long for its use
        (a prompt that cannot fit a slot) stops there, without being held whole; so does one
        that builds a string or list longer than ``max_chars`` by repetition.
        """
        msgs = for_template(messages)
        b = _budget
        saved = (b.deadline, b.items, b.max_chars)
        b.deadline, b.items = time.monotonic() + RENDER_SECONDS, 0
        b.max_chars = min(max_chars, OUTPUT_CHARS)
        try:
            parts, size = [], 0
            for part in self._template.generate(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            ):
                size += len(part)
                if size > max_chars:
                    return None
                parts.append(part)
            return "".join(parts)
        except _TooLong:
            return None
        except TemplateError:
            raise
        except Exception as e:  # jinja2 errors, and anything a template's own code raises
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
        finally:
            b.deadline, b.items, b.max_chars = saved

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
