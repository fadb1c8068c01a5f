"""Checks at the door: arguments of the wrong type or range get a named error, at once.

Each check raises :class:`~nbkv.core.errors.InvalidRequestError` saying what was expected and
what was given, before anything is loaded, queued or sent. ``True`` is not a number here,
though Python lets it stand for 1.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nbkv.core.errors import InvalidRequestError


def whole(name: str, value: Any, least: int, optional: bool = False, hint: str = "") -> Any:
    """``value`` if it is an integer ``>= least`` (or None when ``optional``), else an error."""
    if value is None and optional:
        return value
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < least):
        none = " or None" if optional else ""
        raise InvalidRequestError(f"{name} must be an integer >= {least}{none}, not {value!r}"
                                  + (f" ({hint})" if hint else ""))
    return value


def seconds(name: str, value: Any, optional: bool = False) -> Any:
    """``value`` if it is a number of seconds ``> 0`` (or None when ``optional``), else an error."""
    if value is None and optional:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        none = " or None" if optional else ""
        raise InvalidRequestError(f"{name} must be a number of seconds > 0{none}, not "
                                  f"{value!r}")
    return value


def session_name(value: Any) -> Any:
    """``value`` if it names a session (a non-empty str) or is None, else an error.

    A name must be text that can be written (UTF-8): a lone surrogate (what a file name
    undecodable in the locale, or an escape such as ``U+DCFF`` leaves) is refused.
    """
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidRequestError(f"session must be a non-empty str or None, not {value!r}")
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"session must be valid text: {value!r} holds a lone surrogate "
                f"({value[e.start:e.end]!r} at {e.start})") from None
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def unicode_text(name: str, value: Any) -> Any:
    """``value`` unless a str in it (or in its lists and dicts) holds a lone surrogate.

    Such a str (as ``bytes.decode(errors="surrogateescape")`` makes of bytes that are not UTF-8)
    is not text: it cannot be encoded, so it would fail later, unnamed, in a tokenizer or hash.
    """
    if isinstance(value, str):
        bad = _SURROGATE.search(value)
        if bad is not None:
            raise InvalidRequestError(
                f"{name} holds a lone surrogate (U+{ord(bad.group()):04X}) at character "
                f"{bad.start()}, which is not valid Unicode text: decode bytes with "
                "errors='replace', or remove it")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            unicode_text(f"{name}[{k!r}]", v)
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            unicode_text(f"{name}[{j}]", v)
    return value


def path(name: str, value: Any, optional: bool = True) -> Any:
    """``value`` if it is a non-empty path (``str`` or ``os.PathLike``), or None when optional.

    ``""`` is refused: it would quietly mean the current directory.
    """
    if value is None and optional:
        return value
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes) \
            or not os.fspath(value):
        none = ", or None" if optional else ""
        raise InvalidRequestError(f"{name} must be a non-empty path (str or os.PathLike)"
                                  f"{none}, not {value!r}")
    return value


def directory(name: str, value: Any, optional: bool = True) -> Any:
    """``value`` if it names a directory that exists or can be made and written, else an error.

    Refused: a path that is a file, one under a file, one whose nearest existing directory
    this process may not write.
    """
    if path(name, value, optional) is None:
        return value
    target = Path(value).expanduser()
    try:
        probe = target
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
        if not probe.is_dir():
            where = "is a file" if probe == target else f"lies under the file {probe}"
            raise InvalidRequestError(f"{name} {str(value)!r} {where}: give a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            what = "is" if probe == target else f"would be made in {probe}, which is"
            raise InvalidRequestError(f"{name} {str(value)!r} {what} not writable")
    except OSError as e:
        raise InvalidRequestError(f"{name} {str(value)!r} cannot be used: {e}") from e
    return value


def token(name: str, value: Any, n_vocab: int) -> int:
    """``value`` if it is a token id of a vocabulary of ``n_vocab`` tokens, else an error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not 0 <= int(value) < n_vocab:
        raise InvalidRequestError(f"{name} must be a token id in 0..{n_vocab - 1}, not "
                                  f"{value!r}")
    return int(value)
