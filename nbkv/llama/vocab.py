"""What bounds a text's tokens, read from a model's vocabulary without tokenizing it whole.

Used to refuse a prompt that cannot fit a slot before it costs memory: a token stands for at
most :func:`longest_piece` bytes, so a text takes at least its bytes over that many tokens;
and :func:`tokenize_up_to` never holds more token ids than the slot has room for.
"""

from __future__ import annotations

import ctypes

import llama_cpp

from nbkv.llama.backend import Model

_LONGEST: dict[tuple[str, int], int] = {}  # longest_piece, by model file


def longest_piece(model: Model) -> int:
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


def tokenize_up_to(model: Model, text: str, limit: int) -> list[int] | int:
    """``model.tokenize(text)``, or how many tokens it takes when that is more than ``limit``.

    Only ``limit`` token ids are ever held here, however long ``text`` is.
    """
    data = text.encode("utf-8")
    buf = (llama_cpp.llama_token * limit)()
    n = llama_cpp.llama_tokenize(model.vocab, data, len(data), buf, limit, False, True)
    return list(buf[:n]) if n >= 0 else -n
