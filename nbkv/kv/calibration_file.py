"""The calibration cache: measured rules on disk, signed, checked field by field when read.

One JSON file (:data:`FILE` in ``$NBKV_CACHE_DIR``, default ``~/.cache/nbkv``) maps a key (the
model, llama.cpp build, CPU features and settings: :func:`cache_key`) to a measured
:class:`~nbkv.kv.invariance.PrefillRule`. The folder is shared (Binder, CI, copied between
machines) and the file is plain JSON, so an entry is used only if

- it is signed by this user's key (:mod:`nbkv.core.signing`, the key saves are signed with),
  over its key and its body: an entry edited by hand, moved under another model's key, or
  written by another user or machine is not;
- every field is there, of its type and in its range (:func:`check_entry`), and the rule
  agrees with its own table (no chunk size it allows was measured unequal).

Anything else is a doubt: the caller measures again (and says so in the log), never fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from nbkv.core import signing
from nbkv.kv.invariance import PrefillRule
from nbkv.llama.backend import system_info

log = logging.getLogger("nbkv")

#: the file (versioned: entries of other formats live in other files, so older nbkv versions
#: sharing the folder keep reading theirs)
FILE = "calibration-v3.json"
#: the largest chunk size, alignment and generation batch a measurement can report
MAX_ROWS, MAX_ALIGN, MAX_GEN = 64, 32, 8


def cache_dir() -> Path:
    """Where generated and measured files live: ``$NBKV_CACHE_DIR`` or ``~/.cache/nbkv``."""
    env = os.environ.get("NBKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nbkv"


def cache_key(fingerprint: str, settings: dict[str, Any]) -> str:
    """The key a measurement is cached under: model, build, CPU features, settings."""
    from nbkv.llama import backend

    body = {"model": fingerprint, "build": backend.llama_cpp_version(),
            "system": system_info(), **settings}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _signed_bytes(key: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"key": key, "body": body}, sort_keys=True).encode()


_BOOLS = ("exact", "single_row", "mixed")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_entry(body: Any) -> tuple[PrefillRule, int] | str:
    """The rule and generation-test size an entry's body holds, or why it is not usable."""
    if not isinstance(body, dict):
        return f"an entry is a {type(body).__name__}, not an object"
    rule, gen_tested = body.get("rule"), body.get("gen_tested")
    if not isinstance(rule, dict):
        return "its rule is missing or not an object"
    fields = {"threshold", "align", "exact", "single_row", "gen_rows", "mixed", "reason",
              "table", "seconds"}
    if set(rule) != fields:
        missing, extra = sorted(fields - set(rule)), sorted(set(rule) - fields)
        return f"its rule's fields differ (missing {missing}, unknown {extra})"
    bad = [f for f in _BOOLS if not isinstance(rule[f], bool)]
    if bad:
        return f"{bad[0]} is {rule[bad[0]]!r}, not true or false"
    for name, lo, hi in (("threshold", 1, MAX_ROWS), ("align", 1, MAX_ALIGN),
                         ("gen_rows", 0, MAX_GEN)):
        v = rule[name]
        if not _int(v) or not lo <= v <= hi:
            return f"{name} is {v!r}, not a whole number from {lo} to {hi}"
    if rule["align"] & (rule["align"] - 1):
        return f"align is {rule['align']}, not a power of two"
    if not isinstance(gen_tested, int) or isinstance(gen_tested, bool) \
            or not 1 <= gen_tested <= MAX_GEN:
        return f"gen_tested is {gen_tested!r}, not a whole number from 1 to {MAX_GEN}"
    if not isinstance(rule["reason"], str) or not isinstance(rule["seconds"], (int, float)):
        return "its reason or seconds has the wrong type"
    table = rule["table"]
    if not isinstance(table, list) or not all(
            isinstance(t, list) and len(t) == 2 and _int(t[0]) and 1 <= t[0] <= MAX_ROWS
            and isinstance(t[1], bool) for t in table):
        return "its table is not a list of [rows, equal] pairs"
    out = PrefillRule.from_json(rule)
    if out.exact:
        allowed = [k for k, ok in out.table if not ok
                   and k >= out.threshold and k % out.align == 0]
        if allowed:
            return (f"it allows chunks of {allowed[0]} rows, which its own table measured "
                    "unequal")
        if out.single_row and (out.align != 1 or dict(out.table).get(1) is not True):
            return "single_row is claimed where one-row chunks were not measured equal"
    return out, gen_tested


def cached_entry(key: str, path: Path | None = None) -> tuple[PrefillRule, int] | None:
    """The rule cached under ``key`` and how many sequences its generation test covered.

    None when there is none, or on any doubt about it (logged: the caller measures again).
    """
    path = path or cache_dir() / FILE
    entry = _read(path).get(key)
    if entry is None:
        return None
    why: str | None
    if not isinstance(entry, dict) or not isinstance(entry.get("body"), dict):
        why = "it is not an object with a body"
    else:
        why = signing.problem(_signed_bytes(key, entry["body"]), entry.get("signature"))
    found = check_entry(entry["body"]) if why is None else why
    if isinstance(found, str):
        log.warning("nbkv does not use the calibration cached in %s for this model (%s): "
                    "measuring again", path, found)
        return None
    return found


def cached(key: str, path: Path | None = None) -> PrefillRule | None:
    """The rule cached under ``key``, if any (as measured)."""
    found = cached_entry(key, path)
    return found[0] if found is not None else None


def store(key: str, rule: PrefillRule, path: Path | None = None, *, gen_tested: int = 1
          ) -> None:
    """Cache ``rule`` under ``key``, signed (atomically; a failure to write is only logged)."""
    path = path or cache_dir() / FILE
    body = {"rule": rule.to_json(), "gen_tested": gen_tested}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = {"body": body, "signature": signing.sign(_signed_bytes(key, body))}
        fd, tmp = tempfile.mkstemp(prefix=FILE + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the calibration in %s: %s", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
