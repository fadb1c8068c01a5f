"""Reading a save's manifest and checking it against an engine before anything changes.

:func:`read_manifest` checks the manifest's own checksum, format and signature (this user's
key: :mod:`nbkv.core.signing`); :func:`compare` names every fact of the engine that differs
from the save's (model, projector, build, ``n_ctx``, KV layout, memory class);
:func:`restream` converts whole-sequence states between engines with different numbers of
slots; :func:`offer` says after a load whether a save fits.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from nbkv.core.errors import (
    InvalidRequestError,
    NbkvError,
    RestoreError,
    SaveOverwrittenWarning,
    UntrustedSaveError,
)
from nbkv.store.blobstore import read_manifest as read_signed

log = logging.getLogger("nbkv")

FORMAT = "nbkv-kvcache"
VERSION = 1
MANIFEST = "manifest.json"

# -- paths -----------------------------------------------------------------------------------


def default_path(notebook: str | None = None) -> Path:
    """Where saves go by default: one directory per notebook under the user's cache dir.

    ``notebook`` is the notebook's path (Jupyter tells kernels in ``$JPY_SESSION_NAME``);
    without one, a directory called ``default``.
    """
    import platformdirs

    base = Path(os.environ.get("NBKV_SAVE_DIR") or
                Path(platformdirs.user_cache_dir("nbkv")) / "saves")
    nb = notebook or os.environ.get("JPY_SESSION_NAME")
    if not nb:
        return base / "default"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(nb).stem)[:60] or "notebook"
    digest = hashlib.sha256(str(Path(nb).expanduser().absolute()).encode()).hexdigest()[:10]
    return base / f"{stem}-{digest}"


def save_root(path: Any) -> Path:
    """The directory of a save: ``path``, or :func:`default_path` for None.

    Anything but a non-empty path (``str`` or ``os.PathLike``) or None is refused: ``""``
    would otherwise mean the current directory.
    """
    if path is None:
        return default_path()
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes) \
            or not os.fspath(path):
        raise InvalidRequestError(f"a save's directory must be a non-empty path (str or "
                                  f"os.PathLike), or None for the default, not {path!r}")
    return Path(path).expanduser()


def untrusted_message(root: Path, why: str) -> str:
    """What :class:`UntrustedSaveError` says about the save at ``root``."""
    return (f"the save at {root} is not trusted: {why}. Restore it only if you trust where "
            "it came from: engine.restore(path, trust=True) or %kvcache restore --trust "
            "recomputes every slot from its tokens (a full prefill) before serving it")


def read_manifest(path: str | os.PathLike | None = None, trust: bool = False
                  ) -> tuple[Path, dict[str, Any]]:
    """The checked manifest of the save at ``path``: ``(directory, body)``.

    A manifest not signed by this user's key raises :class:`UntrustedSaveError`, unless
    ``trust``.
    """
    root, body, why = open_manifest(path)
    if why is not None and not trust:
        raise UntrustedSaveError(untrusted_message(root, why))
    return root, body


def open_manifest(path: str | os.PathLike | None = None
                  ) -> tuple[Path, dict[str, Any], str | None]:
    """The checked manifest at ``path``: ``(directory, body, why it is untrusted or None)``.

    Its format, version and checksum are checked (:class:`RestoreError`); its signature is
    reported, not enforced: the caller decides.
    """
    root = save_root(path)
    f = root / MANIFEST
    if not f.is_file():
        raise RestoreError(f"no save at {root} (no {MANIFEST})")
    body, why = read_signed(f, FORMAT, VERSION)
    return root, body, why


def compare(engine: Any, body: dict[str, Any]) -> list[str]:
    """What differs between the engine and a save's manifest (empty: compatible)."""
    mine, theirs = engine.identity(), body.get("engine") or {}
    diffs = []
    labels = {"model": "model", "projector": "vision projector",
              "llama_cpp_python": "llama-cpp-python (llama.cpp build)",
              "n_ctx": "tokens per slot (n_ctx)", "memory": "memory class", "kv": "KV layout"}
    for k, label in labels.items():
        a, b = theirs.get(k), mine.get(k)
        if k in ("model", "projector"):
            a = a and a.get("fingerprint")
            b = b and b.get("fingerprint")
        if a != b:
            if k == "projector" and a is None and not uses_media(body):
                continue  # a text-only save restores into a vision engine
            was = (theirs.get(k) or {}).get("name", a) if k in ("model", "projector") else a
            now = (mine.get(k) or {}).get("name", b) if k in ("model", "projector") else b
            diffs.append(f"{label}: saved with {was}, this engine has {now}")
    n_saved = body.get("n_slots")
    if n_saved != engine.n_slots and engine.memory.kind != "plain":
        diffs.append(f"slots: saved with {n_saved}, this engine has {engine.n_slots} (only "
                     "plain-attention saves restore into another number of slots)")
    return diffs


def uses_media(body: dict[str, Any]) -> bool:
    """True when a saved slot, system prompt or parked conversation holds an image."""
    return any(isinstance(t, dict) for s in (*body.get("slots", []), *body.get("spc", []),
                                             *body.get("parked", []))
               for t in s.get("tokens", []))


def compatible(engine: Any, path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The manifest of a trusted save at ``path`` that ``engine`` can restore, else None."""
    try:
        _, body = read_manifest(path)
    except NbkvError:
        return None
    return None if compare(engine, body) else body


_STATE_MAGIC = (0xAF143CD8).to_bytes(4, "little")


def stream_count(state: bytes) -> int:
    """How many KV streams the context that wrote a sequence ``state`` had (its header)."""
    u32 = 4
    pre = 2 * u32 if state[:u32] == _STATE_MAGIC else 0
    return int.from_bytes(state[pre:pre + u32], "little")


def restream(buf: Any, n_now: int) -> Any:
    """A plain-attention sequence state re-addressed from its KV streams to ``n_now``.

    ``buf`` is any buffer; the result is a ctypes array (what llama.cpp reads states from).

    A context has one KV stream per sequence: a slot each, and the shadow sequence of the
    exact mode's rewrite (:mod:`nbkv.engine.rewrite`), so the count is the state's own.

    With ``kv_unified=False`` every slot has its own KV stream, and llama.cpp writes a
    sequence's state as the stream count followed by one section per stream, all empty (a
    zero cell count) but the sequence's own; it refuses a state whose stream count differs
    from the context's. On plain memory the state is just that, so the one non-empty section
    is kept and the empty ones are rewritten for the new count (a reader loads the non-empty
    section into the target sequence's stream, wherever it sits).
    """
    u32, state = 4, bytes(buf)
    # llama.cpp's header: a magic number and the sequence it was read from (ignored on load)
    pre = 2 * u32 if state[:u32] == _STATE_MAGIC else 0
    body = state[pre:]
    n = n_saved = int.from_bytes(body[:u32], "little")
    stream = 0  # the first non-empty section is the sequence's
    while stream < n_saved and len(body) >= u32 * (stream + 2) \
            and not any(body[u32 * (stream + 1):u32 * (stream + 2)]):
        stream += 1
    head = u32 * (1 + stream)
    tail = u32 * (n_saved - stream - 1)
    if n != n_saved or stream >= n_saved or len(body) < head + u32 + tail \
            or (tail and any(body[-tail:])):
        raise RestoreError("a saved state does not have the layout of one KV stream per slot")
    section = body[head:len(body) - tail]
    data = state[:pre] + n_now.to_bytes(u32, "little") + section + bytes(u32) * (n_now - 1)
    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)


def offer(engine: Any, path: str | os.PathLike | None = None) -> str | None:
    """A line offering the save at ``path`` if ``engine`` can restore it, else None."""
    try:
        _, body, why = open_manifest(path)
    except NbkvError:
        return None
    if compare(engine, body):
        return None
    try:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(body["created"])))
        sessions = ", ".join(str(s["name"]) for s in body["sessions"]) or "no session"
        n = len(body["slots"])
    except (KeyError, TypeError, ValueError):
        return None
    if why is not None:
        return (f"a save of this notebook from {when} fits this engine ({n} slot(s); "
                f"{sessions}), but {why}: if you trust it, %kvcache restore --trust brings "
                "it back, recomputing every slot by a full prefill")
    return (f"a save of this notebook from {when} fits this engine ({n} slot(s); "
            f"{sessions}): %kvcache restore brings it back (or %kvcache load --restore)")


#: each save directory's manifest as this process last wrote or read it (inode, mtime, size)
_SEEN: dict[Path, tuple[int, int, int]] = {}


def _stamp(root: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(root / MANIFEST)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def seen(root: Path) -> None:
    """Remember ``root``'s manifest as this process has just written or read it."""
    stamp = _stamp(root)
    if stamp is not None:
        _SEEN[root.resolve()] = stamp


def warn_if_overwritten(root: Path) -> None:
    """Warn before a save replaces a manifest another writer replaced since :func:`seen`.

    Called under the save directory's lock: a :class:`SaveOverwrittenWarning`.
    """
    before, now = _SEEN.get(root.resolve()), _stamp(root)
    if before is not None and now is not None and now != before:
        warnings.warn(SaveOverwrittenWarning(
            f"the save in {root} was written by another process (or engine) since this one "
            "last saved or restored it; this save replaces it (the last writer wins)"),
            stacklevel=5)
