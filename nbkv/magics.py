"""The ``%kvcache`` and ``%%chat`` magics (``%load_ext nbkv``).

Defaults are traits: ``%config Nbkv.slots = 2``, or ``c.Nbkv.slots = 2`` in
``ipython_config.py``. The engine and the conversations live in :mod:`nbkv.sessions`.
"""

from __future__ import annotations

import gc
import inspect
import keyword
import os
import re
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split
from traitlets import Bool, Enum, Float, Int, Unicode, observe, validate

from . import display as disp
from .errors import DecodeError, NbkvError
from .events import Progress, RequestStarted
from .sessions import STORE, SessionStore

COMMANDS = ("status", "load", "slots", "stats", "history", "clear", "widget", "unload", "config",
            "save", "restore")
# which options each %kvcache command accepts
_OPTIONS = {
    "load": {"mmproj", "slots", "ctx", "mode", "min_tokens", "template", "restore"},
    "clear": {"all"},
    "history": {"last"},
}


def _usage(e: Exception) -> UsageError:
    return UsageError(str(e))


def parse_argstring(magic: Any, line: str) -> Any:
    """Parse a magic's arguments, shell-style: quotes group words and are removed."""
    try:
        argv = arg_split(line, posix=True)
    except ValueError as e:
        raise UsageError(f"cannot parse the arguments: {e}") from None
    return magic.parser.parse_args(argv)


@magics_class
class Nbkv(Magics):
    """The ``%kvcache`` and ``%%chat`` magics; their defaults are configurable traits."""

    model = Unicode("", help="GGUF file %kvcache load uses by default ('' = embedded "
                             "SmolLM2-135M, or $NBKV_MODEL)").tag(config=True)
    slots = Int(4, min=1, help="Conversations kept in KV at once").tag(config=True)
    ctx = Int(4096, min=1, help="Context budget of each slot, in tokens").tag(config=True)
    mode = Enum(("imc", "spc", "off"), "imc", help="Cache mode").tag(config=True)
    min_tokens = Int(100, help="Shortest prefix worth salvaging (IMC) or system prompt worth "
                               "caching (SPC)").tag(config=True)
    overflow = Enum(("error", "slide"), "error", help="What a conversation that outgrows its "
                    "slot does: 'error', or 'slide' (drop the oldest turns)").tag(config=True)
    autoload = Bool(False, help="Load the default model on the first %%chat instead of "
                                "asking for %kvcache load").tag(config=True)
    session = Unicode("default", help="Session of a %%chat cell that names none"
                      ).tag(config=True)
    max_tokens = Int(256, min=1, help="Longest reply, in tokens").tag(config=True)
    temperature = Float(0.0, help="Sampling temperature (0 = greedy, reproducible)"
                        ).tag(config=True)
    stats = Bool(True, help="Show the cache figures under each reply").tag(config=True)
    refresh = Float(0.1, help="Seconds between redraws of a streaming reply").tag(config=True)
    frontend = Enum(("auto", "notebook", "terminal"), "auto",
                    help="How %%chat shows replies: 'auto' picks 'notebook' in a Jupyter "
                         "kernel, else 'terminal' (stdout)").tag(config=True)
    autosave = Bool(False, help="Save the slots and sessions in the background after requests "
                                "(%kvcache save's default place), never delaying a reply"
                    ).tag(config=True)
    autosave_interval = Float(30.0, min=1.0, help="Autosave: seconds between two saves at least"
                              ).tag(config=True)

    def __init__(self, shell: Any = None, store: SessionStore | None = None, **kw: Any) -> None:
        super().__init__(shell=shell, **kw)
        self.store = store if store is not None else STORE  # an empty store is falsy
        self._autosaver: Any = None

    @validate("refresh")
    def _refresh_positive(self, proposal: Any) -> float:
        if proposal["value"] < 0:
            raise ValueError("refresh must be >= 0 seconds")
        return proposal["value"]

    # ------------------------------------------------------------------ %kvcache

    @magic_arguments()
    @argument("command", nargs="?", default="status", choices=COMMANDS,
              help="what to do (default: status)")
    @argument("target", nargs="?",
              help="load: a GGUF file (default: the embedded SmolLM2-135M); clear: a slot; "
                   "save, restore: a directory (default: one per notebook in the user cache)")
    @argument("--mmproj", metavar="F",
              help="load: vision projector GGUF (lets chat cells attach images)")
    @argument("--slots", type=int, metavar="N", help="load: number of slots")
    @argument("--ctx", type=int, metavar="N", help="load: tokens per slot")
    @argument("--mode", choices=("imc", "spc", "off"), help="load: cache mode")
    @argument("--min-tokens", type=int, metavar="N", help="load: shortest salvageable prefix")
    @argument("--template", metavar="F", help="load: file with a Jinja2 chat template")
    @argument("--restore", action="store_true",
              help="load: then restore this notebook's latest compatible save")
    @argument("--all", action="store_true", help="clear: every slot")
    @argument("-n", "--last", type=int, metavar="N", help="history: records shown (20)")
    @line_magic
    def kvcache(self, line: str = "") -> Any:
        """Load, inspect and clear the in-kernel engine.

        ::

          %kvcache load [MODEL] [--mmproj F] [--slots N] [--ctx N] [--mode imc|spc|off]
                        [--min-tokens N] [--template F] [--restore]
          %kvcache [status] | slots | stats | history [-n N] | clear [SLOT | --all]
          %kvcache save [DIR] | restore [DIR]
          %kvcache widget | unload | config
        """
        args = parse_argstring(self.kvcache, line)
        given = {k for k, v in vars(args).items()
                 if k not in ("command", "target") and v not in (None, False)}
        extra = given - _OPTIONS.get(args.command, set())
        if extra:
            flags = ", ".join("--" + k.replace("_", "-") for k in sorted(extra))
            raise UsageError(f"%kvcache {args.command} does not take {flags}")
        if args.target is not None and args.command not in ("load", "clear", "save", "restore"):
            raise UsageError(f"%kvcache {args.command} takes no argument ({args.target!r})")
        return getattr(self, "_cmd_" + args.command)(args)

    def _cmd_status(self, args: Any) -> Any:
        return disp.status_table(self.store.engine, self.store)

    def _cmd_load(self, args: Any) -> Any:
        from .engine import Engine

        kwargs: dict[str, Any] = dict(
            n_slots=args.slots or self.slots, n_ctx=args.ctx or self.ctx,
            cache=args.mode or self.mode,
            cache_min_tokens=self.min_tokens if args.min_tokens is None else args.min_tokens,
            overflow=self.overflow,
        )
        if args.mmproj:
            if "mmproj" not in inspect.signature(Engine).parameters:
                raise UsageError("--mmproj: vision support is not available in this nbkv")
            if not Path(args.mmproj).expanduser().is_file():
                raise UsageError(f"--mmproj: no projector file at {args.mmproj}")
            kwargs["mmproj"] = str(Path(args.mmproj).expanduser())
        if args.template:
            try:
                kwargs["template"] = Path(args.template).expanduser().read_text()
            except OSError as e:
                raise UsageError(f"--template: cannot read {args.template}: {e}") from e
        path = args.target or self.model or None
        if path and not Path(path).expanduser().is_file():  # check before closing the old one
            raise UsageError(f"no model file at {path}")
        self._close_engine()
        progress = disp.LoadProgress(f"loading {Path(path).name if path else 'default model'}",
                                     self._notebook())
        try:
            engine = Engine(path, on_load_progress=progress, **kwargs)
        except NbkvError as e:
            raise _usage(e) from e
        self.store.engine = engine
        self._sync_autosave()
        summary = disp.status_table(engine, self.store)
        progress.done(summary)
        note = self._offer_restore(engine, args.restore)
        if note is not None:
            from IPython.display import display

            display(note)
        return None if self._notebook() else summary

    def _cmd_slots(self, args: Any) -> Any:
        return disp.slots_table(self._engine())

    def _cmd_stats(self, args: Any) -> Any:
        return disp.stats_table(self._engine())

    def _cmd_history(self, args: Any) -> Any:
        return disp.history_table(self._engine().history, 20 if args.last is None else args.last)

    def _cmd_clear(self, args: Any) -> Any:
        engine = self._engine()
        if args.target is not None and args.all:
            raise UsageError("%kvcache clear: give a slot or --all, not both")
        slot = None
        if args.target is not None:
            try:
                slot = int(args.target)
            except ValueError:
                raise UsageError(f"%kvcache clear: slot must be a number, not "
                                 f"{args.target!r}") from None
        try:
            engine.clear(slot)
        except NbkvError as e:
            raise _usage(e) from e
        return disp.Message(f"cleared slot {slot}" if slot is not None else
                            "cleared every slot (sessions keep their messages)")

    def _cmd_widget(self, args: Any) -> Any:
        from .widgets import CacheDashboard

        return CacheDashboard(self._engine())

    def _cmd_unload(self, args: Any) -> Any:
        if self.store.engine is None:
            return disp.Message("no engine loaded")
        self._close_engine()
        return disp.Message("engine closed and its memory freed")

    def _cmd_save(self, args: Any) -> Any:
        from . import persist

        try:
            report = persist.save(self._engine(), self._save_path(args.target), self.store)
        except NbkvError as e:
            raise _usage(e) from e
        return disp.Message(str(report))

    def _cmd_restore(self, args: Any) -> Any:
        from . import persist

        try:
            report = persist.restore(self._engine(), self._save_path(args.target), self.store)
        except NbkvError as e:
            raise _usage(e) from e
        return disp.Message(str(report))

    def _offer_restore(self, engine: Any, restore: bool) -> disp.Message | None:
        """After a load: restore the notebook's save (--restore), or say that one fits."""
        from . import persist

        path = self._save_path(None)
        if restore:
            try:
                return disp.Message(str(persist.restore(engine, path, self.store)))
            except NbkvError as e:
                return disp.Message(f"--restore: nothing restored: {e}")
        offer = persist.offer(engine, path)
        return disp.Message(offer) if offer else None

    def _save_path(self, target: str | None) -> Any:
        from . import persist

        if target:
            return Path(target).expanduser()
        ns = self.shell.user_ns if self.shell is not None else {}
        notebook = (os.environ.get("JPY_SESSION_NAME") or ns.get("__vsc_ipynb_file__")
                    or ns.get("__session__") or None)
        return persist.default_path(notebook)

    @observe("autosave", "autosave_interval")
    def _autosave_changed(self, change: Any) -> None:
        self._sync_autosave()

    def _sync_autosave(self) -> None:
        """Run the background autosaver exactly when Nbkv.autosave is on and an engine is."""
        from . import persist

        saver, engine = self._autosaver, self.store.engine
        if saver is not None and (not self.autosave or saver.engine is not engine
                                  or saver.interval != self.autosave_interval):
            saver.stop()
            self._autosaver = saver = None
        if saver is None and self.autosave and engine is not None \
                and hasattr(engine, "_slots"):  # an in-kernel engine
            self._autosaver = persist.Autosaver(engine, self._save_path(None), self.store,
                                                interval=self.autosave_interval)

    def _cmd_config(self, args: Any) -> Any:
        rows = tuple((f"Nbkv.{name}", repr(getattr(self, name)), t.help)
                     for name, t in sorted(self.traits(config=True).items()))
        return disp.Table("configuration (change with %config Nbkv.NAME = VALUE)",
                          ("trait", "value", "help"), rows)

    # ------------------------------------------------------------------ %%chat

    @magic_arguments()
    @argument("session", nargs="?", help="conversation name (default: Nbkv.session)")
    @argument("--system", metavar="TEXT", help="set the session's system prompt")
    @argument("--new", action="store_true", help="start the session over")
    @argument("--max-tokens", type=int, metavar="N", help="longest reply (Nbkv.max_tokens)")
    @argument("--temp", type=float, metavar="T", help="temperature (Nbkv.temperature)")
    @argument("--seed", type=int, metavar="S", help="sampling seed")
    @argument("--image", action="extend", nargs="+", metavar="PATH",
              help="attach image files (load the engine with --mmproj)")
    @argument("--out", metavar="VAR", help="store the reply (a str with .record) in VAR")
    @argument("--stats", dest="stats", action="store_const", const=True, default=None,
              help="show the cache figures (Nbkv.stats)")
    @argument("--no-stats", dest="stats", action="store_const", const=False,
              help="hide the cache figures")
    @cell_magic
    def chat(self, line: str, cell: str) -> None:
        """Send the cell as the next user message of a session and stream the reply.

        ``{name}`` in the cell inserts the kernel variable ``name`` (``{{`` and ``}}`` for
        literal braces). The conversation stays in the kernel: ``nbkv.session(NAME)``.
        """
        args = parse_argstring(self.chat, line)
        if args.out is not None and not (args.out.isidentifier()
                                         and not keyword.iskeyword(args.out)):
            raise UsageError(f"--out: {args.out!r} is not a valid variable name")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise UsageError("--max-tokens must be >= 1")
        text = self._interpolate(cell.strip())
        if not text:
            raise UsageError("the cell is empty: write the message under %%chat")
        content: Any = _with_images(text, args.image or [])
        engine = self._engine(autoload=self.autoload)
        session = self.store.get(args.session or self.session)
        if args.new:
            session.reset(args.system)
        elif args.system is not None:
            session.system = args.system
        sampling: dict[str, Any] = dict(
            max_tokens=args.max_tokens or self.max_tokens,
            temperature=self.temperature if args.temp is None else args.temp,
        )
        if args.seed is not None:
            sampling["seed"] = args.seed
        view = (disp.NotebookChatView(self.refresh) if self._notebook()
                else disp.TerminalChatView(refresh=self.refresh))
        relay = _ProgressRelay(session.name, view)
        unsubscribe = engine.subscribe(relay)
        interrupted, turn = False, None
        try:
            turn = session.start(engine, content, **sampling)
            relay.request = turn.stream.request_id  # events before this: matched by session
            with turn:
                for _ in turn:
                    view.delta(turn.text)
        except KeyboardInterrupt:
            interrupted = True
        except NbkvError as e:
            if isinstance(e, DecodeError):
                raise
            raise _usage(e) from e
        finally:
            unsubscribe()
        if turn is None:  # interrupted before the request was submitted
            raise KeyboardInterrupt
        reply = turn.reply
        show = self.stats if args.stats is None else args.stats
        note = "interrupted" if interrupted else (
            "stopped at --max-tokens" if reply.finish_reason == "length" else "")
        view.finish(reply.text, disp.Figures(reply.record) if show and reply.record else None,
                    note)
        if args.out:
            self.shell.user_ns[args.out] = reply
        if interrupted:  # re-raised so that a "run all" stops here, as Jupyter users expect
            raise KeyboardInterrupt("generation stopped; the partial reply is kept")

    # ------------------------------------------------------------------ helpers

    def _notebook(self) -> bool:
        if self.frontend != "auto":
            return self.frontend == "notebook"
        return getattr(self.shell, "kernel", None) is not None

    def _engine(self, autoload: bool = False) -> Any:
        if self.store.engine is None:
            if not autoload:
                raise UsageError(
                    "no model loaded: run %kvcache load to load the embedded SmolLM2-135M "
                    "(or %kvcache load PATH.gguf), or set %config Nbkv.autoload = True"
                )
            self._cmd_load(parse_argstring(self.kvcache, "load"))
        return self.store.engine

    def _close_engine(self) -> None:
        if self._autosaver is not None:
            self._autosaver.stop()
            self._autosaver = None
        engine, self.store.engine = self.store.engine, None
        if engine is not None:
            engine.close()
            del engine
            gc.collect()

    def _interpolate(self, text: str) -> str:
        ns: Mapping[str, Any] = self.shell.user_ns if self.shell is not None else {}
        try:
            return string.Formatter().vformat(text, (), ns)
        except KeyError as e:
            raise UsageError(
                f"{{{e.args[0]}}} in the cell: no variable {e.args[0]!r} in the kernel "
                "(write {{ and }} for literal braces)") from None
        except (AttributeError, IndexError, ValueError, TypeError) as e:
            raise UsageError(f"cannot fill in the {{...}} fields of the cell: {e} "
                             "(write {{ and }} for literal braces)") from None


_MD_IMAGE = re.compile(r"!\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _image_part(where: str) -> dict[str, Any]:
    if where.lower().startswith(("http://", "https://")):
        raise UsageError(f"{where}: images are not fetched from the network; save the file "
                         "and give its local path")
    path = Path(where).expanduser()
    if not path.is_file():
        raise UsageError(f"no image file at {where}")
    return {"type": "image_url", "image_url": {"url": str(path.resolve())}}


def _with_images(text: str, paths: list[str]) -> str | list[dict[str, Any]]:
    """The user message: plain text, or content parts when it carries images.

    ``--image`` files come first, then the cell's text with each Markdown image
    ``![alt](path)`` in its place.
    """
    parts: list[dict[str, Any]] = [_image_part(p) for p in paths]
    at = 0
    for m in _MD_IMAGE.finditer(text):
        if text[at : m.start()].strip():
            parts.append({"type": "text", "text": text[at : m.start()]})
        parts.append(_image_part(m.group(2)))
        at = m.end()
    if not parts:
        return text
    if text[at:].strip():
        parts.append({"type": "text", "text": text[at:]})
    return parts


class _ProgressRelay:
    """Forwards the prefill progress of one session's next request to a chat view."""

    def __init__(self, session: str, view: disp.ChatView) -> None:
        self.session = session
        self.view = view
        self.request: int | None = None

    def __call__(self, event: Any) -> None:
        if isinstance(event, RequestStarted):
            if self.request is None and event.record.session == self.session:
                self.request = event.record.id
        elif (isinstance(event, Progress) and event.request_id == self.request
              and event.phase != "generate" and event.done < event.total):
            self.view.progress(event.phase, event.done, event.total)


def load(ipython: Any) -> None:
    """Register the magics with ``ipython``."""
    ipython.register_magics(Nbkv(shell=ipython))


def unload(ipython: Any) -> None:
    """Unregister the magics and close the engine."""
    mm = ipython.magics_manager
    inst = mm.registry.pop("Nbkv", None)
    mm.magics["line"].pop("kvcache", None)
    mm.magics["cell"].pop("chat", None)
    if inst is not None:
        if inst in ipython.configurables:
            ipython.configurables.remove(inst)
        inst._close_engine()
