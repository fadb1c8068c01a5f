"""A slot's KV map: which positions hold which message, reused, prefilled or generated.

Presentation data the records carry for the views (the KV maps, slot cards, static pages);
both engines build it here from a prompt and the counts of one request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from nbkv.core.events import GENERATED, PREFILLED, REUSED, Segment
from nbkv.core.messages import preview
from nbkv.media.units import spans
from nbkv.prompt.builder import Prompt

#: a message's preview by its prefix hash (:func:`nbkv.core.messages.prefix_hashes`): a
#: conversation's messages are previewed again at every turn, twice
_PREVIEWS: dict[str, str] = {}
_PREVIEWS_MAX = 4096


def _preview(message: Mapping[str, Any], key: str | None) -> str:
    if key is None:
        return preview(message)
    text = _PREVIEWS.get(key)
    if text is None:
        if len(_PREVIEWS) >= _PREVIEWS_MAX:
            _PREVIEWS.clear()
        text = _PREVIEWS[key] = preview(message)
    return text


def message_segments(messages: Sequence[Mapping[str, Any]], ends: Sequence[int],
                     n_prompt: int, reuse: int, n: int, reply: str,
                     keys: Sequence[str] = ()) -> tuple[Segment, ...]:
    """A slot's KV map: a span per message and the reply, split by reused/prefilled/generated.

    The prompt has ``n_prompt`` positions, the first ``reuse`` from cache; the slot holds ``n``
    (the reply's after the prompt). Text only: the engine splits image positions out itself.
    ``keys``: the messages' prefix hashes, where known (their previews are kept by them).
    """
    spans, start = [], 0
    for i, end in enumerate(ends):
        key = keys[i] if i < len(keys) else None
        spans.append((start, end, i, messages[i]["role"], _preview(messages[i], key)))
        start = end
    k = len(messages)
    said = preview({"content": reply})
    # the reply's message begins with the generation prompt: its span says the reply too
    # (the views merge the two into one message), until there is none yet
    spans.append((start, n_prompt, k, "assistant", said or "(generation prompt)"))
    spans.append((n_prompt, max(n, n_prompt), k, "assistant", said))
    out = []
    for a, b, i, role, text in spans:
        for lo, hi, state in ((a, min(b, reuse), REUSED),
                              (max(a, reuse), min(b, n_prompt), PREFILLED),
                              (max(a, n_prompt), b, GENERATED)):
            if hi > lo:
                out.append(Segment(lo, hi, i, role, state, text))
    return tuple(out)


def prompt_segments(p: Prompt, reuse: int, n: int, reply: str, marker: str = "\0"
                    ) -> tuple[Segment, ...]:
    """:func:`message_segments` of a prompt, with its image positions split out.

    ``marker`` is the projector's image placeholder text, shown as ``[image]`` in previews.
    """
    out = message_segments(p.messages, p.ends, len(p.tokens), reuse, n, reply, p.hashes)
    if p.media is None:  # a prompt holds image positions only with its media (nbkv.prompt)
        return out
    runs = [(s.start, s.end, s.image_hash, s.n_tokens)
            for s in spans(p.tokens) if s.kind == "image"]
    if not runs:
        return out
    names = {im.hash: Path(im.source).name for im in (p.media.images if p.media else ())
             if im.source and not im.source.startswith("data:")}
    split = []
    for seg in out:
        seg = replace(seg, preview=seg.preview.replace(marker, "[image]"))
        pos = seg.start
        for a, b, h, n_emb in runs:
            lo, hi = max(a, seg.start), min(b, seg.end)
            if hi <= lo:
                continue
            if lo > pos:
                split.append(replace(seg, start=pos, end=lo))
            split.append(replace(seg, start=lo, end=hi, kind="image", image_hash=h,
                                 image_name=names.get(h or "", ""), embeddings=n_emb))
            pos = hi
        if pos < seg.end:
            split.append(replace(seg, start=pos, end=seg.end))
    return tuple(split)
