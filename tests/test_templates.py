"""Chat template rendering in the sandbox, without a model."""

import datetime

import pytest

from nbkv.core.errors import TemplateError, TemplateLimitError
from nbkv.core.messages import prefix_hashes
from nbkv.prompt import templates
from nbkv.prompt.templates import CHATML, CLOCK_CHATML, ChatTemplate

MSGS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]


def test_chatml_render_and_generation_prompt():
    t = ChatTemplate(CHATML)
    text = t.render(MSGS)
    assert text.startswith("<|im_start|>system\nS<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n")
    assert not t.render(MSGS, add_generation_prompt=False).endswith("assistant\n")


def test_boundaries_are_message_ends():
    t = ChatTemplate(CHATML)
    full = t.render(MSGS)
    ends = t.boundaries(MSGS, full)
    assert full[: ends[0]] == "<|im_start|>system\nS<|im_end|>\n"
    assert full[ends[2] : ends[3]] == "<|im_start|>user\nU2<|im_end|>\n"
    assert ends == sorted(ends)


def test_boundaries_remember_prefix_renderings():
    t = ChatTemplate(CHATML)
    keys = prefix_hashes(MSGS)
    full = t.render(MSGS)
    assert t.boundaries(MSGS, full, keys) == t.boundaries(MSGS, full)
    renders = []
    plain = t.render
    t.render = lambda m, **kw: renders.append(len(m)) or plain(m, **kw)
    longer = MSGS + [{"role": "assistant", "content": "A2"}, {"role": "user", "content": "U3"}]
    full2 = plain(longer)
    ends = t.boundaries(longer, full2, prefix_hashes(longer))
    assert renders == [5, 6]  # only the two new prefixes were rendered
    t.render = plain
    assert ends == t.boundaries(longer, full2)


def test_remembered_boundaries_follow_a_time_dependent_template(monkeypatch):
    clock = {"t": datetime.datetime(2026, 1, 1, 9, 0, 0)}
    monkeypatch.setattr(templates, "_now", lambda: clock["t"])
    t = ChatTemplate(CLOCK_CHATML)
    keys = prefix_hashes(MSGS)
    t.boundaries(MSGS, t.render(MSGS), keys)
    clock["t"] += datetime.timedelta(minutes=1)
    full = t.render(MSGS)
    assert t.boundaries(MSGS, full, keys) == t.boundaries(MSGS, full)
    assert full[: t.boundaries(MSGS, full, keys)[0]].endswith("09:01:00<|im_end|>\n")


def test_helpers_available():
    t = ChatTemplate("{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}",
                     bos_token="<s>")
    out = t.render([{"role": "user", "content": "é"}])
    assert out.startswith('<s>[{"role": "user", "content": "é"}]') and out.endswith("4")


def test_raise_exception_and_sandbox():
    with pytest.raises(TemplateError, match="nope"):
        ChatTemplate("{{ raise_exception('nope') }}").render(MSGS)
    with pytest.raises(TemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(MSGS)
    with pytest.raises(TemplateError, match="compile"):
        ChatTemplate("{% if %}")
    with pytest.raises(TemplateError, match="render"):
        ChatTemplate("{{ messages[10]['content'] + 1 }}").render(MSGS)


def test_nested_ranges_stop_at_the_range_bound():
    nested = "{% for i in range(2000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}ok"
    with pytest.raises(TemplateLimitError, match=f"more than {templates.RANGE_ITEMS} items"):
        ChatTemplate(nested).render(MSGS)
    small = "{% for i in range(3) %}{% for j in range(2)|reverse %}{{ i }}{{ j }}{% endfor %}" \
            "{% endfor %}{{ range(5)|list|length }}{{ 4 in range(5) }}{{ range(10)[2:4]|list }}"
    assert ChatTemplate(small).render(MSGS) == "0100111021205True[2, 3]"


def test_a_slow_template_stops_at_the_time_bound(monkeypatch):
    monkeypatch.setattr(templates, "RENDER_SECONDS", 0.05)
    quadratic = "{% for a in messages %}{% for b in messages %}{{ b.role[0] }}{% endfor %}" \
                "{% endfor %}"
    many = [{"role": "user", "content": "x"}] * 3000
    with pytest.raises(TemplateLimitError, match="ran past 0.05 s"):
        ChatTemplate(quadratic).render(many)


def test_output_and_built_values_stop_at_the_size_bound(monkeypatch):
    for huge in ("{{ 'x' * 300000000 }}", "{% set n = 2 ** 1000000000 %}ok",
                 "{{ ['x'] * 300000000 }}"):
        with pytest.raises(TemplateLimitError, match="more than"):
            ChatTemplate(huge).render(MSGS)
    t = ChatTemplate(CHATML)
    assert t.render_within(MSGS, 20) is None
    assert t.render_within(MSGS, 1000) == t.render(MSGS)
    monkeypatch.setattr(templates, "OUTPUT_CHARS", 100)
    long = "{% for i in range(50) %}{{ 'abc' }}{% endfor %}"
    with pytest.raises(TemplateLimitError, match="produced more than 100 characters"):
        ChatTemplate(long).render(MSGS)

