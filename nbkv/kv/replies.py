"""Replies the cache can give again: the same prompt and settings give the same reply.

With deterministic sampling (greedy, or a fixed seed) and exact KV, a reply is a function of
its prompt's tokens and the sampling settings: decoding it again gives the same tokens. When
a notebook cell runs again with the same prompt (a second "Run All"), the engine can answer
from the cache instead, *if* the conversation is still cached: a slot, or a parked
conversation, holds the prompt token for token (usually followed by the reply and the later
turns, which then stay). :class:`ReplyBook` remembers, per prompt (a digest of its tokens)
and settings, which tokens were generated and how the reply ended; :meth:`ReplyBook.find`
answers only where a holder holds the prompt.

Pure bookkeeping: no model, no llama.cpp. The engine decides when a request may be replayed
(:mod:`nbkv.engine.decoder`); nothing here is ever used with inexact KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbkv.kv.policy import common_prefix
from nbkv.llama.tokens import SamplingParams

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a new seed on every request


def deterministic(params: SamplingParams) -> bool:
    """True when sampling the same logits again picks the same tokens (greedy or seeded)."""
    return params.temperature <= 0 or (params.seed & 0xFFFFFFFF) != RANDOM_SEED


def settings_key(params: SamplingParams) -> tuple[Any, ...]:
    """What decides a deterministic reply besides the prompt: the sampler and the stops.

    Greedy sampling ignores ``top_k``, ``top_p``, ``min_p`` and the seed, so they are left
    out for it; ``max_tokens`` and ``stop`` are the stop conditions.
    """
    p = params
    stops = (p.max_tokens, tuple(p.stop))
    penalty = (p.repeat_penalty, p.repeat_last_n if p.repeat_penalty != 1.0 else 0)
    if p.temperature <= 0:
        return ("greedy", *penalty, *stops)
    return ("seeded", p.temperature, p.top_k, p.top_p, p.min_p, p.seed & 0xFFFFFFFF,
            *penalty, *stops)


#: how a digest of token ids alone begins (:func:`digest`); saves made before it have none
TOKEN_DIGEST = "t:"


def digest(units: Sequence[Any]) -> str:
    """A short digest of a prompt's units (token ids and image units), equal across runs.

    Token ids alone are hashed as 8-byte integers (:data:`TOKEN_DIGEST`); with image units
    among them, as their text (:func:`text_digest`, what every prompt was hashed as before).
    """
    try:
        data = array("q", units).tobytes()
    except TypeError:  # an image unit
        return text_digest(units)
    return TOKEN_DIGEST + hashlib.blake2b(data, digest_size=16).hexdigest()


def text_digest(units: Sequence[Any]) -> str:
    """The digest of ``units`` written as text: image prompts, and any prompt in older saves."""
    return hashlib.blake2b(repr(tuple(units)).encode(), digest_size=16).hexdigest()


def _digest_as(units: Sequence[Any], like: str) -> str:
    """``units``' digest in the form of ``like`` (a memo's, maybe from an older save)."""
    return digest(units) if like.startswith(TOKEN_DIGEST) else text_digest(units)


@dataclass(frozen=True)
class ReplyMemo:
    """A reply a request generated: its tokens, how it ended, and what it followed.

    ``held`` is how many of ``tokens`` the KV held after the reply (the last sampled token is
    not decoded when a reply stops at the token limit or a stop string).
    """

    prompt: str  # digest of the prompt's units
    n_prompt: int  # the prompt's length in KV positions
    settings: tuple[Any, ...]  # settings_key() of the request
    tokens: tuple[int, ...]  # the reply's tokens, as sampled
    held: int
    finish_reason: str  # "stop" or "length"
    request: int  # the request that generated it

    def held_in(self, units: Sequence[Any], prompt: Sequence[Any],
                need: int | None = None) -> int | None:
        """How many of the reply's tokens ``units`` hold after ``prompt``.

        ``units``: a slot's or a parked conversation's. None unless they hold the first
        ``need`` positions of ``prompt`` (default: all of it): the reply is only given where
        its prompt is cached, as far as the cache ever keeps a prompt (a parked conversation
        ends where a canonical prefill may resume, a few positions before its end). Then the
        reply's tokens that follow the whole prompt there, as they were in KV (0 when the
        slot was cut after the prompt or went on another way: the reply is the same).
        """
        n = self.n_prompt
        need = n if need is None else need
        if len(prompt) != n or common_prefix(tuple(units[:n]), tuple(prompt)) < need:
            return None
        if len(units) < n or tuple(units[:n]) != tuple(prompt):
            return 0
        return common_prefix(tuple(units[n:n + self.held]), self.tokens[:self.held])

    def as_json(self) -> dict[str, Any]:
        """The memo as JSON (the save format)."""
        return {"prompt": self.prompt, "n_prompt": self.n_prompt,
                "settings": [list(x) if isinstance(x, tuple) else x for x in self.settings],
                "tokens": list(self.tokens),
                "held": self.held, "finish_reason": self.finish_reason,
                "request": self.request}

    @classmethod
    def from_json(cls, d: Any, n_vocab: int) -> ReplyMemo:
        """Inverse of :meth:`as_json`; ValueError when it is malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"a reply memo is not an object: {d!r:.60}")
        try:
            tokens = tuple(int(t) for t in d["tokens"])
            memo = cls(str(d["prompt"]), int(d["n_prompt"]),
                       tuple(_settings_item(x) for x in d["settings"]), tokens,
                       int(d["held"]), str(d["finish_reason"]), int(d["request"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"a reply memo is malformed: {e}") from e
        if (not 0 <= memo.held <= len(tokens) or memo.n_prompt < 1
                or memo.finish_reason not in ("stop", "length")
                or any(not 0 <= t < n_vocab for t in tokens)):
            raise ValueError("a reply memo is inconsistent")
        return memo


def _settings_item(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(str(s) for s in x)
    if isinstance(x, (str, int, float)):
        return x
    raise TypeError(f"unexpected {type(x).__name__} in a reply memo's settings")


class ReplyBook:
    """The replies generated lately, by prompt and settings; the oldest go first.

    A memo is only ever served through :meth:`find`, which asks for a holder (a slot's or a
    parked conversation's units) that holds the prompt and the reply: what the cache no
    longer holds is not replayed. Not thread-safe: the engine's scheduler thread owns it.
    """

    def __init__(self, size: int = 2048) -> None:
        self.size = size
        self._memos: OrderedDict[tuple[str, tuple[Any, ...]], ReplyMemo] = OrderedDict()
        self._text_keyed = False  # memos from an older save, their prompts hashed as text

    def imported(self, memos: Iterable[ReplyMemo]) -> None:
        """Remember memos a save kept (older saves hash every prompt as text)."""
        for memo in memos:
            self._text_keyed |= not memo.prompt.startswith(TOKEN_DIGEST)
            self.add(memo)

    def __len__(self) -> int:
        return len(self._memos)

    def add(self, memo: ReplyMemo) -> None:
        """Remember ``memo`` (replacing one for the same prompt and settings)."""
        key = (memo.prompt, memo.settings)
        self._memos.pop(key, None)
        self._memos[key] = memo
        while len(self._memos) > self.size:
            self._memos.popitem(last=False)

    def lookup(self, prompt: Sequence[Any], params: SamplingParams) -> ReplyMemo | None:
        """The memo of ``prompt`` under ``params``, if one was generated (not yet checked)."""
        if not deterministic(params):
            return None
        key = settings_key(params)
        d = digest(prompt)
        memo = self._memos.get((d, key))
        if memo is None and self._text_keyed and d.startswith(TOKEN_DIGEST):
            old = self._memos.pop((text_digest(prompt), key), None)  # from an older save
            if old is not None:
                memo = replace(old, prompt=d)
                self._memos[(d, key)] = memo
        return memo

    def find(self, prompt: Sequence[Any], params: SamplingParams,
             holders: Iterable[Sequence[Any]], need: int | None = None
             ) -> tuple[ReplyMemo, int] | None:
        """The memo of ``prompt`` under ``params`` if one of ``holders`` holds the prompt.

        Returns it with the number of its reply's tokens that holder holds after the prompt
        (:meth:`ReplyMemo.held_in`, ``need`` as there), the most of any holder; None when
        no holder holds it.
        """
        memo = self.lookup(prompt, params)
        if memo is None:
            return None
        held = [k for units in holders
                if (k := memo.held_in(units, prompt, need)) is not None]
        if not held:
            return None
        self._memos.move_to_end((memo.prompt, memo.settings))
        return memo, max(held)

    def kept_by(self, holders: Sequence[Sequence[Any]]) -> list[ReplyMemo]:
        """The memos whose prompt one of ``holders`` still holds (what a save keeps)."""
        out = []
        for memo in self._memos.values():
            n = memo.n_prompt
            if any(len(units) >= n and _digest_as(units[:n], memo.prompt) == memo.prompt
                   for units in holders):
                out.append(memo)
        return out

    def cut_by(self, units: Sequence[Any], at: int) -> list[ReplyMemo]:
        """The memos ``units`` hold whose prompt a cut of ``units`` at ``at`` would lose.

        What a slot cut back to ``at`` positions (an edited turn served in its own slot)
        could no longer replay: prompts it holds whole that end after ``at``.
        """
        return [m for m in self._memos.values() if at < m.n_prompt <= len(units)
                and _digest_as(units[:m.n_prompt], m.prompt) == m.prompt]

    def clear(self) -> None:
        """Forget every reply."""
        self._memos.clear()
        self._text_keyed = False
