"""The codes records carry: how a slot was found, why a request reused, where it was parked.

Words, colours and patterns for them live in :mod:`nbkv.ui`.

Also :func:`common_prefix`, the one longest-common-prefix function every layer matches with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# how the policy found the slot (``record.strategy``)
HASH_HIT = "hash-hit"
HASH_EXTEND = "hash-extend"
PREFIX_SALVAGE = "prefix-salvage"
MISS = "miss"

# why a request reused what it reused (``record.reason``)
FIRST = "first"  # the session's first request: nothing of it was cached
CONTINUED = "continued"  # the conversation grew: everything cached was reused
COPIED = "copied"  # a prefix was copied from another conversation's slot
#: a new conversation got a slot whose conversation shares its start: those tokens were kept
#: in place (no copy ran)
SHARED = "shared"
RELOADED = "reloaded"  # the engine was loaded again since the session's last request
EVICTED = "evicted"  # another session's request took this session's slot
CLEARED = "cleared"  # the user cleared the slot
#: the engine proved its exactness in the background and dropped what it had cached before
PROVEN = "proven"
EDITED = "edited"  # an earlier message changed
SYSTEM_CHANGED = "system-changed"  # the system prompt changed
TEMPLATE_DRIFT = "template-drift"  # the same messages rendered to different tokens
IMAGE_CHANGED = "image-changed"  # a different image at the same place
OVERFLOW = "overflow"  # the oldest messages were dropped to fit the slot
CHECKPOINT = "checkpoint"  # memory that cannot be cut: restored a checkpoint before the cut
UNCACHED = "uncached"  # cache mode spc/off: conversations are not kept
RESTORED = "restored"  # a parked conversation was put back into a slot
REPLAYED = "replayed"  # the same prompt and settings: the cached reply was given again

#: the codes of ``record.reason``; their words are in :data:`nbkv.ui.vocabulary.EVENTS`
REASONS = (FIRST, CONTINUED, COPIED, SHARED, RELOADED, EVICTED, CLEARED, PROVEN, EDITED,
           SYSTEM_CHANGED, TEMPLATE_DRIFT, IMAGE_CHANGED, OVERFLOW, CHECKPOINT, UNCACHED,
           RESTORED, REPLAYED)
#: a conversation's fate (not a reason): its slot was taken and it was parked
PARKED = "parked"

#: where a conversation was parked (``record.restored_from``, ``evicted_parked``), in the
#: words every surface uses (:data:`nbkv.ui.vocabulary.PARKING` takes them from here)
TIERS = {"ram": "RAM", "disk": "disk", "server-ram": "the server's RAM"}


def counted(n: int, word: str, many: str = "") -> str:
    """``1 message``, ``3 messages``: a count and its noun, never ``message(s)``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def tier_words(tier: str) -> str:
    """``RAM`` or ``disk``: where a conversation was parked."""
    return TIERS.get(tier, tier)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (C-speed slice compares).

    The one such function: token lists, hash lists and strings (template renderings) alike.
    """
    if not (isinstance(a, (str, tuple)) and type(a) is type(b)):
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
