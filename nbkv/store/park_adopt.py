"""Taking over what a closed or dead engine parked: the namespaces of a parking directory.

The layout and the rules are :mod:`nbkv.store.park_disk`'s. Adopting an entry is a copy
then a commit: its blobs are linked (or copied, where a link is refused) into the adopting
engine's namespace under temporary names and renamed into place, then its manifest is
written there (the commit), and only then is the old manifest deleted; the old blobs go
with the sweep at the end. A kill at any point, or a full disk, leaves every committed
entry whole in one namespace or the other (both, for a moment: the next engine sees the
copy and the original as one). An entry that cannot be adopted (the disk is full) stays
where it is, with its blobs, for the next engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbkv.core.errors import RestoreError
from nbkv.store.blobstore import BLOBS, fsync_dir, manifest_text, stale_by_age, sweep, write_file
from nbkv.store.parked import DISK, info_from_json

if TYPE_CHECKING:
    from nbkv.store.park_disk import DiskTier

log = logging.getLogger("nbkv.store.parking")

ENTRIES = "entries"
ENGINES = "engines"
LOCK = "lock"
ENTRY_FILE = re.compile(r"[0-9a-f]{32}\.json")


def entry_file(key: str) -> str:
    """The manifest name of the entry ``key`` (a digest: session names never make paths).

    Any ``str`` has one, a lone surrogate in a session name included.
    """
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32] + ".json"


def flock(fd: int, blocking: bool = False, shared: bool = False) -> bool:
    """Take a ``flock`` on ``fd`` (exclusive unless ``shared``); False when another has it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: every other namespace looks live
        return not blocking
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                    | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def locked(path: Path, flags: int = os.O_RDWR, blocking: bool = False, shared: bool = False
           ) -> Iterator[bool]:
    """Hold a :func:`flock` on the file ``path`` (opened with ``flags``); yields whether held.

    A file that cannot be opened (none there, a read-only directory) is not held.
    """
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        yield False
        return
    try:
        yield flock(fd, blocking, shared)
    finally:
        os.close(fd)


def orphaned(ns: Path, legacy: bool) -> contextlib.AbstractContextManager[bool]:
    """Hold ``ns``'s lock if nobody does (its engine is gone); yields whether it is held.

    No lock file: a namespace being made, or not one at all (not held).
    """
    return locked(ns / ENTRIES, os.O_RDONLY) if legacy else locked(ns / LOCK)


def number(key: str) -> int:
    """The number an entry's key ends with (``session#12``), 0 if none."""
    tail = key.rpartition("#")[2]
    return int(tail) if tail.isdigit() else 0


def adopt_orphans(tier: DiskTier) -> None:
    """Take over the servable entries of namespaces whose engine is gone."""
    spaces = [(p, False) for p in sorted((tier.root / ENGINES).iterdir())
              if p.is_dir() and p != tier.dir
              # a hidden one is being made (not yet locked), unless a killed one
              and (not p.name.startswith(".") or stale_by_age(p))]
    if (tier.root / ENTRIES).is_dir():
        spaces.append((tier.root, True))  # nbkv 0.1's layout
    for ns, legacy in spaces:
        with orphaned(ns, legacy) as mine:
            if mine:
                try:
                    _adopt(tier, ns, legacy)
                except OSError as e:  # another process's files: leave them
                    log.warning("parking directory: could not adopt %s: %s", ns, e)


def _scan(tier: DiskTier, ns: Path
          ) -> tuple[list[tuple[Path, dict[str, Any], int | None]], set[str]]:
    """``ns``'s servable manifests (oldest use first), and the blobs of those left alone."""
    found: list[tuple[Path, dict[str, Any], int | None]] = []
    stays: set[str] = set()  # blobs the entries left behind name
    for path in sorted((ns / ENTRIES).iterdir()):
        if not ENTRY_FILE.fullmatch(path.name):
            continue
        try:
            body = tier.body(path)
            info_from_json(body.get("entry"), tier.n_vocab, DISK)
        except RestoreError as e:  # its engine is gone: nobody else reads it
            tier.skip(path, str(e))
            continue
        diffs, slots_from = tier.servable(body.get("identity"))
        if diffs:
            log.info("parked entry %s left alone: %s", path, "; ".join(diffs))
            stays.update(body["blobs"])
            continue
        found.append((path, body, slots_from))
    found.sort(key=lambda f: (f[1]["entry"].get("used_at", 0), f[1]["entry"].get("last_used", 0)))
    return found, stays


def _adopt(tier: DiskTier, ns: Path, legacy: bool) -> None:
    """Copy ``ns``'s servable entries here; clean what no manifest of it names."""
    found, stays = _scan(tier, ns)
    numbers = [number(k) for k in tier.keys()]
    for i, (path, body, slots_from) in enumerate(found):
        key = str(body["entry"]["key"])
        if tier.holds(key, body["blobs"]):  # a copy committed by an adopter that was killed
            unlink(path)
            continue
        if key in tier:
            n = max([*numbers, number(key)]) + 1
            numbers.append(n)
            key = f"{key.rpartition('#')[0] or '-'}#{n}"
            body["entry"]["key"] = key
        try:
            moved = _move(tier, ns, path, body, key)
        except OSError as e:  # a full disk: this one and the rest stay for the next engine
            log.warning("parking directory: could not adopt %s (%s): it and %d more entries "
                        "stay in %s", path, e, len(found) - i - 1, ns)
            for _, rest, _ in found[i:]:
                stays.update(rest["blobs"])
            break
        if moved:
            tier.add(key, info_from_json(body["entry"], tier.n_vocab, DISK),
                     {n: m["size"] for n, m in body["blobs"].items()}, slots_from)
            tier.adopted += 1
            if path.exists():  # its old manifest could not be deleted: its blobs stay too
                stays.update(body["blobs"])
    # nbkv 0.1's layout has no lock: there only an old temporary file is a dead writer's
    tmp_ok = stale_by_age if legacy else (lambda f: True)
    for d in (ns / ENTRIES, ns):
        for f in d.iterdir():
            if f.name.endswith(".tmp") and tmp_ok(f):
                unlink(f)
    sweep(ns, stays, stale_tmp=tmp_ok)
    if not legacy and not any((ns / ENTRIES).iterdir()):
        shutil.rmtree(ns, ignore_errors=True)
    if tier.adopted:
        log.info("parking directory %s: %d entries taken over from engines that were "
                 "closed", tier.root, tier.adopted)


def _move(tier: DiskTier, ns: Path, path: Path, body: dict[str, Any], key: str) -> bool:
    """Copy one entry from ``ns`` into ``tier``'s namespace, then commit it there.

    Its blobs first (a link, or a copy), then its manifest; the old manifest is deleted
    last. False (and the entry announced lost) when a blob it names is missing.
    """
    for name in body["blobs"]:
        src, dst = ns / BLOBS / name, tier.dir / BLOBS / name
        if dst.exists():  # copied with an entry adopted before (blobs are shared)
            continue
        if not src.is_file():
            tier.skip(path, f"blob {name} is missing")
            tier.tell(info_from_json(body["entry"], tier.n_vocab, DISK),
                      f"unreadable: blob {name} is missing", corrupt=True)
            return False
        copy_blob(src, dst)
    fsync_dir(tier.dir / BLOBS)
    write_file(tier.dir / ENTRIES / entry_file(key), [manifest_text(body).encode()])
    unlink(path)
    return True


def copy_blob(src: Path, dst: Path) -> None:
    """Put ``src``'s file at ``dst`` whole or not at all: a hard link, else a copy, renamed."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.adopt.tmp")
    try:
        try:
            os.link(src, tmp)
        except OSError:  # another file system, or links refused: copy it
            unlink(tmp)
            shutil.copyfile(src, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        unlink(tmp)
        raise


def unlink(path: Path, quiet: bool = False) -> OSError | None:
    """Delete ``path`` if it is there; the error (logged unless ``quiet``) if refused."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        if not quiet:
            log.warning("parking directory: could not delete %s: %s", path, e)
        return e
    return None
