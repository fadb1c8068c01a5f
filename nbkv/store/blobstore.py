"""Content-addressed blobs and checksummed JSON: the save format's building blocks.

A blob is raw bytes in ``blobs/<sha256>.bin``; its name is checked against
``[0-9a-f]{64}.bin`` before any path is built from it, so a manifest from someone else can
neither make nbkv read outside its directory nor run code (nothing is pickled). Every file
is written to a temporary name, fsynced and renamed, so a crash leaves the old file or the
new one, never half of one. A manifest is JSON carrying the SHA-256 of its own canonical
body, a table of every blob's checksum and size, and an HMAC of the body under the user's
key (:mod:`nbkv.core.signing`): only a manifest this user's nbkv wrote is trusted.

Used by :mod:`nbkv.store.persist` (``%kvcache save``) and :mod:`nbkv.store.park_disk` (parked
conversations on disk). A slot's position units (token ids and image runs) and its KV-map
segments are encoded here too, for both.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from nbkv.core import signing
from nbkv.core.errors import RestoreError
from nbkv.core.events import Segment
from nbkv.media.units import MediaKey, MediaUnit

BLOBS = "blobs"
BLOB_NAME = re.compile(r"[0-9a-f]{64}\.bin")


def nbytes(buf: Any) -> int:
    """The size in bytes of a buffer (bytes, a ctypes array, a numpy array...)."""
    return memoryview(buf).nbytes


def blob_name(buf: Any) -> str:
    """The content name of ``buf``: its SHA-256 in hex, then ``.bin``."""
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest() + ".bin"


def blob_path(root: Path, name: Any) -> Path:
    """The file of blob ``name`` under ``root``, refusing anything but a content name."""
    if not isinstance(name, str) or not BLOB_NAME.fullmatch(name):
        raise RestoreError(f"the manifest names an invalid blob {name!r}: a crafted or "
                           "corrupt save (blob names are 64 hex digits + .bin)")
    return root / BLOBS / name


class Blobs:
    """Blobs being written, by content name (the same bytes are kept once)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def add(self, buf: Any) -> str:
        """Keep ``buf`` and return its content name."""
        mv = memoryview(buf).cast("B")
        name = blob_name(mv)
        self.data.setdefault(name, mv)
        return name

    def table(self) -> dict[str, dict[str, Any]]:
        """The manifest's blob table: every name with its checksum and size."""
        return {n: {"sha256": n[:64], "size": len(mv)} for n, mv in self.data.items()}


# -- writing -----------------------------------------------------------------------------------


def fsync_dir(d: Path) -> None:
    """Make a directory's renames durable (best effort where the OS does not allow it)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(target: Path, chunks: Iterable[Any]) -> int:
    """Write ``chunks`` to ``target`` atomically (temporary file, fsync, rename); the size."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
                n += len(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return n


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's contents, in hex."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_blobs(root: Path, blobs: Blobs, on_blob: Callable[[int], object] | None = None
                ) -> int:
    """Write every blob not already under ``root/blobs``; returns the bytes written.

    Raises ``OSError`` as the file system does; a blob already there is kept. ``on_blob``
    is told the size of each blob done (written or found).
    """
    bdir = root / BLOBS
    bdir.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, mv in blobs.data.items():
        target = bdir / name
        if target.is_file() and target.stat().st_size == len(mv) \
                and file_sha256(target) == name[:64]:
            if on_blob is not None:
                on_blob(len(mv))
            continue  # content-addressed: the same bytes are already there
        written += write_file(target, [mv])
        if on_blob is not None:
            on_blob(len(mv))
    fsync_dir(bdir)
    return written


TMP_AGE = 3600.0  # a temporary file this old is a dead writer's, where no lock says so


def stale_by_age(f: Path) -> bool:
    """A file older than :data:`TMP_AGE`, when nothing better proves it stale (False: gone)."""
    try:
        return time.time() - f.stat().st_mtime > TMP_AGE
    except OSError:
        return False


def sweep(root: Path, keep: set[str], stale_tmp: Callable[[Path], bool] = stale_by_age
          ) -> int:
    """Delete the blobs under ``root/blobs`` not in ``keep``, and stale temporary files.

    Call it only once no manifest names the others any more. ``stale_tmp(file)`` says
    whether a temporary file is a dead writer's (default: an hour old; a caller holding the
    directory's lock knows every one is). Returns the files deleted.
    """
    gone = 0
    bdir = root / BLOBS
    if not bdir.is_dir():
        return 0
    for f in bdir.iterdir():
        try:
            stale = f.name.endswith(".tmp") and stale_tmp(f)
            if (BLOB_NAME.fullmatch(f.name) and f.name not in keep) or stale:
                f.unlink()
                gone += 1
        except OSError:
            pass
    return gone


# -- reading -----------------------------------------------------------------------------------


class Reader:
    """Reads a manifest's blobs under ``root``, each checked against the ``table`` once.

    Calling it with a blob name returns the bytes as a ctypes array (what llama.cpp reads
    states from), or raises :class:`~nbkv.core.errors.RestoreError` saying what is wrong: a name
    not in the table, a missing, truncated, padded or corrupt file. ``nbytes`` counts the
    bytes read.
    """

    def __init__(self, root: Path, table: dict[str, Any],
                 on_blob: Callable[[int], object] | None = None) -> None:
        self.root = root
        self.table = table
        self.nbytes = 0
        self.on_blob = on_blob  # told the size of each blob read
        self._cache: dict[str, Any] = {}

    def __call__(self, name: Any) -> Any:
        """The checked bytes of blob ``name``."""
        p = blob_path(self.root, name)
        if name in self._cache:
            return self._cache[name]
        meta = self.table.get(name)
        if not isinstance(meta, dict):
            raise RestoreError(f"blob {name} is not in the manifest's blob table")
        size = meta.get("size")
        if not isinstance(size, int) or size < 0:
            raise RestoreError(f"blob {name}: malformed size in the manifest")
        try:
            with p.open("rb") as f:  # straight into the buffer llama.cpp will read
                actual = os.fstat(f.fileno()).st_size
                if actual != size:
                    raise RestoreError(f"blob {name} is truncated or padded: {actual} bytes, "
                                       f"the manifest says {size}")
                buf = (ctypes.c_uint8 * size)()
                got = f.readinto(memoryview(buf).cast("B")) if size else 0
        except FileNotFoundError:
            raise RestoreError(f"blob {name} is missing from {self.root / BLOBS}") from None
        except OSError as e:
            raise RestoreError(f"cannot read blob {name}: {e}") from e
        if got != size:
            raise RestoreError(f"blob {name} is truncated: read {got} of {size} bytes")
        digest = hashlib.sha256(memoryview(buf).cast("B")).hexdigest()
        if digest != meta.get("sha256") or name[:64] != digest:
            raise RestoreError(f"blob {name} fails its checksum (corrupt)")
        self.nbytes += size
        self._cache[name] = buf
        if self.on_blob is not None:
            self.on_blob(size)
        return buf


# -- checksummed, signed JSON ------------------------------------------------------------------


def canonical(body: dict[str, Any]) -> bytes:
    """A manifest body's canonical JSON: what its checksum and signature cover."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def body_checksum(body: dict[str, Any]) -> str:
    """The SHA-256 of a manifest body's canonical JSON."""
    return hashlib.sha256(canonical(body)).hexdigest()


def manifest_text(body: dict[str, Any]) -> str:
    """A manifest file's text: the body, its checksum, and its signature (this user's key).

    The body names every blob's SHA-256, so the signature covers the blobs too.
    """
    return json.dumps({"checksum": body_checksum(body),
                       "signature": signing.sign(canonical(body)), "body": body}, indent=1,
                      sort_keys=True)


def read_manifest(f: Path, fmt: str, version: int) -> tuple[dict[str, Any], str | None]:
    """The checked body of the manifest file ``f``, and why it is untrusted (None: signed).

    Raises :class:`RestoreError` when it is gone, unreadable, of another format, of a
    version newer than ``version`` (or not one), or fails its checksum. Its signature is
    reported, not enforced: the caller decides.
    """
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError:
        raise RestoreError(f"the manifest {f} is gone") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RestoreError(f"the manifest {f} is unreadable (truncated or corrupt: {e})") from e
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or body.get("format") != fmt:
        raise RestoreError(f"{f} is not an {fmt} manifest (format "
                           f"{body.get('format') if isinstance(body, dict) else None!r})")
    v = body.get("version")
    if not isinstance(v, int) or not 1 <= v <= version:
        raise RestoreError(f"{f} has format version {v!r}, newer than this nbkv reads "
                           f"({version}): upgrade nbkv to read it")
    if body_checksum(body) != doc.get("checksum"):
        raise RestoreError(f"the manifest {f} fails its checksum (corrupt or edited)")
    return body, untrusted(doc)


def untrusted(doc: dict[str, Any]) -> str | None:
    """None when manifest ``doc`` is signed by this user's key, else why it is not.

    Check its checksum first: a corrupt manifest is corrupt, not untrusted.
    """
    return signing.problem(canonical(doc["body"]), doc.get("signature"))


# -- what a slot holds, as JSON ------------------------------------------------------------


def encode_units(units: Iterable[Any]) -> list[Any]:
    """A slot's position units as JSON: token ids, and one object per image run."""
    out: list[Any] = []
    for u in units:
        if isinstance(u, MediaUnit):
            if u.offset == 0:
                k = u.key
                out.append({"image": k.image_hash, "sub": k.sub_index, "n_tokens": k.n_tokens,
                            "n_pos": k.n_pos})
        else:
            out.append(int(u))
    return out


def decode_units(items: Any, n_vocab: int) -> list[Any]:
    """Inverse of :func:`encode_units`, validating every entry."""
    if not isinstance(items, list):
        raise RestoreError("a slot's tokens are not a list")
    out: list[Any] = []
    for it in items:
        if isinstance(it, int) and not isinstance(it, bool):
            if not 0 <= it < n_vocab:
                raise RestoreError(f"token id {it} is outside the model's vocabulary")
            out.append(it)
        elif isinstance(it, dict):
            try:
                key = MediaKey(str(it["image"]), int(it["sub"]), int(it["n_tokens"]),
                               int(it["n_pos"]))
            except (KeyError, TypeError, ValueError) as e:
                raise RestoreError(f"malformed image run in a slot's tokens: {it!r}") from e
            if key.n_pos < 1 or key.n_tokens < 1:
                raise RestoreError(f"malformed image run in a slot's tokens: {it!r}")
            out.extend(MediaUnit(key, i) for i in range(key.n_pos))
        else:
            raise RestoreError(f"malformed entry in a slot's tokens: {it!r}")
    return out


def segment_json(s: Segment) -> dict[str, Any]:
    """A KV-map segment as JSON."""
    return {f.name: getattr(s, f.name) for f in fields(Segment)}


def segment_from_json(d: Any) -> Segment:
    """Inverse of :func:`segment_json`."""
    names = {f.name for f in fields(Segment)}
    if not isinstance(d, dict) or not set(d) <= names:
        raise RestoreError(f"malformed KV map segment {d!r}")
    return Segment(**d)
