"""Slots that survive a kernel restart: save and restore an engine's caches on disk.

A save is a directory::

    manifest.json          what was saved, for which model and settings, and a checksum
                           of every blob (the manifest carries its own checksum too)
    blobs/<sha256>.bin     raw bytes, named by their SHA-256: sequence states,
                           checkpoints, system-prompt states, image embeddings, pictures

Nothing is pickled, and blob names are checked against ``[0-9a-f]{64}.bin`` before any path
is built from them, so a save from someone else can neither run code nor make nbkv read
outside its directory. A save is atomic: blobs are written to temporary files, fsynced and
renamed; then the manifest the same way; only then are blobs no manifest names deleted.

The manifest is signed with an HMAC under the user's key (:mod:`nbkv.core.signing`): a
save signed by another key or by none is refused with :class:`UntrustedSaveError`, or,
with ``trust=True``, restored with every slot recomputed from its tokens before it is served.

Restore checks the manifest against the engine (model and projector fingerprints, llama.cpp
build, per-slot context, KV layout, memory class) and reads and checksums every blob
*before* touching the engine; any mismatch raises :class:`~nbkv.core.errors.RestoreError`
naming what differs, and the engine stays as it was. The states are then loaded on the
scheduler thread, each slot is verified, and on any failure the slots are put back as they
were.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from nbkv.core.errors import RestoreError, SaveError, UntrustedSaveError
from nbkv.core.events import SlotsChanged
from nbkv.core.progress import Reporter, Task, resolve
from nbkv.core.protocol import Exportable, Parks
from nbkv.kv.replies import ReplyMemo
from nbkv.kv.slot_kv import KVSnapshot
from nbkv.kv.slot_table import SlotState
from nbkv.kv.spc import SavedPrompt
from nbkv.media.units import MediaUnit
from nbkv.store.blobstore import (
    BLOBS,
    Blobs,
    Reader,
    decode_units,
    encode_units,
    fsync_dir,
    manifest_text,
    stale_by_age,
    sweep,
    write_blobs,
    write_file,
)
from nbkv.store.park_adopt import locked
from nbkv.store.parked import ParkedEntry, entry_from_json, entry_json
from nbkv.store.save_checks import (  # noqa: F401 - re-exported: the save format's checks
    FORMAT,
    MANIFEST,
    VERSION,
    compare,
    compatible,
    default_path,
    offer,
    open_manifest,
    read_manifest,
    restream,
    save_root,
    seen,
    stream_count,
    untrusted_message,
    uses_media,
    warn_if_overwritten,
)
from nbkv.store.session_state import (
    check_session_state,
    kernel_sessions,
    session_from_json,
    session_json,
)

log = logging.getLogger("nbkv")
SHOWN = 64 << 20  # a save or restore of this many bytes shows its progress (~1 s of disk)


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
    parked: tuple[str, ...] = ()  # the save's conversations now parked (``engine.parked()``)
    #: the save's conversations the parking lot could not hold: "name (why)"
    not_parked: tuple[str, ...] = ()
    untrusted: str | None = None  # why the save is not trusted (restored with trust=True)
    recomputed: tuple[Any, ...] = ()  # untrusted: each slot's Recomputation
    left_out: tuple[str, ...] = ()  # untrusted: what was not restored from it
    trust_note: str = ""  # untrusted: how its KV was made safe, when not by recomputing

    def __str__(self) -> str:
        per = ", ".join(f"slot {s.index} ({s.session or '-'}): {s.tokens} tokens"
                        for s in self.slots) or "no slot"
        drop = (f"; not enough slots, dropped the least recently used: "
                f"{', '.join(self.dropped)}" if self.dropped else "")
        drop += (f"; parked: {', '.join(self.parked)}" if self.parked else "")
        drop += (f"; not kept: {', '.join(self.not_parked)}" if self.not_parked else "")
        if self.untrusted is not None:
            drop += (f". An untrusted save ({self.untrusted}), restored because you trust it: "
                     + (self.trust_note or "every slot was recomputed by a full prefill "
                        "before it could be served: "
                        + ("; ".join(map(str, self.recomputed)) or "no slot")))
            drop += (f"; not restored from it (rebuilt when next used): "
                     f"{', '.join(self.left_out)}" if self.left_out else "")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.saved_at))
        return (f"restored the save of {when} from {self.path} in {self.seconds:.2f} s: "
                f"{per}; {self.spc_entries} system prompt(s), {self.embeddings} image "
                f"embedding(s), sessions: {', '.join(self.sessions) or 'none'}{drop}")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- what describes an engine ----------------------------------------------------------------


def unsupported(engine: Any, what: str) -> SaveError | RestoreError:
    """The error of a ``what`` (``"save"`` or ``"restore"``) ``engine`` cannot do."""
    err = SaveError if what == "save" else RestoreError
    return err(f"{what} is not supported for {type(engine).__name__}: an in-kernel "
               "nbkv.Engine or a llama-server engine can save and restore its slots; an "
               "OpenAI-compatible server keeps its cache to itself")


def _require_local(engine: Any, what: str) -> None:
    """Only an engine with the state API (:meth:`nbkv.Engine.export_state`) saves here."""
    if not isinstance(engine, Exportable):
        raise unsupported(engine, what)


# -- save ------------------------------------------------------------------------------------


def save(engine: Any, path: str | os.PathLike | None = None,
         sessions: Any = None, *, only_if_idle: bool = False,
         progress: Reporter | bool | None = None) -> SaveReport:
    """Save ``engine``'s slots and caches, and the messages of ``sessions``, to ``path``.

    Saved: each idle slot's state (and checkpoints), the system-prompt cache, the image
    embeddings the slots use, and the message histories of ``sessions`` (default: the
    kernel's store). Raises :class:`SaveError` when the directory cannot be written; the
    previous save there is then untouched. A save of :data:`SHOWN` bytes or more shows its
    progress (``progress``: :func:`nbkv.core.progress.resolve`).
    """
    _require_local(engine, "save")
    store = kernel_sessions(sessions)
    root = save_root(path)
    t0 = time.perf_counter()
    _make_save_dir(root)
    cap = engine.export_state(only_if_idle)
    blobs = Blobs()
    slots_json, reports = _slots_json(cap, blobs)
    parked_json = engine.parking.export(blobs) if engine.parking is not None else []
    spc_json = [{"key": key, "tokens": encode_units(entry.tokens), "state": blobs.add(entry.state)}
                for key, entry in cap.spc]
    media = {u["image"] for e in (*slots_json, *parked_json, *spc_json)  # the images held
             for u in e["tokens"] if isinstance(u, dict)}
    emb_json = _embeddings_json(engine.projector, media, blobs)
    sess_json = [session_json(s.state_dict(), blobs, f"session {s.name}") for s in store]
    # the replies the saved KV holds: a cell run again after a restore is replayed
    parked = engine.parked() if isinstance(engine, Parks) else ()
    replies = engine.export_replies([s.kv.tokens for s in cap.slots]
                                    + [p.tokens for p in parked])
    created = time.time()
    body = {
        "format": FORMAT, "version": VERSION, "created": created,
        "engine": engine.identity(),
        "n_slots": engine.n_slots, "cache": engine.cache, "exact": engine.exact,
        "template": hashlib.sha256(engine.template.source.encode()).hexdigest(),
        "slots": slots_json, "spc": spc_json, "embeddings": emb_json, "sessions": sess_json,
        "parked": parked_json, "replies": replies,
        "blobs": blobs.table(),
    }
    total = sum(len(mv) for mv in blobs.data.values())
    with _locked(root, exclusive=True) as held, \
            _bytes_task(progress, total, f"saving to {root}") as done:
        written = _write(root, body, blobs, held, done)
    rep = SaveReport(root, tuple(reports), tuple(cap.busy), len(spc_json), len(emb_json),
                     tuple(s["name"] for s in sess_json),
                     sum(len(mv) for mv in blobs.data.values()), written,
                     time.perf_counter() - t0, created)
    engine.last_save = rep
    log.info("%s", rep)
    return rep


def _make_save_dir(root: Path) -> None:
    """Create ``root`` and its blob directory; :class:`SaveError` if they cannot be written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / BLOBS).mkdir(exist_ok=True)
    except OSError as e:
        raise SaveError(f"cannot create the save directory {root}: {e}") from e
    if not os.access(root, os.W_OK) or not os.access(root / BLOBS, os.W_OK):
        raise SaveError(f"the save directory {root} is not writable")


def _slots_json(cap: Any, blobs: Blobs) -> tuple[list[dict], list[SlotSave]]:
    """The captured slots' manifest entries and reports."""
    slots_json, reports = [], []
    for s in cap.slots:
        kv = s.kv
        conv = ParkedEntry.from_snapshot(kv, session=s.session, hashes=s.hashes,
                                         msg_ends=s.msg_ends, segments=s.segments,
                                         last_used=s.last_used, used_at=s.used_at)
        slots_json.append({"index": s.index, **entry_json(conv, blobs)})
        reports.append(SlotSave(s.index, s.session, len(kv.tokens), kv.nbytes))
    return slots_json, reports


def _embeddings_json(proj: Any, media: set[str], blobs: Blobs) -> list[dict]:
    """The image embeddings still in the projector's cache for the images in ``media``."""
    emb_json: list[dict] = []
    if proj is None:
        return emb_json
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
    return emb_json


def _locked(root: Path, exclusive: bool) -> contextlib.AbstractContextManager[bool]:
    """Hold ``root``'s lock file: one writer, or readers, at a time (across processes too).

    Without it, a save's clean-up could delete blobs that another save's new manifest (or a
    restore reading the old one) still needs. Yields whether the lock is held (a read-only
    save is restored without it).
    """
    return locked(root / ".lock", os.O_RDWR | os.O_CREAT, blocking=True, shared=not exclusive)


@contextlib.contextmanager
def _bytes_task(progress: Reporter | bool | None, total: int, what: str
                ) -> Iterator[Callable[[int], None] | None]:
    """A per-blob callback that moves a MiB bar, for work of :data:`SHOWN` bytes or more."""
    if total < SHOWN or progress is False:
        yield None
        return
    with Task(resolve(progress), what, total=total / 2**20, unit="MiB") as task:
        yield lambda n: task.advance(n / 2**20)


def _write(root: Path, body: dict[str, Any], blobs: Blobs, locked: bool = False,
           on_blob: Callable[[int], None] | None = None) -> int:
    warn_if_overwritten(root)  # (under the lock, when there is one)
    try:
        written = write_blobs(root, blobs, on_blob)
        written += write_file(root / MANIFEST, [manifest_text(body).encode()])
        fsync_dir(root)
        seen(root)
    except OSError as e:
        raise SaveError(f"could not write the save to {root}: {e} (the previous save there, "
                        "if any, is intact)") from e
    # only now may blobs the new manifest does not name go: no manifest names them any more;
    # every writer holds the lock, so under it a temporary file is a killed save's
    stale = (lambda f: True) if locked else _dead_writer
    sweep(root, set(blobs.data), stale_tmp=stale)
    for f in root.glob(f".{MANIFEST}.*.tmp"):
        if stale(f):
            f.unlink(missing_ok=True)
    return written


def _dead_writer(f: Path) -> bool:
    """A temporary file (``.NAME.PID.THREAD.tmp``) whose writing process has ended, or old."""
    parts = f.name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return stale_by_age(f)
    if pid == os.getpid():
        return False  # a thread of this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return stale_by_age(f)


# -- restore ---------------------------------------------------------------------------------


@dataclass
class _Plan:
    slots: list[SlotState] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    spc: list[tuple[str, SavedPrompt]] = field(default_factory=list)
    embeddings: list[tuple[str, list[np.ndarray]]] = field(default_factory=list)
    sessions: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # state_dict()s
    parked: list[ParkedEntry] = field(default_factory=list)  # for the engine's parking lot
    replies: list[ReplyMemo] = field(default_factory=list)  # replies the saved KV holds
    not_parked: list[str] = field(default_factory=list)  # saved parked, parking off
    nbytes: int = 0


def _load(engine: Any, root: Path, body: dict[str, Any], sessions: Any,
          on_blob: Callable[[int], None] | None = None) -> _Plan:
    """Read and check every blob and record of a save; touches nothing in the engine."""
    table = body.get("blobs")
    if not isinstance(table, dict):
        raise RestoreError("the manifest has no blob table")
    plan = _Plan()
    read = Reader(root, table, on_blob)
    n_vocab = engine.model.n_vocab
    created = float(body.get("created", 0.0))
    state = _state_reader(engine, read)
    try:
        _load_slots(engine, body, read, state, created, plan)
        lot = engine.parking
        if lot is not None:
            saved_parked = lot.decode(body.get("parked", []), read, state)
            for e in saved_parked:
                if not e.used_at:
                    e.conversation = replace(e.conversation, used_at=created)
            plan.parked[:0] = saved_parked
        else:
            plan.not_parked = [f"{e.get('session') or '-'} (parking is off)"
                               for e in body.get("parked", []) if isinstance(e, dict)]
        for e in body.get("spc", []):
            plan.spc.append((str(e["key"]), SavedPrompt(
                state(e["state"]), tuple(decode_units(e["tokens"], n_vocab)))))
        plan.embeddings = [(str(e["image"]), _embedding_arrays(e, read))
                           for e in body.get("embeddings", [])]
        plan.replies = [ReplyMemo.from_json(m, n_vocab) for m in body.get("replies", [])]
        for s in body.get("sessions", []):
            session_state: dict[str, Any] = session_from_json(s, read)
            # checked on a scratch session: the store changes only once all is read
            check_session_state(sessions, str(s["name"]), session_state)
            plan.sessions.append((str(s["name"]), session_state))
    except RestoreError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RestoreError(f"malformed manifest in {root}: {type(e).__name__}: {e}") from e
    plan.nbytes = read.nbytes
    return plan


def _state_reader(engine: Any, read: Reader) -> Callable[[Any], Any]:
    """Reads a saved state blob, re-addressed to this engine's KV streams where it differs."""

    def state(name: Any) -> Any:
        buf = read(name)
        if engine.memory.kind not in ("plain", "sliding-window"):
            return buf  # no shadow sequence there; compare() refused another slot count
        streams = stream_count(bytes(buf[:16]))
        if streams == engine.kv_streams:
            return buf
        if engine.memory.kind != "plain":
            raise RestoreError(f"a state saved with {streams} KV streams, this engine has "
                               f"{engine.kv_streams} (only plain attention states are "
                               "re-addressed)")
        return restream(buf, engine.kv_streams)

    return state


def _load_slots(engine: Any, body: dict[str, Any], read: Reader,
                state: Callable[[Any], Any], created: float, plan: _Plan) -> None:
    """The saved slots into ``plan``, most recently used first.

    As many as the engine has slots; the rest parked (or dropped where parking is off).
    """
    saved = sorted(body.get("slots", []), key=lambda s: -int(s["last_used"]))
    for i, s in enumerate(saved):
        if i >= engine.n_slots and engine.parking is None:
            plan.dropped.append(s.get("session") or f"slot {s['index']}")
            continue
        try:
            conv = entry_from_json(s, read, engine.model.n_vocab, state, used_at=created)
        except RestoreError as err:
            raise RestoreError(f"slot {s.get('index')}: {err}") from err
        if len(conv.tokens) > engine.n_ctx:
            raise RestoreError(f"slot {s['index']}: {len(conv.tokens)} tokens, more than "
                               f"the context's {engine.n_ctx}")
        if i >= engine.n_slots:  # more slots saved than there are: park the rest
            plan.parked.append(conv)
            continue
        plan.slots.append(SlotState(
            int(s["index"]), replace(conv.conversation, last_request=None),
            KVSnapshot.of(conv.state, conv.tokens, conv.settled, conv.exact_len,
                          conv.checkpoints)))


def _embedding_arrays(e: dict[str, Any], read: Reader) -> list[np.ndarray]:
    """One saved image embedding's arrays, checked against their declared shapes."""
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
    return arrays


def restore(engine: Any, path: str | os.PathLike | None = None,
            sessions: Any = None, *, trust: bool = False,
            progress: Reporter | bool | None = None) -> RestoreReport:
    """Replace ``engine``'s slots and caches with the save at ``path``.

    The saved sessions' messages go back into ``sessions`` (default: the kernel's store).
    Everything is checked before the engine is touched; on any mismatch or corruption
    :class:`RestoreError` says what, and the engine and sessions are unchanged. Reading
    :data:`SHOWN` bytes or more shows its progress.

    A save not signed by this user's key (:mod:`nbkv.core.signing`) raises
    :class:`UntrustedSaveError`, unless ``trust``: then its sessions are restored, and each
    text slot is recomputed by a full prefill of its tokens before any request can use it
    (the report says whether the saved KV matched). Its other KV (system-prompt states,
    parked conversations, image embeddings, slots that hold images) is left out and
    rebuilt when next used.
    """
    _require_local(engine, "restore")
    store = kernel_sessions(sessions)
    t0 = time.perf_counter()
    root = save_root(path)
    with _locked(root, exclusive=False) if root.is_dir() else contextlib.nullcontext():
        root, body, why = open_manifest(root)
        seen(root)
        if why is not None and not trust:
            raise UntrustedSaveError(untrusted_message(root, why))
        diffs = compare(engine, body)
        if diffs:
            raise RestoreError(f"the save at {root} does not fit this engine: "
                               + "; ".join(diffs))
        table = body.get("blobs")
        total = sum(int(m.get("size", 0)) for m in table.values() if isinstance(m, dict)) \
            if isinstance(table, dict) else 0
        with _bytes_task(progress, total, f"reading and checking the save in {root}") as done:
            plan = _load(engine, root, body, store, done)
    if uses_media(body) and engine.projector is None:
        raise RestoreError("the save holds images: load the engine with its vision projector")
    left_out = _distrust(plan) if why is not None else ()
    where = _placement(plan.slots, engine.n_slots)
    recomputed = engine.import_state(list(zip(where, plan.slots)), plan.spc,
                                     recompute=why is not None)
    engine.import_replies(plan.replies)
    if engine.parking is not None:  # beside what is parked; over the budgets: announced
        engine.parking.import_(plan.parked)
        for e in plan.parked:
            if e.key not in engine.parking:
                plan.not_parked.append(f"{e.session or '-'} (over the parking budget)")
    placed = sorted((SlotSave(i, st.session, len(st.kv.tokens), st.kv.nbytes)
                     for i, st in zip(where, plan.slots)), key=lambda p: p.index)
    proj = engine.projector
    if proj is not None:
        from nbkv.media.embeddings import ImageEmbedding

        for h, arrays in plan.embeddings:
            proj.cache.put(proj.cache_key(h), ImageEmbedding(h, proj.identity, tuple(arrays)))
    for name, state in plan.sessions:
        store.get(name).load_state(state)  # turns with their cells and states
    rep = RestoreReport(root, tuple(placed), tuple(plan.dropped), len(plan.spc),
                        len(plan.embeddings), tuple(n for n, _ in plan.sessions), plan.nbytes,
                        time.perf_counter() - t0, float(body.get("created", 0.0)),
                        tuple(e.session or "-" for e in plan.parked
                              if engine.parking is not None and e.key in engine.parking),
                        tuple(plan.not_parked), why, tuple(recomputed or ()), left_out)
    engine.last_restore = rep
    engine.events.publish(SlotsChanged("restored"))
    log.info("%s", rep)
    return rep


def _distrust(plan: _Plan) -> tuple[str, ...]:
    """Leave out of ``plan`` the KV of an untrusted save that cannot be recomputed here.

    Slots with images (an image is encoded by a request), system-prompt states, parked
    conversations and image embeddings: each is rebuilt when next used. Its replies are
    not replayed either (a recomputed slot proves its KV, not that the model wrote the
    reply): a cell run again decodes its reply. Returns what went.
    """
    out = []
    keep = []
    for st in plan.slots:
        if any(isinstance(u, MediaUnit) for u in st.kv.tokens):
            out.append(f"{st.session or f'slot {st.index}'}'s slot (it holds an image)")
        else:
            keep.append(st)
    plan.slots = keep
    if plan.parked:
        out.append("parked " + ", ".join(e.session or "-" for e in plan.parked))
    if plan.spc:
        out.append(f"{len(plan.spc)} system prompt state(s)")
    if plan.embeddings:
        out.append(f"{len(plan.embeddings)} image embedding(s)")
    if plan.replies:
        out.append(f"{len(plan.replies)} repla{'y' if len(plan.replies) == 1 else 'ies'}")
    plan.parked, plan.spc, plan.embeddings, plan.replies = [], [], [], []
    return tuple(out)


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
