"""``%kvcache save`` / ``restore`` for a llama-server engine: the KV stays on the server.

Each slot's KV is written by the server itself (``POST /slots/N?action=save``, into its
``--slot-save-path``); nbkv writes what it knows beside it, in the kernel's save directory
(``remote.json``: per slot the file name, its tokens, message hashes and boundaries, the
session, and the sessions' messages). Restore checks that the server runs the same model
and build with the same slot size, asks the server to load each file
(``action=restore``), and checks that it restored exactly the saved number of tokens; a
slot that does not is erased again and the restore fails, naming it. The server may have
restarted in between: the files are on its disk.

``remote.json`` is signed like a local save (:mod:`nbkv.core.signing`): one signed by
another key or by none is refused with :class:`UntrustedSaveError` unless ``trust=True``.
Trusting one puts no forged KV in front of a request: the server matches every prompt
against the tokens it restored itself, whatever nbkv's table says.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbkv.core.errors import RestoreError, SaveError, ServerError, UntrustedSaveError
from nbkv.kv.slot_table import Conversation, SlotState
from nbkv.store.blobstore import (
    body_checksum,
    fsync_dir,
    manifest_text,
    segment_from_json,
    segment_json,
    untrusted,
    write_file,
)
from nbkv.store.persist import (
    RestoreReport,
    SaveReport,
    SlotSave,
    save_root,
    untrusted_message,
)
from nbkv.store.session_state import check_session_state, kernel_sessions

if TYPE_CHECKING:
    from nbkv.remote.llama_server import LlamaServerEngine

FORMAT = "nbkv-remote-save"
VERSION = 2  # 2: checksummed and signed ({"checksum", "signature", "body"})
MANIFEST = "remote.json"
IDENTITY = ("model_path", "build_info", "n_ctx")


def save(engine: LlamaServerEngine, path: str | os.PathLike | None = None,
         sessions: Any = None) -> SaveReport:
    """Have the server save each idle slot, and write nbkv's table next to the notebook."""
    store = kernel_sessions(sessions)
    root = save_root(path)
    t0 = time.perf_counter()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SaveError(f"cannot create the save directory {root}: {e}") from e
    if not os.access(root, os.W_OK):
        raise SaveError(f"the save directory {root} is not writable")
    tag = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    busy, todo = engine.export_slots()
    slots_json, reports, nbytes = [], [], 0
    for st in todo:
        index, session, tokens = st.index, st.session, list(st.kv)
        name = f"nbkv-{tag}-slot{index}.bin"
        try:
            out = engine.client.post(f"/slots/{index}", {"filename": name}, timeout=120.0,
                                     action="save")
        except ServerError as e:
            raise SaveError(f"the server could not save slot {index}: {e} (start it with "
                            f"--slot-save-path DIR)") from e
        if out.get("n_saved") != len(tokens):
            raise SaveError(f"the server saved {out.get('n_saved')} tokens of slot {index} "
                            f"where nbkv holds {len(tokens)}: not saved (is another client "
                            f"using it?)")
        size = int(out.get("n_written", 0))
        nbytes += size
        slots_json.append({"index": index, "session": session, "file": name,
                           "tokens": tokens, "settled": engine.settled_of(index),
                           "hashes": list(st.hashes),
                           "msg_ends": list(st.msg_ends),
                           "segments": [segment_json(g) for g in st.segments]})
        reports.append(SlotSave(index, session, len(tokens), size))
    try:
        sess_json = [json.loads(json.dumps(s.state_dict())) for s in store]
    except (TypeError, ValueError) as e:
        raise SaveError(f"a session holds something JSON cannot store (an image?): {e}"
                        ) from e
    created = time.time()
    body = {"format": FORMAT, "version": VERSION, "created": created, "url": engine.url,
            "server": {k: getattr(engine, k) for k in IDENTITY}, "slots": slots_json,
            "sessions": sess_json}
    data = manifest_text(body).encode()
    try:
        written = write_file(root / MANIFEST, [data])
        fsync_dir(root)
    except OSError as e:
        raise SaveError(f"cannot write {root / MANIFEST}: {e}") from e
    rep = SaveReport(root, tuple(reports), busy, 0, 0, tuple(s["name"] for s in sess_json),
                     nbytes, written, time.perf_counter() - t0, created)
    engine.last_save = rep
    return rep


def restore(engine: LlamaServerEngine, path: str | os.PathLike | None = None,
            sessions: Any = None, *, trust: bool = False) -> RestoreReport:
    """Load a remote save back into the server's slots and nbkv's table (checked first).

    A save not signed by this user's key raises :class:`UntrustedSaveError` unless ``trust``.
    """
    from nbkv.core.events import SlotsChanged

    store = kernel_sessions(sessions)
    root = save_root(path)
    t0 = time.perf_counter()
    body, why = _read(root)
    if why is not None and not trust:
        raise UntrustedSaveError(untrusted_message(root, why))
    now = {k: getattr(engine, k) for k in IDENTITY}
    diffs = [f"{k}: saved {body['server'].get(k)!r}, the server has {now[k]!r}"
             for k in IDENTITY if body.get("server", {}).get(k) != now[k]]
    if diffs:
        raise RestoreError("the save does not fit this server: " + "; ".join(diffs))
    for sess in body.get("sessions") or ():  # checked before any slot changes
        if not isinstance(sess, dict) or "name" not in sess:
            raise RestoreError(f"a saved session is malformed: {sess!r:.80}")
        check_session_state(store, str(sess["name"]), sess)
    saved = body.get("slots") or []
    if any(not 0 <= s["index"] < engine.n_slots for s in saved):
        raise RestoreError(f"the save uses slots up to {max(s['index'] for s in saved)}: "
                           f"connect with at least that many")
    busy = [i for i in engine.busy_slots() if i in {s["index"] for s in saved}]
    if busy:
        raise RestoreError(f"slots {busy} are serving a request; restore when they are idle")
    try:  # checked before any slot changes too
        states = [SlotState(s["index"], Conversation(
            s["session"], tuple(s["tokens"]), s["hashes"], s["msg_ends"],
            tuple(segment_from_json(g) for g in s.get("segments", ()))), tuple(s["tokens"]))
            for s in saved]
    except (KeyError, TypeError, ValueError) as e:
        raise RestoreError(f"a saved slot is malformed: {type(e).__name__}: {e}") from e
    done: list[int] = []
    placed = []
    try:
        for s in saved:
            i = s["index"]
            out = engine.client.post(f"/slots/{i}", {"filename": s["file"]}, timeout=120.0,
                                     action="restore")
            done.append(i)
            if out.get("n_restored") != len(s["tokens"]):
                raise RestoreError(f"the server restored {out.get('n_restored')} tokens into "
                                   f"slot {i}, the save holds {len(s['tokens'])}")
            placed.append(SlotSave(i, s["session"], len(s["tokens"]),
                                   int(out.get("n_read", 0))))
    except (ServerError, RestoreError) as e:
        for i in done:  # nothing half-restored stays: erase, and forget in the table
            try:
                engine.client.post(f"/slots/{i}", {}, timeout=30.0, action="erase")
            except ServerError:
                pass
            engine.forget_slot(i, f"slot {i}: a failed restore left it unknown")
        if isinstance(e, RestoreError):
            raise
        raise RestoreError(f"the server could not restore the save's slots: {e} (the files "
                           f"live in the --slot-save-path of the server that saved them)"
                           ) from e
    # a save's canonical prefix is its claim: from a save not signed by this user's key it
    # is not taken, so a trusted forgery can never make a reply claim to be exact
    engine.import_slots(states, {s["index"]: int(s.get("settled", 0)) if why is None else 0
                                 for s in saved})
    for sess in body.get("sessions") or ():
        store.get(sess["name"]).load_state(sess)  # turns with their cells and states
    rep = RestoreReport(root, tuple(placed), (), 0, 0,
                        tuple(x["name"] for x in body.get("sessions") or ()),
                        sum(p.nbytes for p in placed), time.perf_counter() - t0,
                        float(body.get("created", 0.0)), untrusted=why,
                        trust_note="the server matches each prompt against the tokens it "
                                   "restored itself, so nbkv's table cannot make it serve KV "
                                   "for other tokens; nothing restored is taken as canonical "
                                   "(replies from it are not claimed exact)")
    engine.last_restore = rep
    engine.events.publish(SlotsChanged("restored"))
    return rep


def _read(root: Path) -> tuple[dict[str, Any], str | None]:
    """The checked body of ``root``'s ``remote.json``, and why it is untrusted (or None)."""
    f = root / MANIFEST
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError:
        raise RestoreError(f"no remote-engine save at {root} ({MANIFEST} is missing)") from None
    except (OSError, ValueError) as e:
        raise RestoreError(f"{f} is unreadable or corrupt: {e}") from e
    why = None
    if isinstance(doc, dict) and isinstance(doc.get("body"), dict):
        body = doc["body"]
        if body_checksum(body) != doc.get("checksum"):
            raise RestoreError(f"{f} fails its checksum (corrupt or edited)")
        why = untrusted(doc)
    else:  # version 1: the body alone, unsigned
        body = doc
        why = "it is not signed (written by an nbkv that did not sign saves yet)"
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise RestoreError(f"{f} is not an nbkv remote-engine save")
    if not isinstance(body.get("version", 0), int) or body.get("version", 0) > VERSION:
        raise RestoreError(f"the save is format {body.get('version')}, newer than this nbkv")
    return body, why
