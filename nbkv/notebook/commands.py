"""What each ``%kvcache`` command does; :mod:`nbkv.notebook.magics` parses the line and dispatches.

Nothing here imports IPython. A command takes the :class:`Workspace` (the session store, the
``Nbkv`` settings, where output goes) and the parsed arguments, and returns something
displayable (:mod:`nbkv.ui.display`). Mistakes raise nbkv errors, which the magics show as one
line without a traceback.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbkv.core.config import EngineSettings
from nbkv.core.errors import InvalidRequestError, NbkvError
from nbkv.core.events import counted
from nbkv.core.protocol import ClearsParked, Parks, Saves, Verifiable
from nbkv.ui import display as disp
from nbkv.ui import vocabulary as vocab
from nbkv.ui.chartfig import history_chart, slots_chart
from nbkv.ui.figures import ExplainReport
from nbkv.ui.views import LoadProgress

if TYPE_CHECKING:
    from nbkv.core.protocol import EngineLike
    from nbkv.engine.facade import Engine
    from nbkv.notebook.sessions import SessionStore
    from nbkv.notebook.settings import Settings


@dataclass
class Workspace:
    """What the commands work on: the conversations and engine, the defaults, the frontend."""

    store: SessionStore
    settings: Settings
    notebook: bool  # output goes to a notebook (else a terminal)
    user_ns: dict[str, Any]  # the kernel's namespace (it may name the notebook)

    def engine(self) -> EngineLike:
        """The loaded engine, or an error that says how to load one."""
        if self.store.engine is None:
            raise InvalidRequestError(
                "no model loaded: run %kvcache load to load the embedded SmolLM2-135M "
                "(or %kvcache load PATH.gguf), or set %config Nbkv.autoload = True")
        return self.store.engine

    def save_path(self, target: str | None = None) -> Path:
        """``target``, or this notebook's own directory for saves in the user cache."""
        from nbkv.store import persist

        if target:
            return Path(target).expanduser()
        ns = self.user_ns
        notebook = (os.environ.get("JPY_SESSION_NAME") or ns.get("__vsc_ipynb_file__")
                    or ns.get("__session__") or None)
        return persist.default_path(notebook)

    def sync_autosave(self) -> None:
        """Autosave exactly while ``Nbkv.autosave`` is on and an engine is loaded."""
        s = self.settings
        self.store.autosave(self.save_path() if s.autosave else None, s.autosave_interval)


def _number(text: str | None, what: str) -> int | None:
    """``text`` as an int (``#3`` works too), None when absent."""
    if text is None:
        return None
    try:
        return int(text.lstrip("#"))
    except ValueError:
        raise InvalidRequestError(f"%kvcache {what}, not {text!r}") from None


def _file(path: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidRequestError(f"no {what} file at {path}")
    return p


def status(ws: Workspace, args: Any) -> Any:
    """The engine: model, memory, slots, cache mode, totals."""
    return disp.status_table(ws.store.engine, ws.store)


#: the flags that count something: how the user gets the default (never by writing 0)
_COUNTS = {"slots": ("--slots", "leave --slots out to size it from the memory plan"),
           "ctx": ("--ctx", "leave --ctx out to size it from the memory plan"),
           "last": ("-n", "leave -n out for the last 20")}


def _at_least_one(args: Any, *flags: str) -> None:
    """Refuse ``--slots 0``, ``-n -3`` and the like: 0 is not "the default"."""
    for flag in flags:
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            name, default = _COUNTS[flag]
            raise InvalidRequestError(f"{name} must be at least 1, not {value} ({default})")


def load(ws: Workspace, args: Any) -> Any:
    """Load the engine (the model and options given, else the settings).

    Every argument is checked first, the model file and the template included: a mistake
    leaves the current engine as it was. An engine already loaded with the same model and
    settings is kept, with its caches (``--reload`` starts afresh). Should the new engine
    still fail to load, the previous one is loaded again.
    """
    _at_least_one(args, "slots", "ctx")
    if args.trust and not args.restore:
        raise InvalidRequestError("%kvcache load: --trust goes with --restore (it trusts the "
                                  "save that --restore brings back)")
    kwargs = ws.settings.engine_kwargs(slots=args.slots, ctx=args.ctx, mode=args.mode,
                                       min_tokens=args.min_tokens, n_gpu_layers=args.gpu_layers,
                                       type_k=args.kv_type, type_v=args.kv_type,
                                       flash_attn=args.flash_attn, **_parking_options(args))
    EngineSettings.of(**kwargs)  # every setting checked before anything closes
    if args.mmproj:
        kwargs["mmproj"] = str(_file(args.mmproj, "projector"))
    if args.template:
        kwargs["template"] = _template(args.template)
    path = args.target or ws.settings.model or None
    model = _model(path)  # checked (a whole GGUF file) before the old engine is closed
    if not args.reload and ws.store.loaded(model, kwargs):
        return _kept(ws, args)
    carried = [s.name for s in ws.store if s.records]  # their next turn: "engine reloaded"
    previous = ws.store.load_args
    ws.store.close_engine()  # first, so that the free memory counts what it held
    progress = LoadProgress(f"loading {Path(path).name if path else 'default model'}",
                            ws.notebook)
    with warnings.catch_warnings(record=True) as said:  # shown under the summary instead
        warnings.simplefilter("always")
        try:
            engine = ws.store.load(path, progress=progress, **kwargs)
        except Exception as e:
            _revive(ws, previous, carried, e)
            raise
    engine.carry_over(carried)
    ws.sync_autosave()
    summary = disp.status_table(engine, ws.store)
    notes = [engine.sized or None, *(str(w.message) for w in said),
             _offer_restore(ws, engine, args.restore, args.trust)]
    progress.done(summary, note="\n".join(n for n in notes if n) or None)
    return None if ws.notebook else summary


def _kept(ws: Workspace, args: Any) -> Any:
    """``%kvcache load`` again with the same model and settings: keep the engine, say so."""
    engine = ws.engine()
    ws.sync_autosave()
    kept = sum(1 for s in engine.slots() if s.tokens)
    parked = len(engine.parked()) if isinstance(engine, Parks) else 0
    what = f"{counted(kept, 'slot')} in use" + (f", {parked} parked" if parked else "")
    line = (f"kept the loaded engine: same model and settings, so its caches stay ({what}); "
            "%kvcache load --reload starts afresh")
    if args.restore:
        from nbkv.engine.facade import Engine

        # ``loaded`` matched the in-kernel engine's model and settings: it is one
        assert isinstance(engine, Engine)
        line += "\n" + (_offer_restore(ws, engine, True, args.trust) or "")
    return disp.Message(line)


def _revive(ws: Workspace, previous: Any, carried: list[str], error: BaseException) -> None:
    """The new engine failed after the old one was closed: load the old one again.

    Its caches are gone (they lived in the closed context); its sessions' next turns say
    "engine reloaded". The error is then raised, with a note on what was done.
    """
    if previous is None:
        return
    try:
        engine = ws.store.load(previous[0], **dict(previous[1]))
    except Exception:  # noqa: BLE001 - the first error is the one to report
        return
    engine.carry_over(carried)
    ws.sync_autosave()
    note = ("; the previous engine was loaded again (its caches start empty: its sessions "
            "read their conversations again)")
    error.args = (f"{error.args[0] if error.args else error}{note}", *error.args[1:])


def _model(path: str | None) -> str:
    """The model file to load, checked (whole GGUF); the default model when ``path`` is None."""
    from nbkv.llama.backend import check_gguf
    from nbkv.llama.models import resolve_model_path

    if path is not None:
        _file(path, "model")
    return str(check_gguf(resolve_model_path(path)).resolve())


def _template(path: str) -> str:
    """A ``--template`` file's text, compiled and tried on one message before any load."""
    from nbkv.prompt.templates import ChatTemplate

    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise InvalidRequestError(f"--template: cannot read {path}: {e}") from e
    try:
        ChatTemplate(text).render([{"role": "user", "content": "Hello."}])
    except NbkvError as e:
        raise InvalidRequestError(f"--template {path}: {e}") from e
    return text


def _existing(p: Path) -> Path:
    """``p``, or its nearest ancestor that exists."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def connect(ws: Workspace, args: Any) -> Any:
    """Drive a serving engine instead of the in-kernel one (``%kvcache connect URL``)."""
    if not args.target:
        raise InvalidRequestError("%kvcache connect: give the server's URL, e.g. "
                                  "%kvcache connect http://127.0.0.1:8080 (python -m "
                                  "nbkv.remote.server starts one)")
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise InvalidRequestError(f"--api-key-env: ${args.api_key_env} is not set")
    _at_least_one(args, "slots")
    carried = [s.name for s in ws.store if s.records]
    engine = ws.store.connect(args.target, slots=args.slots, api_key=key,
                              min_tokens=ws.settings.min_tokens)
    engine.carry_over(carried)
    ws.sync_autosave()
    return disp.status_table(engine, ws.store)


def _offer_restore(ws: Workspace, engine: Engine, restore: bool, trust: bool = False
                   ) -> str | None:
    """After a load: restore the notebook's save (``--restore``), or say that one fits."""
    from nbkv.store import persist

    if not restore:
        return persist.offer(engine, ws.save_path())
    try:
        return str(engine.restore(str(ws.save_path()), ws.store, trust=trust))
    except NbkvError as e:
        return f"--restore: nothing restored: {e}"


def slots(ws: Workspace, args: Any) -> Any:
    """One row per slot, with its KV strip; then the KV map as a chart."""
    engine = ws.engine()
    return slots_chart(disp.slots_table(engine), engine)


def stats(ws: Workspace, args: Any) -> Any:
    """Cache statistics over the history."""
    return disp.stats_table(ws.engine())


def history(ws: Workspace, args: Any) -> Any:
    """The last requests, one row each, with the notebook cell that sent each."""
    _at_least_one(args, "last")
    last = 20 if args.last is None else args.last
    history = ws.engine().history
    return history_chart(disp.history_table(history, last, cell_of=ws.store.cell_of),
                         history, last, ws.store.cell_of)


def explain(ws: Workspace, args: Any) -> Any:
    """Why request N (default: the latest) reused what it did, both renderings shown."""
    request = _number(args.target, "explain: give a request number")
    return ExplainReport(ws.engine().explain(request))


def verify(ws: Workspace, args: Any) -> Any:
    """Recompute the slots (or request N's slot) from scratch: is the cached KV exact."""
    engine = ws.engine()
    if not isinstance(engine, Verifiable):
        raise InvalidRequestError("%kvcache verify needs the in-kernel engine: a server's "
                                  "KV cannot be read back")
    request = _number(args.target, "verify: give a request number")
    results = engine.verify(request=request)
    if not results:
        return disp.Message("nothing to verify: every slot is empty")
    return disp.Table("verify: cached KV against a from-scratch decode", ("", ""),
                      tuple((f"slot {v.slot}", v.finding()) for v in results),
                      note=engine.model.exactness)


def clear(ws: Workspace, args: Any) -> Any:
    """Empty one slot, or (``--all``) every slot and the system prompt cache.

    ``--parked`` forgets the parked conversations too (alone: only them); without it they
    stay parked, and the message says so.
    """
    engine = ws.engine()
    parked = bool(getattr(args, "parked", False))
    if args.target is not None and args.all:
        raise InvalidRequestError("%kvcache clear: give a slot or --all, not both")
    if args.target is None and not args.all and not parked:  # too much to lose to a bare one
        raise InvalidRequestError("%kvcache clear: name a slot (%kvcache clear 0) or clear "
                                  "every slot with %kvcache clear --all (the parked "
                                  "conversations: %kvcache clear --parked)")
    if parked and not isinstance(engine, Parks):
        raise InvalidRequestError("%kvcache clear --parked needs the in-kernel engine")
    if parked and args.target is None and not args.all:
        assert isinstance(engine, Parks)
        return disp.Message(engine.clear_parked())
    slot = _number(args.target, "clear: slot must be a number")
    if not parked:
        said = engine.clear(slot)
    elif isinstance(engine, ClearsParked):
        said = engine.clear(slot, parked=True)
    else:
        raise InvalidRequestError("%kvcache clear --parked with a slot or --all needs the "
                                  "in-kernel engine")
    what = f"slot {slot}" if slot is not None else "every slot"
    return disp.Message((said or f"cleared {what}") + " (sessions keep their messages)")


def parked(ws: Workspace, args: Any) -> Any:
    """The parked conversations (tier, tokens, bytes), and the latest ones dropped and why."""
    engine = ws.engine()
    lot = getattr(engine, "parking", None)
    if lot is None or not isinstance(engine, Parks):
        return disp.Message("parking is off for this engine (nothing is parked)")
    rows = tuple((vocab.parked_name(i), vocab.tier_words(i.tier), f"{i.n_tokens:,}",
                  f"{i.nbytes / 2**20:.1f} MiB") for i in engine.parked())
    st = lot.stats()
    notes = [f"{len(rows)} parked; RAM {st['ram_bytes'] / 2**20:.1f} of "
             f"{st['ram_budget'] / 2**20:.0f} MiB"]
    if lot.disk is not None:
        notes.append(f"disk {st['disk_bytes'] / 2**20:.1f} of {st['disk_budget'] / 2**20:.0f} "
                     f"MiB in {lot.disk.dir}")
        if st["disk_gone"]:
            notes.append(f"the disk tier is gone: {st['disk_gone']}")
    dropped = list(lot.dropped)[-10:]
    if dropped:
        notes.append("dropped: " + "; ".join(str(d) for d in reversed(dropped)))
    return disp.Table("parked conversations", ("session", "where", "tokens", "size"), rows,
                      note="; ".join(notes))


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str, flag: str) -> int:
    """``2G``, ``512MiB``, ``1.5 GB``, ``0``: a byte count (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.I)
    if m is None:
        raise InvalidRequestError(f"{flag}: {text!r} is not a size (e.g. 2G, 512M, 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parking_options(args: Any) -> dict[str, Any]:
    """``--park-ram`` and ``--park-dir`` as :meth:`Settings.engine_kwargs` arguments."""
    ram = getattr(args, "park_ram", None)
    return {"park_ram": None if ram is None else parse_bytes(ram, "--park-ram"),
            "park_dir": getattr(args, "park_dir", None)}


def _parking(ws: Workspace, args: Any, verb: str) -> Any:
    """``%kvcache park|unpark [SESSION|--all]``: call ``engine.park``/``unpark``."""
    engine = ws.engine()
    if not isinstance(engine, Parks):
        raise InvalidRequestError(f"%kvcache {verb} needs the in-kernel engine: a server "
                                  "keeps its slots to itself")
    if args.target is not None and args.all:
        raise InvalidRequestError(f"%kvcache {verb}: give a session or --all, not both")
    if args.target is None and not args.all:
        raise InvalidRequestError(f"%kvcache {verb}: name a session (%kvcache {verb} alice) "
                                  "or give --all")
    return disp.Message(str(getattr(engine, verb)(session=args.target, all=args.all)))


def park(ws: Workspace, args: Any) -> Any:
    """Take a session's conversation (or every one) out of its slot into the parking lot."""
    return _parking(ws, args, "park")


def unpark(ws: Workspace, args: Any) -> Any:
    """Bring a parked conversation (or every one that fits) back into a slot."""
    return _parking(ws, args, "unpark")


def widget(ws: Workspace, args: Any) -> Any:
    """The live dashboard."""
    from nbkv.ui.widgets import CacheDashboard

    return CacheDashboard(ws.engine(), sessions=ws.store)


def report(ws: Workspace, args: Any) -> Any:
    """The cache on one self-contained page: written to FILE, else shown here."""
    from nbkv.ui.page import report as make

    page = make(ws.engine())
    if not args.target:
        return page
    target = Path(args.target).expanduser()
    where = _existing(target.parent)
    if not where.is_dir():
        raise InvalidRequestError(f"%kvcache report {args.target}: cannot write it there: "
                                  f"{where} is a file, not a directory")
    if target.is_dir():
        raise InvalidRequestError(f"%kvcache report {args.target}: a directory; give a file "
                                  "name, e.g. cache.html")
    try:
        path = page.to_html(target)
    except OSError as e:
        raise InvalidRequestError(f"%kvcache report: cannot write {args.target}: "
                                  f"{e.strerror or e}") from e
    return disp.Message(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): the dashboard, "
                        "the requests and the latest ones explained, on one page that opens "
                        "offline")


def unload(ws: Workspace, args: Any) -> Any:
    """Close the engine and free its memory."""
    if ws.store.engine is None:
        return disp.Message("no engine loaded")
    ws.store.close_engine()
    return disp.Message("engine closed and its memory freed")


def save(ws: Workspace, args: Any) -> Any:
    """Save slots, media and sessions (``%kvcache save [DIR]``)."""
    return disp.Message(str(_saves(ws).save(str(ws.save_path(args.target)), ws.store)))


def restore(ws: Workspace, args: Any) -> Any:
    """Restore a save into the loaded engine (``%kvcache restore [DIR] [--trust]``)."""
    return disp.Message(str(_saves(ws).restore(str(ws.save_path(args.target)), ws.store,
                                               trust=args.trust)))


def _saves(ws: Workspace) -> Saves:
    """The loaded engine, as one whose cache can be saved (every nbkv engine is)."""
    engine = ws.engine()
    if not isinstance(engine, Saves):
        raise InvalidRequestError(f"{type(engine).__name__} has no save or restore")
    return engine


def config(ws: Workspace, args: Any) -> Any:
    """The ``Nbkv`` settings and their current values."""
    s = ws.settings
    rows = tuple((f"Nbkv.{name}", repr(getattr(s, name)), t.help)
                 for name, t in sorted(s.traits(config=True).items()))
    return disp.Table("configuration (change with %config Nbkv.NAME = VALUE)",
                      ("trait", "value", "help"), rows)


#: command name -> (function, the options it accepts, whether it takes an argument)
COMMANDS: dict[str, tuple[Any, frozenset[str], bool]] = {
    "status": (status, frozenset(), False),
    "load": (load, frozenset({"mmproj", "slots", "ctx", "mode", "min_tokens", "template",
                              "restore", "trust", "gpu_layers", "kv_type", "flash_attn",
                              "park_ram", "park_dir", "reload"}), True),
    "connect": (connect, frozenset({"slots", "api_key_env"}), True),
    "slots": (slots, frozenset(), False),
    "stats": (stats, frozenset(), False),
    "history": (history, frozenset({"last"}), False),
    "explain": (explain, frozenset(), True),
    "verify": (verify, frozenset(), True),
    "clear": (clear, frozenset({"all", "parked"}), True),
    "parked": (parked, frozenset(), False),
    "park": (park, frozenset({"all"}), True),
    "unpark": (unpark, frozenset({"all"}), True),
    "widget": (widget, frozenset(), False),
    "report": (report, frozenset(), True),
    "unload": (unload, frozenset(), False),
    "config": (config, frozenset(), False),
    "save": (save, frozenset(), True),
    "restore": (restore, frozenset({"trust"}), True),
}
