"""A notebook session's state in a save: its messages as JSON, pictures as blobs.

Used by both savers (:mod:`nbkv.store.persist` in the kernel, :mod:`nbkv.remote.persist` on
a server): the session store to save by default, a saved state checked before it loads,
and the encoding of message values (pictures become content-named image blobs).

A session store is anything iterable over sessions (each with ``name``, ``state_dict()``
and ``load_state(d)``) with ``get(name)`` and, optionally, ``check_state(name, state)``
(raises ``ValueError`` when ``state`` would not load): the notebook's store is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbkv.core.errors import NbkvError, RestoreError, SaveError
from nbkv.media.images import Image, image_hash, load_image
from nbkv.store.blobstore import Blobs

#: the key that marks a picture in a saved message (its value names the image blob)
_IMAGE_TAG = "$nbkv_image"


#: where saves find the kernel's sessions when none are given (set by the notebook layer)
_default_sessions: Callable[[], Any] | None = None


def use_default_sessions(provider: Callable[[], Any] | None) -> None:
    """Make ``provider()`` the session store saves use when none is given (the notebook's)."""
    global _default_sessions
    _default_sessions = provider


def kernel_sessions(sessions: Any = None) -> Any:
    """``sessions``, or by default the kernel's store when nbkv's sessions are in use (else ``()``).

    The session store sits above persistence (it loads engines): it registers itself
    (:func:`use_default_sessions`).
    """
    if sessions is not None:
        return sessions
    return _default_sessions() if _default_sessions is not None else ()


def check_session_state(sessions: Any, name: str, state: Any) -> None:
    """Raise :class:`RestoreError` if ``state`` would not load into a session called ``name``."""
    check = getattr(sessions, "check_state", None)
    if check is None:
        return
    try:
        check(name, state)
    except ValueError as e:
        raise RestoreError(str(e)) from e
    except (KeyError, TypeError) as e:
        raise RestoreError(f"a saved session is malformed: {e}") from e


def session_json(value: Any, blobs: Blobs, where: str) -> Any:
    """A message value as JSON; pictures (PIL, arrays, bytes, Image) become image blobs."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise SaveError(f"{where}: a message has non-string keys")
        return {k: session_json(v, blobs, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [session_json(v, blobs, f"{where}[{i}]") for i, v in enumerate(value)]
    try:
        img = load_image(value)
    except NbkvError as e:
        raise SaveError(f"{where}: a {type(value).__name__} in a message cannot be saved "
                        f"({e})") from e
    return {_IMAGE_TAG: {"blob": blobs.add(img.data), "width": img.width,
                         "height": img.height, "hash": img.hash}}


def session_from_json(value: Any, read: Any) -> Any:
    """A saved message value back: image blobs (``read(name)`` gives their bytes) checked.

    Raises :class:`RestoreError` when an image is malformed or its pixels do not match.
    """
    if isinstance(value, dict):
        if set(value) == {_IMAGE_TAG}:
            d = value[_IMAGE_TAG]
            try:
                data = bytes(read(d["blob"]))
                w, h, hsh = int(d["width"]), int(d["height"]), str(d["hash"])
            except (KeyError, TypeError, ValueError) as e:
                raise RestoreError(f"malformed image in a session: {d!r}") from e
            if len(data) != w * h * 3 or image_hash(w, h, data) != hsh:
                raise RestoreError(f"a session's picture {hsh[:12]} does not match its pixels")
            return Image(w, h, data, hsh, "restored")
        return {k: session_from_json(v, read) for k, v in value.items()}
    if isinstance(value, list):
        return [session_from_json(v, read) for v in value]
    return value
