"""Signatures of saves, parked entries and calibrations: an HMAC under a per-user secret key.

What Jupyter does for notebooks (``NotebookNotary``: an HMAC-SHA256 under a secret in the
user's data directory, created readable by the user alone), nbkv does for the manifests of
its saves and parked entries. A manifest's checksum catches corruption, but anyone can edit
a body and recompute it; only someone who can read the key can make a signature this user
accepts. A manifest signed by another key (another user, another machine), by none (an nbkv
that did not sign yet, a file written by hand) or not matching its body (edited since) is
*untrusted*: :mod:`nbkv.store.persist` refuses it unless told to trust it, and then
recomputes every slot from its tokens before serving it. The calibration cache's entries are
signed the same way (:mod:`nbkv.kv.calibration_file`): an untrusted one is measured again.
It lives in the core, below every layer that signs.

The key is ``$NBKV_SIGNING_KEY`` if set, else ``signing_key`` in the platformdirs user data
directory (``~/.local/share/nbkv`` on Linux), created on first use with mode 0600. If it
cannot be created (a read-only home), this process signs with a temporary key and says so:
its saves then restore elsewhere only with ``trust=True``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("nbkv")

KEY_ENV = "NBKV_SIGNING_KEY"
KEY_FILE = "signing_key"
ALG = "hmac-sha256"
_MIN_KEY = 32  # characters of a usable key file (64 hex digits are written)


@dataclass(frozen=True)
class SigningKey:
    """A user's secret, where it lives, and the short id manifests name it by."""

    secret: bytes
    path: Path
    temporary: bool = False  # the file could not be read or created: this process only

    @property
    def key_id(self) -> str:
        """16 hex digits that name the key without revealing it."""
        return hmac.new(self.secret, b"nbkv key id", hashlib.sha256).hexdigest()[:16]

    def mac(self, data: bytes) -> str:
        """The HMAC-SHA256 of ``data`` under this key, in hex."""
        return hmac.new(self.secret, data, hashlib.sha256).hexdigest()


def key_path() -> Path:
    """Where this user's key lives: ``$NBKV_SIGNING_KEY``, else the user data directory."""
    env = os.environ.get(KEY_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("nbkv")) / KEY_FILE


_keys: dict[Path, SigningKey] = {}
_lock = threading.Lock()


def user_key() -> SigningKey:
    """The user's key (read once per process and path; created 0600 on first use)."""
    path = key_path()
    with _lock:
        key = _keys.get(path)
        if key is None:
            key = _keys[path] = _open(path)
        return key


def _open(path: Path) -> SigningKey:
    try:
        secret = _read(path)
        if secret is None:
            _create(path)
            secret = _read(path)
        if secret is None:
            raise OSError("it is empty or too short")
    except OSError as e:
        log.warning("nbkv cannot read or create its signing key %s (%s): this process signs "
                    "its saves with a temporary key, so they will restore elsewhere only "
                    "with trust=True (set $%s to a writable file)", path, e, KEY_ENV)
        return SigningKey(secrets.token_bytes(32), path, temporary=True)
    return SigningKey(secret, path)


def _read(path: Path) -> bytes | None:
    """The key in ``path``; None when there is no file (or an unusable one, to replace)."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read().strip()
    except FileNotFoundError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("nbkv's signing key %s can be read by other users: anyone who can read it "
                    "can sign saves you will trust (chmod 600 %s)", path, path)
    return data if len(data) >= _MIN_KEY else None


def _create(path: Path) -> None:
    """Write a new random key to ``path``, mode 0600; a key another process wrote first wins."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if path.exists() and _read(path) is None:
            path.unlink()  # an empty or truncated key file: replaced
        try:
            os.link(tmp, path)  # atomic, and refuses to replace a key another process made
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not path.exists():
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sign(data: bytes) -> dict[str, str]:
    """The signature of ``data`` (a manifest body's canonical JSON) under this user's key."""
    key = user_key()
    return {"alg": ALG, "key": key.key_id, "mac": key.mac(data)}


def problem(data: bytes, signature: Any) -> str | None:
    """None when ``signature`` is this user's signature of ``data``, else why it is not."""
    if signature is None:
        return ("it is not signed: written by an nbkv that did not sign saves yet, or by "
                "someone else")
    if not isinstance(signature, dict) or signature.get("alg") != ALG \
            or not isinstance(signature.get("mac"), str):
        return "its signature is malformed"
    key = user_key()
    if hmac.compare_digest(signature["mac"], key.mac(data)):
        return None
    if signature.get("key") == key.key_id:
        return "its signature does not match its contents (edited since it was signed)"
    return (f"it is signed by another key ({str(signature.get('key'))[:16]!r}; yours is "
            f"{key.key_id!r}, in {key.path}): saved by another user or on another machine")
