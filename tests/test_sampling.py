"""Greedy sampling reads the logits row in place (nbkv.llama.sampling.Sampler).

Plain greedy sampling skips llama.cpp's sampler chain: the token is the row's first largest
logit, as the chain's greedy sampler picks it; anything else (a NaN row, a temperature, a
repeat penalty) is the chain's to decide. No model: the logits and the chain are stand-ins.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from nbkv.core.requests import SamplingParams
from nbkv.llama import sampling
from nbkv.llama.sampling import Sampler

CHAIN = -7  # what the stand-in chain answers


@pytest.fixture
def logits(monkeypatch):
    """A settable logits row, and a log of the chain's calls."""
    row = np.zeros(50, dtype=np.float32)
    calls: list[int] = []

    def get_logits_ith(ctx, index):
        return row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def sampler_sample(chain, ctx, index):
        calls.append(index)
        return CHAIN

    monkeypatch.setattr(sampling.llama_cpp, "llama_get_logits_ith", get_logits_ith)
    monkeypatch.setattr(sampling.llama_cpp, "llama_sampler_sample", sampler_sample)
    return row, calls


def test_greedy_takes_the_first_largest_logit_without_the_chain(logits):
    row, calls = logits
    s = Sampler(SamplingParams(temperature=0), len(row))
    try:
        row[:] = np.linspace(-3, 2, len(row))
        row[17] = row[31] = 9.0  # a tie: the first, as the chain's ">" keeps it
        assert s.sample(None, 0) == 17 and calls == []
        row[:] = -np.inf  # nothing finite to pick: the chain decides
        row[3] = np.nan
        assert s.sample(None, 2) == CHAIN and calls == [2]
    finally:
        s.close()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=1),
                                    SamplingParams(temperature=0, repeat_penalty=1.1)])
def test_anything_but_plain_greedy_is_the_chains(logits, params):
    row, calls = logits
    row[5] = 4.0
    s = Sampler(params, len(row))
    try:
        assert s.sample(None, 1) == CHAIN and calls == [1]
    finally:
        s.close()
