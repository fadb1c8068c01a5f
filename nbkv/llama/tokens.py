"""Tokens at llama.cpp's door: a text's bound, the batch that carries them in, the sampler.

- What bounds a text's tokens, read from the vocabulary without tokenizing it whole, so that
  a prompt that cannot fit a slot is refused before it costs memory: a token stands for at
  most :func:`longest_piece` bytes, and :func:`tokenize_up_to` never holds more token ids
  than the slot has room for.
- :class:`Batch`: a reusable ``llama_batch`` for tokens of several sequences.
- :class:`Sampler`: a request's sampler chain; :class:`DeviceGreedy`: greedy sampling in
  llama.cpp's graph.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any, Protocol

import llama_cpp
import numpy as np

from nbkv.core.streams import SamplingParams

_I32 = ctypes.c_int32
_P32 = ctypes.POINTER(_I32)


class Batch:
    """A reusable ``llama_batch`` for tokens of several sequences.

    Its arrays are owned here (one sequence a token): a run of a sequence's tokens is
    written with slice assignments, in C, instead of a Python step a token.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.n = 0
        self._token = (_I32 * capacity)()
        self._pos = (_I32 * capacity)()
        self._n_seq = (_I32 * capacity)(*([1] * capacity))
        self._seq = (_I32 * capacity)()
        base = ctypes.addressof(self._seq)
        self._seq_ptrs = (_P32 * capacity)(
            *[ctypes.cast(base + ctypes.sizeof(_I32) * i, _P32) for i in range(capacity)])
        self._logits = (ctypes.c_int8 * capacity)()
        self._b: llama_cpp.llama_batch | None = llama_cpp.llama_batch(
            0, ctypes.cast(self._token, _P32), None, ctypes.cast(self._pos, _P32),
            ctypes.cast(self._n_seq, _P32), ctypes.cast(self._seq_ptrs, ctypes.POINTER(_P32)),
            ctypes.cast(self._logits, ctypes.POINTER(ctypes.c_int8)))

    def clear(self) -> None:
        """Empty the batch."""
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append a token; returns its index in the batch (for reading its logits)."""
        i = self.n
        if i >= self.capacity:
            raise OverflowError("batch full")
        self._token[i] = token
        self._pos[i] = pos
        self._seq[i] = seq
        self._logits[i] = logits
        self.n = i + 1
        return i

    def add_run(self, tokens: Sequence[int], start_pos: int, seq: int, logits_last: bool) -> int:
        """Append consecutive tokens of one sequence; returns the index of the last one."""
        n, k = self.n, len(tokens)
        end = n + k
        if end > self.capacity:
            raise OverflowError("batch full")
        # ctypes takes any sequence of the slice's length (its stubs say a list)
        self._token[n:end] = tokens  # type: ignore[call-overload]
        self._pos[n:end] = range(start_pos, start_pos + k)  # type: ignore[call-overload]
        self._seq[n:end] = (seq,) * k  # type: ignore[call-overload]
        self._logits[n:end] = bytes(k)  # type: ignore[call-overload]
        if logits_last and k:
            self._logits[end - 1] = 1
        self.n = end
        return end - 1

    @property
    def raw(self) -> llama_cpp.llama_batch:
        """The ``llama_batch`` struct, with ``n_tokens`` set."""
        b = self._b
        if b is None:
            raise RuntimeError("this batch is closed")
        b.n_tokens = self.n
        return b

    def close(self) -> None:
        """Drop the struct (its arrays are Python's: nothing native to free)."""
        self._b = None


_LONGEST: dict[tuple[str, int], int] = {}  # longest_piece, by model file


class Vocabulary(Protocol):
    """What the bounds read of a model (:class:`nbkv.llama.backend.Model` has it)."""

    path: Any  # the model file
    n_vocab: int
    vocab: Any  # llama.cpp's ``llama_vocab`` pointer


def longest_piece(model: Vocabulary) -> int:
    """The most bytes one token of ``model`` stands for (special tokens as their text)."""
    key = (str(model.path), model.n_vocab)
    n = _LONGEST.get(key)
    if n is None:
        buf = ctypes.create_string_buffer(64)
        n = 1
        for t in range(model.n_vocab):  # a piece longer than the buffer answers its -length
            n = max(n, abs(llama_cpp.llama_token_to_piece(model.vocab, t, buf, 64, 0, True)))
        n = _LONGEST[key] = n
    return n


def tokenize_up_to(model: Vocabulary, text: str, limit: int) -> list[int] | int:
    """``model.tokenize(text)``, or how many tokens it takes when that is more than ``limit``.

    Only ``limit`` token ids are ever held here, however long ``text`` is.
    """
    data = text.encode("utf-8")
    buf = (llama_cpp.llama_token * limit)()
    n = llama_cpp.llama_tokenize(model.vocab, data, len(data), buf, limit, False, True)
    return list(buf[:n]) if n >= 0 else -n


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
