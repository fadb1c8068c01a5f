"""Sampling parameters and the llama.cpp sampler chain built from them."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import llama_cpp

from nbkv.core.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature=0`` is greedy (deterministic)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: random
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "stop":
                stop = (v,) if isinstance(v, str) else v
                if not isinstance(stop, (list, tuple)) or not all(
                        isinstance(x, str) for x in stop):
                    raise InvalidRequestError(
                        f"stop must be a string or a list of strings, not {v!r}")
                object.__setattr__(self, "stop", tuple(stop))
                continue
            want = float if f.type in ("float", float) else int
            ok = isinstance(v, numbers.Real if want is float else numbers.Integral)
            if not ok or isinstance(v, bool):
                raise InvalidRequestError(
                    f"{f.name} must be {'a number' if want is float else 'an integer'}, "
                    f"not {v!r}")
            if want is float and not math.isfinite(v):  # inf passes ">= 0"; nan fails all
                raise InvalidRequestError(f"{f.name} must be a finite number, not {v!r}")
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0 (1 disables it)"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequestError(msg)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> SamplingParams:
        """Build from keyword arguments, rejecting unknown names with a clear error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling argument(s) {unknown}; known: {sorted(names)}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


class Sampler:
    """A native sampler chain; call :meth:`sample` after each decode, :meth:`close` at the end."""

    def __init__(self, params: SamplingParams, n_vocab: int, history: Sequence[int] = ()) -> None:
        self.params = params
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        self.ptr = chain
        add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
        p = params
        if p.repeat_penalty != 1.0:
            add(llama_cpp.llama_sampler_init_penalties(
                n_vocab, p.repeat_last_n, p.repeat_penalty, 0.0, 0.0))
        if p.temperature <= 0:
            add(llama_cpp.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                add(llama_cpp.llama_sampler_init_top_k(p.top_k))
            add(llama_cpp.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0:
                add(llama_cpp.llama_sampler_init_min_p(p.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(p.temperature))
            add(llama_cpp.llama_sampler_init_dist(p.seed & 0xFFFFFFFF))
        # the repeat penalty looks back over the prompt's tail too, as llama.cpp's server does
        if p.repeat_penalty != 1.0:
            for t in history[-p.repeat_last_n :]:
                llama_cpp.llama_sampler_accept(chain, t)

    def sample(self, ctx_ptr: object, index: int) -> int:
        """Pick a token from the logits at batch index ``index`` (and record it)."""
        return llama_cpp.llama_sampler_sample(self.ptr, ctx_ptr, index)

    def close(self) -> None:
        """Free the chain."""
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
