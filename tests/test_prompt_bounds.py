"""Preparing a prompt costs what the slot holds, not what the history holds (no model).

A character vocabulary (one token per character) stands in for a model, so the number of
renderings and tokenizations can be counted: that, not a timing, is what is checked.
"""

import random

import pytest

from nbkv.core.errors import ContextOverflowError, InvalidRequestError
from nbkv.core.messages import normalize, preview
from nbkv.prompt.builder import PromptBuilder
from nbkv.prompt.templates import CHATML, ChatTemplate


class CharVocab:
    """One token per character; counts its tokenizations and the characters it read."""

    bos_text, add_bos, longest_piece = "", False, 4  # a character is at most 4 UTF-8 bytes

    def __init__(self):
        self.calls = self.chars = 0

    def tokenize(self, text, add_special=False):
        self.calls += 1
        self.chars += len(text)
        return [ord(c) for c in text]

    def piece(self, token):
        return chr(token).encode()


class CountingTemplate(ChatTemplate):
    """ChatML that counts its renderings (whole prompts and message prefixes alike)."""

    def __init__(self, source=CHATML):
        super().__init__(source)
        self.renders = 0
        self._template = Counted(self._template, self)  # one call per rendering


class Counted:
    """A compiled template that counts its renderings."""

    def __init__(self, jinja, owner):
        self.jinja, self.owner = jinja, owner

    def render(self, *a, **kw):
        self.owner.renders += 1
        return self.jinja.render(*a, **kw)

    def generate(self, *a, **kw):
        self.owner.renders += 1
        return self.jinja.generate(*a, **kw)


def builder(n_ctx):
    return PromptBuilder(CharVocab(), CountingTemplate(), None, n_ctx)


def history(n, seed=0):
    """A system prompt, then turns of varied lengths, some with several replies or tools."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": "Be brief."}]
    while len(msgs) < n - 1:
        msgs.append({"role": "user", "content": "q" * rng.randint(1, 40)})
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            msgs.append({"role": rng.choice(("assistant", "assistant", "tool")),
                         "content": "a" * rng.randint(1, 60)})
    msgs.append({"role": "user", "content": "And now?"})
    return msgs


def work(n_msgs, n_ctx, overflow):
    b = builder(n_ctx)
    try:
        b.prepare(history(n_msgs), overflow=overflow, max_tokens=16)
    except ContextOverflowError:
        pass
    return b.template.renders, b.model.calls


def test_refusing_a_long_history_renders_and_tokenizes_it_once():
    for n in (50, 500, 2000):  # the old builder rendered every message prefix: n + 1 renders
        renders, tokenized = work(n, 1024, "error")
        assert renders == 1 and tokenized <= 1


def test_sliding_costs_what_the_kept_part_costs_not_what_was_dropped():
    small, large = work(100, 512, "slide"), work(1600, 512, "slide")
    # the kept part is alike, so are its boundaries; the search adds a few tries per doubling
    assert large[1] - small[1] <= 10, (small, large)
    assert large[0] - small[0] <= 10, (small, large)


def reference_slide(msgs, n_ctx, reserve):
    """Drop one turn at a time until the prompt fits, as the builder once did."""
    t = ChatTemplate(CHATML)
    head = 1 if msgs[0]["role"] == "system" else 0
    msgs, dropped = list(msgs), 0
    while len(t.render(msgs)) + reserve > n_ctx:
        if len(msgs) - head <= 1:
            return None
        n = 1
        while head + n < len(msgs) - 1 and msgs[head + n]["role"] != "user":
            n += 1
        del msgs[head : head + n]
        dropped += n
    return dropped, len(t.render(msgs))


@pytest.mark.parametrize("seed", range(10))
def test_slide_keeps_what_dropping_one_turn_at_a_time_kept(seed):
    rng = random.Random(seed)
    msgs = history(rng.randint(3, 120), seed)
    if seed % 2:
        msgs = msgs[1:]  # no system prompt: every turn may go
    n_ctx = rng.choice((64, 200, 700, 3000, 20000))
    want = reference_slide(msgs, n_ctx, min(16, n_ctx // 4))
    b = builder(n_ctx)
    if len(ChatTemplate(CHATML).render(msgs)) < n_ctx:
        assert b.prepare(msgs, overflow="slide", max_tokens=16).dropped == 0
    elif want is None:
        with pytest.raises(ContextOverflowError):
            b.prepare(msgs, overflow="slide", max_tokens=16)
    else:
        p = b.prepare(msgs, overflow="slide", max_tokens=16)
        assert (p.dropped, len(p.tokens)) == want
        assert p.messages == msgs[: 1 if msgs[0]["role"] == "system" else 0] + msgs[
            len(msgs) - len(p.messages) + (1 if msgs[0]["role"] == "system" else 0):]


def test_a_long_message_is_previewed_from_its_start_as_from_the_whole_text():
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(["a", "bc ", " ", "\n\n", " " * 90, "word "])
                       for _ in range(rng.randrange(0, 400)))
        whole = " ".join(text.split())
        want = whole if len(whole) <= 20 else whole[:19] + "…"
        assert preview({"content": text}, width=20) == want


def test_a_text_too_long_to_fit_is_refused_untokenized():
    b = builder(512)  # 512 tokens of at most 4 bytes each: 2048 bytes at most
    big = [{"role": "user", "content": "x" * 3_000_000}]
    with pytest.raises(ContextOverflowError, match="at least") as info:
        b.prepare(big)
    assert info.value.at_least and info.value.prompt_tokens > 512
    assert b.model.calls == 0
    fits = [{"role": "user", "content": "x" * 300}]
    assert len(b.prepare(fits).tokens) == len(ChatTemplate(CHATML).render(fits))


def test_a_template_writing_a_huge_string_is_refused_before_it_is_built():
    t = CountingTemplate("{{ 'x' * 300000000 }}{{ messages[0]['content'] }}")
    b = PromptBuilder(CharVocab(), t, None, 512)
    with pytest.raises(ContextOverflowError, match="at least"):
        b.prepare([{"role": "user", "content": "hi"}])
    assert b.model.calls == 0


def test_a_lone_surrogate_is_refused_naming_the_message():
    ok = {"role": "user", "content": "fine"}
    with pytest.raises(InvalidRequestError, match=r"messages\[1\] \(user\) content holds a lone "
                       r"surrogate \(U\+DCFF\)"):
        builder(512).prepare([ok, {"role": "user", "content": "bad\udcff"}])
    with pytest.raises(InvalidRequestError, match=r"messages\[0\] \(user\) content\[0\]\['text'\]"):
        normalize([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}])
    assert normalize([ok, {"role": "user", "content": "emoji \U0001F600 ok"}])


def test_the_vocabulary_bounds_hold_on_the_embedded_model(model_path):
    from nbkv.llama.backend import Model
    from nbkv.llama.tokens import longest_piece, tokenize_up_to

    model = Model(model_path)
    longest = longest_piece(model)
    assert longest == max(len(model.piece(t)) for t in range(model.n_vocab))
    text = "<|im_start|>user\nHow many bytes are in a kilobyte? " * 20
    tokens = model.tokenize(text)
    assert tokenize_up_to(model, text, len(tokens)) == tokens
    assert tokenize_up_to(model, text, len(tokens) - 1) == len(tokens)  # the count, no ids
    assert len(tokens) >= len(text.encode()) / longest
    b = PromptBuilder(model, ChatTemplate(CHATML), None, 256)
    with pytest.raises(ContextOverflowError) as info:  # counted, though not held
        b.prepare([{"role": "user", "content": text}])
    assert not info.value.at_least and info.value.prompt_tokens == len(
        model.tokenize(ChatTemplate(CHATML).render([{"role": "user", "content": text}])))
