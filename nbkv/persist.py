"""Slots that survive a kernel restart: save and restore an engine's caches on disk.

A save is a directory::

    manifest.json          what was saved, for which model and settings, and a checksum
                           of every blob (the manifest carries its own checksum too)
    blobs/<sha256>.bin     raw bytes, named by their SHA-256: sequence states,
                           checkpoints, system-prompt states, image embeddings, pictures

Nothing is pickled: the manifest is JSON and the blobs are raw bytes whose names are
checked against ``[0-9a-f]{64}.bin`` before any path is built from them, so a save from
someone else can neither run code nor make nbkv read outside its directory.

A save is atomic: every blob is written to a temporary file, fsynced and renamed to its
content name; then the manifest is written the same way and renamed over the old one; only
then are blobs that no manifest names any more deleted. A crash at any point leaves the
previous manifest and every blob it names in place.

Restore reads the manifest, checks it against the engine (model and projector fingerprints,
llama.cpp build, per-slot context, KV layout, memory class) and reads and checksums every
blob *before* touching the engine; any mismatch raises :class:`~nbkv.errors.RestoreError`
naming what differs, and the engine stays as it was. The states are then loaded on the
scheduler thread (no request interleaves), each slot is verified, and on any failure the
slots are put back as they were.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .blobstore import (
    BLOBS,
    Blobs,
    Reader,
    body_checksum,
    decode_units,
    encode_units,
    fsync_dir,
    manifest_text,
    segment_from_json,
    segment_json,
    sweep,
    write_blobs,
    write_file,
)
from .engine_state import EngineBusy
from .errors import NbkvError, RestoreError, SaveError
from .events import RequestFinished, SlotsChanged
from .images import Image, image_hash, load_image
from .media_units import MediaUnit
from .parked import ParkedEntry
from .slot_kv import KVSnapshot
from .slot_table import SlotState
from .spc import SavedPrompt

if TYPE_CHECKING:
    from .engine import Engine
    from .sessions import SessionStore

log = logging.getLogger("nbkv")

FORMAT = "nbkv-kvcache"
VERSION = 1
MANIFEST = "manifest.json"
_IMAGE_TAG = "$nbkv_image"


# -- reports ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotSave:
    """One slot as saved or restored."""

    index: int  # in the engine (restore: the slot it went into)
    session: str | None
    tokens: int
    nbytes: int  # its state plus its checkpoints


@dataclass(frozen=True)
class SaveReport:
    """What a save wrote."""

    path: Path
    slots: tuple[SlotSave, ...]
    busy: tuple[int, ...]  # slots serving a request, not saved
    spc_entries: int
    embeddings: int
    sessions: tuple[str, ...]
    nbytes: int  # bytes the manifest names (shared blobs counted once)
    written: int  # bytes actually written (blobs already on disk are kept)
    seconds: float
    created: float

    def __str__(self) -> str:
        per = ", ".join(f"slot {s.index} ({s.session or '-'}): {s.tokens} tokens, "
                        f"{_mb(s.nbytes)}" for s in self.slots) or "no slot in use"
        busy = f"; busy, not saved: {list(self.busy)}" if self.busy else ""
        return (f"saved {len(self.slots)} slot(s) to {self.path} in {self.seconds:.2f} s, "
                f"{_mb(self.nbytes)} ({per}; {self.spc_entries} system prompt(s), "
                f"{self.embeddings} image embedding(s), sessions: "
                f"{', '.join(self.sessions) or 'none'}){busy}")


@dataclass(frozen=True)
class RestoreReport:
    """What a restore loaded, and what did not fit."""

    path: Path
    slots: tuple[SlotSave, ...]
    dropped: tuple[str, ...]  # sessions whose slot did not fit (fewer slots than saved)
    spc_entries: int
    embeddings: int
    sessions: tuple[str, ...]
    nbytes: int
    seconds: float
    saved_at: float

    def __str__(self) -> str:
        per = ", ".join(f"slot {s.index} ({s.session or '-'}): {s.tokens} tokens"
                        for s in self.slots) or "no slot"
        drop = (f"; not enough slots, dropped the least recently used: "
                f"{', '.join(self.dropped)}" if self.dropped else "")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.saved_at))
        return (f"restored the save of {when} from {self.path} in {self.seconds:.2f} s: "
                f"{per}; {self.spc_entries} system prompt(s), {self.embeddings} image "
                f"embedding(s), sessions: {', '.join(self.sessions) or 'none'}{drop}")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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


# -- what describes an engine ----------------------------------------------------------------


def describe_engine(engine: Engine) -> dict[str, Any]:
    """The facts a saved state depends on (compared field by field on restore)."""
    return engine.identity()


def _require_local(engine: Any, what: str) -> None:
    """Only an engine with the state API (:meth:`nbkv.engine.Engine.export_state`) saves here."""
    if not hasattr(engine, "export_state"):
        err = SaveError if what == "save" else RestoreError
        raise err(f"{what} is not supported for {type(engine).__name__}: an in-kernel "
                  "nbkv.Engine or a llama-server engine can save and restore its slots; an "
                  "OpenAI-compatible server keeps its cache to itself")


def kernel_sessions(sessions: Any) -> Any:
    """``sessions``, or by default the kernel's store when nbkv's sessions are in use.

    Looked up, not imported: the session store sits above persistence (it loads engines).
    """
    if sessions is not None:
        return sessions
    mod = sys.modules.get("nbkv.sessions")
    return mod.STORE if mod is not None else ()


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


# -- encoding --------------------------------------------------------------------------------


def _jsonable(value: Any, blobs: Blobs, where: str) -> Any:
    """A message value as JSON; pictures (PIL, arrays, bytes, Image) become image blobs."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise SaveError(f"{where}: a message has non-string keys")
        return {k: _jsonable(v, blobs, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, blobs, f"{where}[{i}]") for i, v in enumerate(value)]
    try:
        img = load_image(value)
    except NbkvError as e:
        raise SaveError(f"{where}: a {type(value).__name__} in a message cannot be saved "
                        f"({e})") from e
    return {_IMAGE_TAG: {"blob": blobs.add(img.data), "width": img.width,
                         "height": img.height, "hash": img.hash}}


def _unjson(value: Any, read: Any) -> Any:
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
        return {k: _unjson(v, read) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjson(v, read) for v in value]
    return value


# -- capture (scheduler thread) --------------------------------------------------------------


# -- save ------------------------------------------------------------------------------------


def save(engine: Engine, path: str | os.PathLike | None = None,
         sessions: SessionStore | None = None, *, only_if_idle: bool = False) -> SaveReport:
    """Save ``engine``'s slots and caches, and the messages of ``sessions``, to ``path``.

    Saved: each idle slot's state (and checkpoints), the system-prompt cache, the image
    embeddings the slots use, and the message histories of ``sessions`` (default: the
    kernel's store). Raises :class:`SaveError` when the directory cannot be written; the
    previous save there is then untouched.
    """
    _require_local(engine, "save")
    store = kernel_sessions(sessions)
    root = Path(path).expanduser() if path is not None else default_path()
    t0 = time.perf_counter()
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / BLOBS).mkdir(exist_ok=True)
    except OSError as e:
        raise SaveError(f"cannot create the save directory {root}: {e}") from e
    if not os.access(root, os.W_OK) or not os.access(root / BLOBS, os.W_OK):
        raise SaveError(f"the save directory {root} is not writable")
    cap = engine.export_state(only_if_idle)
    blobs = Blobs()
    slots_json, reports = [], []
    media: set[str] = set()
    for s in cap.slots:
        kv = s.kv
        cps = [{"pos": c.pos, "blob": blobs.add(c.data)} for c in kv.checkpoints.items]
        media.update(u.key.image_hash for u in kv.tokens if isinstance(u, MediaUnit))
        slots_json.append({
            "index": s.index, "session": s.session, "tokens": encode_units(kv.tokens),
            "n_tokens": len(kv.tokens), "settled": kv.settled,
            "exact_len": kv.exact_len, "hashes": list(s.hashes),
            "msg_ends": list(s.msg_ends), "last_used": s.last_used,
            "state": blobs.add(kv.state), "checkpoints": cps,
            "segments": [segment_json(g) for g in s.segments], "nbytes": kv.nbytes,
        })
        reports.append(SlotSave(s.index, s.session, len(kv.tokens), kv.nbytes))
    parked_json = engine.parking.export(blobs) if engine.parking is not None else []
    for e in parked_json:
        media.update(u["image"] for u in e["tokens"] if isinstance(u, dict))
    spc_json = []
    for key, entry in cap.spc:
        media.update(u.key.image_hash for u in entry.tokens if isinstance(u, MediaUnit))
        spc_json.append({"key": key, "tokens": encode_units(entry.tokens),
                         "state": blobs.add(entry.state)})
    emb_json = []
    proj = engine.projector
    if proj is not None:
        for h in sorted(media):
            emb = proj.cache.peek(proj.cache_key(h))
            if emb is None:
                continue  # evicted: the slot's KV holds the image; a rebuild re-encodes it
            arrays = []
            for a in emb.arrays:
                a = np.ascontiguousarray(a, dtype=np.float32)
                arrays.append({"blob": blobs.add(a.tobytes()), "shape": list(a.shape),
                               "dtype": "float32"})
            emb_json.append({"image": h, "arrays": arrays})
    sess_json = [_jsonable(s.state_dict(), blobs, f"session {s.name}") for s in store]
    created = time.time()
    body = {
        "format": FORMAT, "version": VERSION, "created": created,
        "engine": describe_engine(engine),
        "n_slots": engine.n_slots, "cache": engine.cache, "exact": engine.exact,
        "template": hashlib.sha256(engine.template.source.encode()).hexdigest(),
        "slots": slots_json, "spc": spc_json, "embeddings": emb_json, "sessions": sess_json,
        "parked": parked_json,
        "blobs": blobs.table(),
    }
    with _locked(root, exclusive=True):
        written = _write(root, body, blobs)
    rep = SaveReport(root, tuple(reports), tuple(cap.busy), len(spc_json), len(emb_json),
                     tuple(s["name"] for s in sess_json),
                     sum(len(mv) for mv in blobs.data.values()), written,
                     time.perf_counter() - t0, created)
    engine.last_save = rep
    log.info("%s", rep)
    return rep


@contextlib.contextmanager
def _locked(root: Path, exclusive: bool) -> Any:
    """Hold ``root``'s lock file: one writer, or readers, at a time (across processes too).

    Without it, a save's clean-up could delete blobs that another save's new manifest (or a
    restore reading the old one) still needs.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock between processes
        yield
        return
    try:
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only save can still be restored
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _write(root: Path, body: dict[str, Any], blobs: Blobs) -> int:
    try:
        written = write_blobs(root, blobs)
        written += write_file(root / MANIFEST, [manifest_text(body).encode()])
        fsync_dir(root)
    except OSError as e:
        raise SaveError(f"could not write the save to {root}: {e} (the previous save there, "
                        "if any, is intact)") from e
    # only now may blobs the new manifest does not name go: no manifest names them any more
    sweep(root, set(blobs.data))
    return written


# -- restore ---------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike | None = None) -> tuple[Path, dict[str, Any]]:
    """The checked manifest of the save at ``path``: ``(directory, body)``."""
    root = Path(path).expanduser() if path is not None else default_path()
    f = root / MANIFEST
    if not f.is_file():
        raise RestoreError(f"no save at {root} (no {MANIFEST})")
    try:
        doc = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RestoreError(f"the manifest {f} is unreadable (truncated or corrupt: {e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), dict):
        raise RestoreError(f"{f} is not an nbkv save manifest")
    body = doc["body"]
    if body.get("format") != FORMAT:
        raise RestoreError(f"{f} is not an nbkv save manifest (format {body.get('format')!r})")
    version = body.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise RestoreError(f"the save at {root} has format version {version!r}, newer than this "
                           f"nbkv reads ({VERSION}): upgrade nbkv to restore it")
    if body_checksum(body) != doc.get("checksum"):
        raise RestoreError(f"the manifest {f} fails its checksum (corrupt or edited)")
    return root, body


def compare(engine: Engine, body: dict[str, Any]) -> list[str]:
    """What differs between the engine and a save's manifest (empty: compatible)."""
    mine, theirs = describe_engine(engine), body.get("engine") or {}
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
            if k == "projector" and a is None and not _uses_media(body):
                continue  # a text-only save restores into a vision engine
            was = (theirs.get(k) or {}).get("name", a) if k in ("model", "projector") else a
            now = (mine.get(k) or {}).get("name", b) if k in ("model", "projector") else b
            diffs.append(f"{label}: saved with {was}, this engine has {now}")
    n_saved = body.get("n_slots")
    if n_saved != engine.n_slots and engine.memory.kind != "plain":
        diffs.append(f"slots: saved with {n_saved}, this engine has {engine.n_slots} (only "
                     "plain-attention saves restore into another number of slots)")
    return diffs


def _uses_media(body: dict[str, Any]) -> bool:
    return any(isinstance(t, dict) for s in (*body.get("slots", []), *body.get("spc", []),
                                             *body.get("parked", []))
               for t in s.get("tokens", []))


def compatible(engine: Engine, path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The manifest of a save at ``path`` that ``engine`` can restore, else None (no raise)."""
    try:
        _, body = read_manifest(path)
    except RestoreError:
        return None
    return None if compare(engine, body) else body


_STATE_MAGIC = (0xAF143CD8).to_bytes(4, "little")


def restream(state: bytes, n_saved: int, n_now: int) -> bytes:
    """A plain-attention sequence state re-addressed from ``n_saved`` KV streams to ``n_now``.

    With ``kv_unified=False`` every slot has its own KV stream, and llama.cpp writes a
    sequence's state as the stream count followed by one section per stream, all empty (a
    zero cell count) but the sequence's own; it refuses a state whose stream count differs
    from the context's. On plain memory the state is just that, so the one non-empty section
    is kept and the empty ones are rewritten for the new count (a reader loads the non-empty
    section into the target sequence's stream, wherever it sits).
    """
    u32 = 4
    # llama.cpp's header: a magic number and the sequence it was read from (ignored on load)
    pre = 2 * u32 if state[:u32] == _STATE_MAGIC else 0
    body = state[pre:]
    n = int.from_bytes(body[:u32], "little")
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
    zero = bytes(u32)
    return state[:pre] + n_now.to_bytes(u32, "little") + section + zero * (n_now - 1)


def offer(engine: Engine, path: str | os.PathLike | None = None) -> str | None:
    """A line offering the save at ``path`` if ``engine`` can restore it, else None."""
    body = compatible(engine, path)
    if body is None:
        return None
    try:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(body["created"])))
        sessions = ", ".join(str(s["name"]) for s in body["sessions"]) or "no session"
        n = len(body["slots"])
    except (KeyError, TypeError, ValueError):
        return None
    return (f"a save of this notebook from {when} fits this engine ({n} slot(s); "
            f"{sessions}): %kvcache restore brings it back (or %kvcache load --restore)")


@dataclass
class _Plan:
    slots: list[SlotState] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    spc: list[tuple[str, SavedPrompt]] = field(default_factory=list)
    embeddings: list[tuple[str, list[np.ndarray]]] = field(default_factory=list)
    sessions: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # state_dict()s
    parked: list[ParkedEntry] = field(default_factory=list)  # for the engine's parking lot
    nbytes: int = 0


def _load(engine: Engine, root: Path, body: dict[str, Any], sessions: Any) -> _Plan:
    """Read and check every blob and record of a save; touches nothing in the engine."""
    table = body.get("blobs")
    if not isinstance(table, dict):
        raise RestoreError("the manifest has no blob table")
    plan = _Plan()
    read = Reader(root, table)

    n_vocab = engine.model.n_vocab
    n_saved = body.get("n_slots")

    def state(name: Any) -> Any:
        buf = read(name)
        if n_saved == engine.n_slots:
            return buf
        data = restream(bytes(buf), int(n_saved), engine.n_slots)
        return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)

    try:
        saved = sorted(body.get("slots", []), key=lambda s: -int(s["last_used"]))
        lot = engine.parking
        for i, s in enumerate(saved):
            if i >= engine.n_slots and lot is None:
                plan.dropped.append(s.get("session") or f"slot {s['index']}")
                continue
            tokens = decode_units(s["tokens"], n_vocab)
            n = len(tokens)
            ends, hashes = [int(e) for e in s["msg_ends"]], [str(h) for h in s["hashes"]]
            settled = int(s["settled"])
            exact_len = int(s.get("exact_len", n))  # saves before nbkv 0.1 rewrote all
            if n != s["n_tokens"] or n > engine.n_ctx or not 0 <= settled <= exact_len <= n \
                    or len(ends) != len(hashes) or any(not 0 < e <= n for e in ends):
                raise RestoreError(f"slot {s['index']}: inconsistent record in the manifest")
            cps = []
            for c in s["checkpoints"]:
                pos = int(c["pos"])
                if not 0 < pos <= n:
                    raise RestoreError(f"slot {s['index']}: checkpoint at {pos} is outside it")
                cps.append((pos, read(c["blob"])))
            segments = tuple(segment_from_json(g) for g in s["segments"])
            if i >= engine.n_slots:  # more slots saved than there are: park the rest
                plan.parked.append(ParkedEntry(
                    s["session"], tokens, hashes, ends, state(s["state"]), cps, segments,
                    settled, exact_len, None, int(s["last_used"])))
                continue
            plan.slots.append(SlotState(
                int(s["index"]), s["session"], tuple(hashes), tuple(ends), segments,
                int(s["last_used"]), None,
                KVSnapshot.of(state(s["state"]), tokens, settled, exact_len, cps)))
        if lot is not None:
            plan.parked[:0] = lot.decode(body.get("parked", []), read, state)
        for e in body.get("spc", []):
            plan.spc.append((str(e["key"]), SavedPrompt(
                state(e["state"]), tuple(decode_units(e["tokens"], n_vocab)))))
        for e in body.get("embeddings", []):
            arrays = []
            for a in e["arrays"]:
                shape = tuple(int(x) for x in a["shape"])
                if a.get("dtype") != "float32" or len(shape) != 2:
                    raise RestoreError(f"image {e['image'][:12]}: unsupported embedding array")
                buf = read(a["blob"])
                if ctypes.sizeof(buf) != 4 * shape[0] * shape[1]:
                    raise RestoreError(f"image {e['image'][:12]}: embedding size mismatch")
                arr = np.frombuffer(buf, dtype=np.float32).reshape(shape).copy()
                arr.setflags(write=False)
                arrays.append(arr)
            plan.embeddings.append((str(e["image"]), arrays))
        for s in body.get("sessions", []):
            state = _unjson(s, read)
            # checked on a scratch session: the store changes only once all is read
            check_session_state(sessions, str(s["name"]), state)
            plan.sessions.append((str(s["name"]), state))
    except RestoreError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RestoreError(f"malformed manifest in {root}: {type(e).__name__}: {e}") from e
    plan.nbytes = read.nbytes
    return plan


def restore(engine: Engine, path: str | os.PathLike | None = None,
            sessions: SessionStore | None = None) -> RestoreReport:
    """Replace ``engine``'s slots and caches with the save at ``path``.

    The saved sessions' messages go back into ``sessions`` (default: the kernel's store).
    Everything is checked before the engine is touched; on any mismatch or corruption
    :class:`RestoreError` says what, and the engine and sessions are unchanged.
    """
    _require_local(engine, "restore")
    store = kernel_sessions(sessions)
    t0 = time.perf_counter()
    root = Path(path).expanduser() if path is not None else default_path()
    with _locked(root, exclusive=False) if root.is_dir() else contextlib.nullcontext():
        root, body = read_manifest(root)
        diffs = compare(engine, body)
        if diffs:
            raise RestoreError(f"the save at {root} does not fit this engine: "
                               + "; ".join(diffs))
        plan = _load(engine, root, body, store)
    if _uses_media(body) and engine.projector is None:
        raise RestoreError("the save holds images: load the engine with its vision projector")
    where = _placement(plan.slots, engine.n_slots)
    engine.import_state(list(zip(where, plan.slots)), plan.spc)
    if engine.parking is not None:
        engine.parking.import_(sorted(plan.parked, key=lambda e: e.last_used))
    placed = sorted((SlotSave(i, st.session, len(st.kv.tokens), st.kv.nbytes)
                     for i, st in zip(where, plan.slots)), key=lambda p: p.index)
    proj = engine.projector
    if proj is not None:
        from .embeddings import ImageEmbedding

        for h, arrays in plan.embeddings:
            proj.cache.put(proj.cache_key(h), ImageEmbedding(h, proj.identity, tuple(arrays)))
    for name, state in plan.sessions:
        store.get(name).load_state(state)  # turns with their cells and states
    rep = RestoreReport(root, tuple(placed), tuple(plan.dropped), len(plan.spc),
                        len(plan.embeddings), tuple(n for n, _ in plan.sessions), plan.nbytes,
                        time.perf_counter() - t0, float(body.get("created", 0.0)))
    engine.last_restore = rep
    engine.events.publish(SlotsChanged("restored"))
    log.info("%s", rep)
    return rep


def _placement(slots: list[SlotState], n: int) -> list[int]:
    """The engine slot of each saved slot: its old index when free, else the first free."""
    out: list[int | None] = [None] * len(slots)
    used: set[int] = set()
    for j, rec in enumerate(slots):
        if rec.index < n and rec.index not in used:
            out[j] = rec.index
            used.add(rec.index)
    free = iter(i for i in range(n) if i not in used)
    return [o if o is not None else next(free) for o in out]


# -- autosave --------------------------------------------------------------------------------


class Autosaver:
    """Saves an engine in the background after requests, at most every ``interval`` seconds.

    A save starts only when the engine is idle (nothing queued, running or being rewritten)
    and a few seconds after the last request, and gives way if a request arrives before its
    states are copied: a reply is never held up by it.
    """

    def __init__(self, engine: Engine, path: str | os.PathLike | None = None,
                 sessions: SessionStore | None = None, interval: float = 30.0,
                 quiet: float = 2.0) -> None:
        self.engine = engine
        self.path = path
        self.sessions = sessions
        self.interval = interval
        self.quiet = quiet
        self.saves = 0
        self.last_error: str | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._last_event = 0.0
        self._last_save = 0.0
        self._unsubscribe = engine.subscribe(self._on_event)
        self._thread = threading.Thread(target=self._run, name="nbkv-autosave", daemon=True)
        self._thread.start()

    def _on_event(self, event: Any) -> None:
        if isinstance(event, RequestFinished):
            self._last_event = time.monotonic()
            self._dirty.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._dirty.wait(0.5):
                continue
            now = time.monotonic()
            wait = max(self._last_event + self.quiet, self._last_save + self.interval) - now
            if wait > 0:
                self._stop.wait(min(wait, 1.0))
                continue
            self._dirty.clear()
            try:
                save(self.engine, self.path, self.sessions, only_if_idle=True)
                self.saves += 1
                self._last_save = time.monotonic()
            except EngineBusy:
                self._dirty.set()
                self._last_event = time.monotonic()  # try again once it is quiet
            except NbkvError as e:
                self.last_error = str(e)
                self._last_save = time.monotonic()
                log.warning("autosave failed: %s", e)
                if "closed" in str(e):
                    return
            except Exception as e:  # noqa: BLE001 - a background thread must not die loudly
                self.last_error = f"{type(e).__name__}: {e}"
                self._last_save = time.monotonic()
                log.exception("autosave failed")

    def stop(self) -> None:
        """Stop autosaving (a save in progress finishes)."""
        self._stop.set()
        self._unsubscribe()
        self._thread.join(timeout=30)
