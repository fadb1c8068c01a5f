"""Checks at the door: arguments of the wrong type or range get a named error, at once.

Each check raises :class:`~nbkv.core.errors.InvalidRequestError` saying what was expected and
what was given, before anything is loaded, queued or sent. ``True`` is not a number here,
though Python lets it stand for 1.
"""

from __future__ import annotations

import numbers
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
    """``value`` if it names a session (a non-empty str) or is None, else an error."""
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidRequestError(f"session must be a non-empty str or None, not {value!r}")
    return value
