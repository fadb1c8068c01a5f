"""Greedy sampling reads the logits row in place (nbkv.llama.tokens.Sampler).

Plain greedy sampling skips llama.cpp's sampler chain: the token is the row's first largest
logit, as the chain's greedy sampler picks it; anything else (a NaN row, a temperature, a
repeat penalty) is the chain's to decide. No model: the logits and the chain are stand-ins.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from nbkv.core.streams import SamplingParams
from nbkv.llama import tokens
from nbkv.llama.tokens import Sampler

CHAIN = -7  # what the stand-in chain answers


class Ctx:
    """A stand-in context: no pointer, and greedy sampling in the graph for ``seqs``."""

    def __init__(self, seqs=(), token=23):
        self.ptr = None
        self.sampling = tokens.DeviceGreedy(None, enabled=False)
        self.sampling.seqs = frozenset(seqs)
        self.sampling.token = lambda index: token


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

    monkeypatch.setattr(tokens.llama_cpp, "llama_get_logits_ith", get_logits_ith)
    monkeypatch.setattr(tokens.llama_cpp, "llama_sampler_sample", sampler_sample)
    return row, calls


def test_greedy_takes_the_first_largest_logit_without_the_chain(logits):
    row, calls = logits
    s = Sampler(SamplingParams(temperature=0), len(row))
    try:
        row[:] = np.linspace(-3, 2, len(row))
        row[17] = row[31] = 9.0  # a tie: the first, as the chain's ">" keeps it
        assert s.sample(Ctx(), 0) == 17 and calls == []
        row[:] = -np.inf  # nothing finite to pick: the chain decides
        row[3] = np.nan
        assert s.sample(Ctx(), 2) == CHAIN and calls == [2]
    finally:
        s.close()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=1),
                                    SamplingParams(temperature=0, repeat_penalty=1.1)])
def test_anything_but_plain_greedy_is_the_chains(logits, params):
    row, calls = logits
    row[5] = 4.0
    s = Sampler(params, len(row))
    try:
        assert s.sample(Ctx(), 1) == CHAIN and calls == [1]
    finally:
        s.close()


def test_rows_sampled_in_the_graph_are_taken_from_it_and_never_read(logits):
    row, calls = logits
    row[5] = 4.0
    greedy = Sampler(SamplingParams(temperature=0), len(row))
    chain = Sampler(SamplingParams(temperature=0.7, seed=1), len(row))
    try:
        assert greedy.sample(Ctx(seqs=(0, 1), token=23), 0) == 23 and calls == []
        # a chain needs the row, which the graph did not copy out: refused, not misread
        with pytest.raises(RuntimeError, match="needs the logits"):
            chain.sample(Ctx(seqs=(0,)), 0)
        assert calls == []
    finally:
        greedy.close()
        chain.close()


def test_greedy_rows_are_sampled_in_the_graph_and_replies_are_unchanged(model_path):
    """A greedy request's tokens come from llama.cpp's graph, a chain's from the host's
    row (the graph's sampling detached for it), a probe reads rows again; replies and probes
    are those of an engine that reads every row on the host."""
    from conftest import talk
    from nbkv import Engine

    seen = {}
    for on in (True, False):
        with Engine(model_path, n_slots=1, n_ctx=1024, exact=False, park_ram=0,
                    device_sampling=on) as e:
            device = e.res.ctx.sampling
            msgs: list = []
            first = talk(e, msgs, "What is a CPU?", "a", max_tokens=8).text
            attached = device.seqs
            warm = e.chat([*msgs, {"role": "user", "content": "And memory?"}], session="a",
                          max_tokens=8, temperature=0.9, seed=1).text
            detached = device.seqs
            again = talk(e, msgs, "And a GPU?", "a", max_tokens=8).text
            probes = e.verify()
            seen[on] = (first, warm, again, attached, detached, probes)
    assert seen[True][:3] == seen[False][:3]
    assert seen[True][3] and not seen[True][4]  # attached for greedy, detached for the chain
    assert not seen[False][3]  # device_sampling=False: never attached
    # the probe read its rows on the host, so it found what the other engine's found
    assert [(v.identical, v.max_diff) for v in seen[True][5]] == \
        [(v.identical, v.max_diff) for v in seen[False][5]] != []
