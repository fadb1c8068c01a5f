"""The llama.cpp sampler chain of a request, and greedy sampling in llama.cpp's graph."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import llama_cpp
import numpy as np

from nbkv.core.streams import SamplingParams


class DeviceGreedy:
    """Greedy sampling done by llama.cpp's backend for some sequences of one context.

    While a sequence has a greedy chain attached (``llama_set_sampler``), each of its
    output rows' argmax is computed in the decode's own graph, beside the logits (on the
    GPU when they are there), and only the token is copied out
    (``llama_get_sampled_token_ith``): the host never reads the vocabulary-wide row. The
    raw logits of those rows are not copied, so whoever reads logits calls ``use(())``
    first. Changing the attached set makes llama.cpp plan its graph again at the next
    decode, so the engine changes it only when its requests' needs change.
    """

    def __init__(self, ctx_ptr: Any, enabled: bool = True) -> None:
        self._ctx = ctx_ptr
        self.enabled = enabled  # False: never attach (the host reads the rows)
        self._chains: dict[int, Any] = {}  # sequence -> its attached chain
        self._retired: list[Any] = []  # detached chains, freed after the next decode
        self._asked: Any = None  # what the last use() was given
        #: the sequences sampled in the graph now
        self.seqs: frozenset[int] = frozenset()

    def use(self, seqs: Sequence[int]) -> None:
        """Sample ``seqs`` (and only them) in the graph from the next decode on."""
        if seqs == self._asked:  # called every step: nothing to do unless it changes
            return
        self._asked = seqs
        want = frozenset(seqs) if self.enabled else frozenset()
        for seq in self.seqs - want:
            llama_cpp.llama_set_sampler(self._ctx, seq, None)
            self._retired.append(self._chains.pop(seq))
        for seq in want - self.seqs:
            chain = llama_cpp.llama_sampler_chain_init(
                llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            # a chain is initialised for one context once: a new one for every attach
            if llama_cpp.llama_set_sampler(self._ctx, seq, chain):
                self._chains[seq] = chain
            else:  # this build or split mode cannot: the host reads the rows from now on
                llama_cpp.llama_sampler_free(chain)
                self.enabled = False
                break
        for seq in list(self._chains) if not self.enabled else ():
            llama_cpp.llama_set_sampler(self._ctx, seq, None)
            self._retired.append(self._chains.pop(seq))
        self.seqs = frozenset(self._chains)

    def decoded(self) -> None:
        """A decode ran with the current set: the chains detached before it can go."""
        while self._retired:
            llama_cpp.llama_sampler_free(self._retired.pop())

    def token(self, index: int) -> int:
        """The token the graph picked for output row ``index`` of the last decode."""
        token = int(llama_cpp.llama_get_sampled_token_ith(self._ctx, index))
        if token < 0:
            raise RuntimeError(f"no token was sampled in the graph for batch row {index}")
        return token

    def close(self) -> None:
        """Free the chains (after the context is freed)."""
        self._retired.extend(self._chains.values())
        self._chains.clear()
        self.seqs = frozenset()
        self.decoded()


class Sampler:
    """A native sampler chain; call :meth:`sample` after each decode, :meth:`close` at the end.

    Plain greedy sampling (temperature 0, no repeat penalty) skips the chain: the token is
    the one the graph picked (:class:`DeviceGreedy`), or the logits row is read in place
    and its first largest entry taken, as llama.cpp's greedy sampler picks, without
    building the chain's candidate array over the whole vocabulary.
    """

    def __init__(self, params: SamplingParams, n_vocab: int, history: Sequence[int] = ()) -> None:
        self.params = params
        self.n_vocab = n_vocab
        self.greedy = params.temperature <= 0 and params.repeat_penalty == 1.0
        self._history = history
        self.ptr: Any = None  # the native chain, made when a token first needs it (greedy: rarely)
        self.closed = False
        if not self.greedy:
            self._chain()

    def _chain(self) -> Any:
        """The native chain (made on first use)."""
        if self.ptr is not None or self.closed:
            return self.ptr
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        self.ptr = chain
        add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
        p, history = self.params, self._history
        n_vocab = self.n_vocab
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
        return chain

    def sample(self, ctx: Any, index: int) -> int:
        """Pick a token for row ``index`` of ``ctx``'s last decode (a ``Context``)."""
        device = ctx.sampling
        if device.seqs:  # the rows were sampled in the graph, their logits not copied
            if not self.greedy:
                raise RuntimeError("a sampler chain needs the logits: detach the graph's "
                                   "greedy sampling before the decode")
            return int(device.token(index))
        ctx_ptr = ctx.ptr
        if self.greedy:
            ptr = llama_cpp.llama_get_logits_ith(ctx_ptr, index)
            if ptr:
                row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                token = int(row.argmax())  # the first largest, as the greedy sampler's ">"
                if math.isfinite(row[token]):  # a NaN row: the chain decides, as before
                    return token
        return llama_cpp.llama_sampler_sample(self._chain(), ctx_ptr, index)

    def close(self) -> None:
        """Free the chain."""
        self.closed = True
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
