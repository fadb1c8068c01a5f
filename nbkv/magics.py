"""The ``%kvcache`` and ``%%chat`` magics (``%load_ext nbkv``).

Defaults are traits: ``%config Nbkv.slots = 2``, or ``c.Nbkv.slots = 2`` in
``ipython_config.py``. The engine and the conversations live in :mod:`nbkv.sessions`.
"""

from __future__ import annotations

import keyword
import os
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split
from traitlets import observe

from . import display as disp
from .config import CACHE_MODES
from .errors import DecodeError, NbkvError
from .media import content_with_images
from .sessions import STORE, SessionStore
from .settings import Settings
from .views import LoadProgress, chat_view

COMMANDS = ("status", "load", "slots", "stats", "history", "explain", "clear", "widget",
            "unload", "config", "save", "restore")
# which options each %kvcache command accepts
_OPTIONS = {
    "load": {"mmproj", "slots", "ctx", "mode", "min_tokens", "template", "restore"},
    "clear": {"all"},
    "history": {"last"},
}


class Interrupted(KeyboardInterrupt):
    """A ``%%chat`` cell stopped by the user: stops "Run All", shown as one line."""

    def __init__(self, n_tokens: int) -> None:
        super().__init__(f"interrupted: partial reply kept ({n_tokens} tokens)")

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of a traceback
        return [str(self)]


def parse_argstring(magic: Any, line: str) -> Any:
    """Parse a magic's arguments, shell-style: quotes group words and are removed."""
    try:
        argv = arg_split(line, posix=True)
    except ValueError as e:
        raise UsageError(f"cannot parse the arguments: {e}") from None
    return magic.parser.parse_args(argv)


@magics_class
class Nbkv(Magics, Settings):
    """The ``%kvcache`` and ``%%chat`` magics; their defaults are :class:`Settings` traits."""

    def __init__(self, shell: Any = None, store: SessionStore | None = None, **kw: Any) -> None:
        super().__init__(shell=shell, **kw)
        self.store = store if store is not None else STORE  # an empty store is falsy

    # ------------------------------------------------------------------ %kvcache

    @magic_arguments()
    @argument("command", nargs="?", default="status", choices=COMMANDS,
              help="what to do (default: status)")
    @argument("target", nargs="?",
              help="load: a GGUF file (default: the embedded SmolLM2-135M); clear: a slot; "
                   "explain: a request number (default: the latest); save, restore: a "
                   "directory (default: one per notebook in the user cache)")
    @argument("--mmproj", metavar="F",
              help="load: vision projector GGUF (lets chat cells attach images)")
    @argument("--slots", type=int, metavar="N", help="load: number of slots")
    @argument("--ctx", type=int, metavar="N", help="load: tokens per slot")
    @argument("--mode", choices=CACHE_MODES, help="load: cache mode")
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
          %kvcache [status] | slots | stats | history [-n N] | explain [N]
          %kvcache clear [SLOT | --all] | save [DIR] | restore [DIR]
          %kvcache widget | unload | config
        """
        args = parse_argstring(self.kvcache, line)
        given = {k for k, v in vars(args).items()
                 if k not in ("command", "target") and v not in (None, False)}
        extra = given - _OPTIONS.get(args.command, set())
        if extra:
            flags = ", ".join("--" + k.replace("_", "-") for k in sorted(extra))
            raise UsageError(f"%kvcache {args.command} does not take {flags}")
        if args.target is not None and args.command not in ("load", "clear", "explain", "save",
                                                            "restore"):
            raise UsageError(f"%kvcache {args.command} takes no argument ({args.target!r})")
        try:
            return getattr(self, "_cmd_" + args.command)(args)
        except NbkvError as e:  # nbkv's own errors are the user's to fix: no traceback
            raise UsageError(str(e)) from e

    def _cmd_status(self, args: Any) -> Any:
        return disp.status_table(self.store.engine, self.store)

    def _cmd_load(self, args: Any) -> Any:
        kwargs = self.engine_kwargs(slots=args.slots, ctx=args.ctx, mode=args.mode,
                                    min_tokens=args.min_tokens)
        if args.mmproj:
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
        progress = LoadProgress(f"loading {Path(path).name if path else 'default model'}",
                                self._notebook())
        engine = self.store.load(path, on_load_progress=progress, **kwargs)
        self._sync_autosave()
        summary = disp.status_table(engine, self.store)
        progress.done(summary, note=self._offer_restore(engine, args.restore))
        return None if self._notebook() else summary

    def _cmd_slots(self, args: Any) -> Any:
        return disp.slots_table(self._engine())

    def _cmd_stats(self, args: Any) -> Any:
        return disp.stats_table(self._engine())

    def _cmd_history(self, args: Any) -> Any:
        return disp.history_table(self._engine().history, 20 if args.last is None else args.last)

    def _cmd_explain(self, args: Any) -> Any:
        request = _number(args.target, "explain: give a request number")
        return disp.ExplainReport(self._engine().explain(request))

    def _cmd_clear(self, args: Any) -> Any:
        engine = self._engine()
        if args.target is not None and args.all:
            raise UsageError("%kvcache clear: give a slot or --all, not both")
        slot = _number(args.target, "clear: slot must be a number")
        engine.clear(slot)
        return disp.Message(f"cleared slot {slot}" if slot is not None else
                            "cleared every slot (sessions keep their messages)")

    def _cmd_widget(self, args: Any) -> Any:
        from .widgets import CacheDashboard

        return CacheDashboard(self._engine())

    def _cmd_unload(self, args: Any) -> Any:
        if self.store.engine is None:
            return disp.Message("no engine loaded")
        self.store.close_engine()
        return disp.Message("engine closed and its memory freed")

    def _cmd_save(self, args: Any) -> Any:
        from . import persist

        return disp.Message(str(persist.save(self._engine(), self._save_path(args.target),
                                             self.store)))

    def _cmd_restore(self, args: Any) -> Any:
        from . import persist

        return disp.Message(str(persist.restore(self._engine(), self._save_path(args.target),
                                                self.store)))

    def _offer_restore(self, engine: Any, restore: bool) -> str | None:
        """After a load: restore the notebook's save (--restore), or say that one fits."""
        from . import persist

        path = self._save_path(None)
        if not restore:
            return persist.offer(engine, path)
        try:
            return str(persist.restore(engine, path, self.store))
        except NbkvError as e:
            return f"--restore: nothing restored: {e}"

    def _save_path(self, target: str | None) -> Path:
        from . import persist

        if target:
            return Path(target).expanduser()
        ns = self.shell.user_ns if self.shell is not None else {}
        notebook = (os.environ.get("JPY_SESSION_NAME") or ns.get("__vsc_ipynb_file__")
                    or ns.get("__session__") or None)
        return persist.default_path(notebook)

    @observe("autosave", "autosave_interval")
    def _sync_autosave(self, change: Any = None) -> None:
        """Autosave exactly while Nbkv.autosave is on and an engine is loaded."""
        self.store.autosave(self._save_path(None) if self.autosave else None,
                            self.autosave_interval)

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
        engine = self._engine(autoload=self.autoload)
        session = self.store.get(args.session or self.session)
        sampling: dict[str, Any] = dict(
            max_tokens=args.max_tokens or self.max_tokens,
            temperature=self.temperature if args.temp is None else args.temp,
        )
        if args.seed is not None:
            sampling["seed"] = args.seed
        try:
            content = content_with_images(text, args.image or [])
            turn = session.start(engine, content, new=args.new, system=args.system, **sampling)
        except NbkvError as e:
            raise UsageError(str(e)) from e
        view = chat_view(self._notebook(), self.refresh)
        try:
            reply, interrupted = view.stream(
                turn, engine.subscribe, self.stats if args.stats is None else args.stats)
        except DecodeError:
            raise
        except NbkvError as e:
            raise UsageError(str(e)) from e
        if args.out:
            self.shell.user_ns[args.out] = reply
        if interrupted:  # so that a "run all" stops here, with one line instead of a traceback
            raise Interrupted(reply.record.generated_tokens if reply.record else 0)

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


def _number(text: str | None, what: str) -> int | None:
    """``text`` as an int (``#3`` works too), None when absent; UsageError otherwise."""
    if text is None:
        return None
    try:
        return int(text.lstrip("#"))
    except ValueError:
        raise UsageError(f"%kvcache {what}, not {text!r}") from None


def load(ipython: Any) -> None:
    """Register the magics with ``ipython``."""
    ipython.register_magics(Nbkv(shell=ipython))


def unload(ipython: Any) -> None:
    """Unregister the magics and close the engine.

    IPython has no public call that unregisters magics (``MagicsManager`` only registers),
    so this removes the entries ``register_magics`` made, and nothing else.
    """
    mm = ipython.magics_manager
    inst = mm.registry.pop("Nbkv", None)
    mm.magics["line"].pop("kvcache", None)
    mm.magics["cell"].pop("chat", None)
    if inst is not None:
        if inst in ipython.configurables:
            ipython.configurables.remove(inst)
        inst.store.close_engine()
