"""The llama.cpp sampler chain built from a request's sampling parameters."""

from __future__ import annotations

import math
from collections.abc import Sequence

import llama_cpp
import numpy as np

from nbkv.core.requests import SamplingParams


class Sampler:
    """A native sampler chain; call :meth:`sample` after each decode, :meth:`close` at the end.

    Plain greedy sampling (temperature 0, no repeat penalty) skips the chain: the logits row
    is read in place and its first largest entry taken, as llama.cpp's greedy sampler picks,
    without building the chain's candidate array over the whole vocabulary.
    """

    def __init__(self, params: SamplingParams, n_vocab: int, history: Sequence[int] = ()) -> None:
        self.params = params
        self.n_vocab = n_vocab
        self.greedy = params.temperature <= 0 and params.repeat_penalty == 1.0
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
        if self.greedy:
            ptr = llama_cpp.llama_get_logits_ith(ctx_ptr, index)
            if ptr:
                row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                token = int(row.argmax())  # the first largest, as the greedy sampler's ">"
                if math.isfinite(row[token]):  # a NaN row: the chain decides, as before
                    return token
        return llama_cpp.llama_sampler_sample(self.ptr, ctx_ptr, index)

    def close(self) -> None:
        """Free the chain."""
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
