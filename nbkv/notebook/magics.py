"""The ``%kvcache`` and ``%%chat`` magics (``%load_ext nbkv``).

Defaults are traits: ``%config Nbkv.slots = 2``, or ``c.Nbkv.slots = 2`` in
``ipython_config.py``. The engine and the conversations live in :mod:`nbkv.notebook.sessions`.
"""

from __future__ import annotations

import functools
import itertools
import keyword
import logging
import string
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split
from traitlets import observe

from nbkv.core.config import CACHE_MODES, FLASH_ATTN_MODES, KV_TYPE_SIZES
from nbkv.core.errors import DecodeError, NbkvError
from nbkv.media.messages import contains_images, content_with_images
from nbkv.notebook import commands
from nbkv.notebook.sessions import STORE, CellRef, Session, SessionStore
from nbkv.notebook.settings import Settings
from nbkv.ui.conversation_view import session_html
from nbkv.ui.views import chat_view

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("nbkv")


def usage_errors(magic: F) -> F:
    """Show nbkv's own errors as one line, without a traceback (IPython's UsageError).

    They are the user's to fix (a wrong argument, no engine loaded...). A
    :class:`~nbkv.core.errors.DecodeError` is not: llama.cpp failed, and its traceback stays.
    """
    @functools.wraps(magic)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return magic(*args, **kwargs)
        except DecodeError:
            raise
        except NbkvError as e:
            raise UsageError(str(e)) from e
    return run  # type: ignore[return-value]


class Interrupted(KeyboardInterrupt):
    """A ``%%chat`` cell stopped by the user: stops "Run All", shown as one line."""

    def __init__(self, n_tokens: int) -> None:
        super().__init__(f"stopped here: the partial reply is kept ({n_tokens} tokens)")

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of a traceback
        return [str(self)]


class CellTracker:
    """Which notebook cell is running, from IPython's ``pre_run_cell`` / ``post_run_cell``.

    Frontends send the cell's id with each execution (``cellId`` in the request's metadata:
    JupyterLab, Notebook 7, VS Code); IPython passes it on as ``ExecutionInfo.cell_id``.
    Terminal IPython, ``%run``, nbval and nbclient send none: :attr:`current` is then None.
    Only a ``%%chat`` cell is a turn: a Python cell that chats (``run_cell_magic``, a loop)
    has no cell of its own, so its turns are appended.
    """

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        #: the cells running now, innermost last: (ExecutionInfo, its cell, the shell's
        #: execution_count when it started, its cell id, the views made before it)
        self._running: list[tuple[Any, CellRef | None, int, str | None, int]] = []
        #: cell id -> the nbkv views its last run made (closed when it runs again)
        self._views: dict[str, list[weakref.ref[Any]]] = {}
        # IPython 9 counts a cell (In [N]) before pre_run_cell, IPython 8 after it: learnt
        # from each post_run_cell's result, first guessed from the version
        import IPython

        self._offset = 1 if IPython.version_info[0] >= 9 else 0

    def pre(self, info: Any) -> None:
        """A cell starts (``pre_run_cell``): the views its previous run made are closed."""
        seen = self.shell.execution_count
        raw_id = getattr(info, "cell_id", None) or None
        cell_id = raw_id
        if not str(getattr(info, "raw_cell", "") or "").lstrip().startswith("%%chat"):
            cell_id = None
        count = seen - self._offset if getattr(info, "store_history", False) else None
        if raw_id is not None:
            _close(self._views.pop(raw_id, []))
        self._running.append((info, CellRef(str(cell_id), count) if cell_id else None, seen,
                              raw_id, _views_made()))

    def post(self, result: Any) -> None:
        """A cell ended (``post_run_cell``; also fired for cells that never started)."""
        info = getattr(result, "info", None)
        if self._running and self._running[-1][0] is info:
            _, _, seen, raw_id, mark = self._running.pop()
            if getattr(info, "store_history", False) and \
                    isinstance(getattr(result, "execution_count", None), int):
                self._offset = seen - result.execution_count
            made = _views_since(mark)
            if raw_id is not None and made:
                self._views[raw_id] = [weakref.ref(v) for v in made]

    @property
    def current(self) -> CellRef | None:
        """The running cell, or None outside a cell or when the frontend sent no id."""
        return self._running[-1][1] if self._running else None

    def register(self) -> None:
        """Follow the shell's cells."""
        self.shell.events.register("pre_run_cell", self.pre)
        self.shell.events.register("post_run_cell", self.post)

    def unregister(self) -> None:
        """Stop following them."""
        for name, cb in (("pre_run_cell", self.pre), ("post_run_cell", self.post)):
            try:
                self.shell.events.unregister(name, cb)
            except ValueError:
                pass


def _views_made() -> int:
    """The mark of :func:`nbkv.ui.widgets.snapshot.created` (0 before any widget exists)."""
    mod = sys.modules.get("nbkv.ui.widgets.snapshot")
    return mod.created() if mod is not None else 0


def _views_since(mark: int) -> list[Any]:
    mod = sys.modules.get("nbkv.ui.widgets.snapshot")
    return mod.made_since(mark) if mod is not None else []


def _close(views: list[weakref.ref[Any]]) -> None:
    """Close views a cell's previous run showed: its outputs are gone, nothing shows them."""
    for ref in views:
        view = ref()
        if view is not None:
            try:
                view.close()
            except Exception:  # noqa: BLE001 - the cell must run regardless
                log.exception("nbkv: closing a view of a re-run cell failed")


def parse_argstring(magic: Any, line: str) -> Any:
    """Parse a magic's arguments, shell-style: quotes group words and are removed."""
    try:
        argv = arg_split(line, posix=True)
    except ValueError as e:
        raise UsageError(f"cannot parse the arguments: {e}") from None
    try:
        return magic.parser.parse_args(argv)
    except UsageError as e:
        hint = quote_hint(magic.parser, argv)
        if hint and "unrecognized arguments" in str(e):
            raise UsageError(f"{e}: {hint}") from None
        raise


def quote_hint(parser: Any, argv: list[str]) -> str:
    """``quote text with spaces: --system "You are a pirate"`` for an unquoted option value."""
    takes_one = {flag for action in parser._actions if action.option_strings
                 and action.nargs is None and action.type is None and action.const is None
                 for flag in action.option_strings}
    for i, tok in enumerate(argv[:-2]):
        if tok in takes_one and not argv[i + 1].startswith("-"):
            words = list(itertools.takewhile(lambda w: not w.startswith("-"), argv[i + 1:]))
            if len(words) > 1:
                return f'quote text with spaces: {tok} "{" ".join(words)}"'
    return ""


@magics_class
class Nbkv(Magics, Settings):
    """The ``%kvcache`` and ``%%chat`` magics; their defaults are :class:`Settings` traits."""

    def __init__(self, shell: Any = None, store: SessionStore | None = None, **kw: Any) -> None:
        super().__init__(shell=shell, **kw)
        self.store = store if store is not None else STORE  # an empty store is falsy
        self.cells = CellTracker(shell) if shell is not None else None

    # ------------------------------------------------------------------ %kvcache

    @magic_arguments()
    @argument("command", nargs="?", default="status", choices=tuple(commands.COMMANDS),
              help="what to do (default: status)")
    @argument("target", nargs="?",
              help="load: a GGUF file (default: the embedded SmolLM2-135M); connect: a "
                   "server's URL (llama-server or OpenAI-compatible); clear: a slot; "
                   "explain: a request number (default: the latest); park, unpark: a "
                   "session; verify: a request "
                   "number (default: every slot); save, restore: a directory (default: one "
                   "per notebook in the user cache); report: an HTML file to write "
                   "(default: show the page here)")
    @argument("--mmproj", metavar="F",
              help="load: vision projector GGUF (lets chat cells attach images)")
    @argument("--slots", type=int, metavar="N",
              help="load: number of slots; connect: llama-server slots to use")
    @argument("--api-key-env", metavar="VAR",
              help="connect: environment variable holding the server's API key")
    @argument("--ctx", type=int, metavar="N", help="load: tokens per slot")
    @argument("--mode", choices=CACHE_MODES, help="load: cache mode")
    @argument("--min-tokens", type=int, metavar="N", help="load: shortest salvageable prefix")
    @argument("--template", metavar="F", help="load: file with a Jinja2 chat template")
    @argument("--gpu-layers", type=int, metavar="N", help="load: layers offloaded to a GPU")
    @argument("--kv-type", choices=tuple(KV_TYPE_SIZES), help="load: K and V cache type")
    @argument("--flash-attn", choices=FLASH_ATTN_MODES, help="load: flash attention")
    @argument("--restore", action="store_true",
              help="load: then restore this notebook's latest compatible save")
    @argument("--reload", action="store_true",
              help="load: load afresh even when the engine loaded has the same model and "
                   "settings (it is kept by default, with its caches)")
    @argument("--trust", action="store_true",
              help="restore, load --restore: restore a save not signed by your key, "
                   "recomputing every slot by a full prefill before it is served")
    @argument("--park-ram", metavar="BYTES",
              help="load: RAM for parked conversations, e.g. 2G (Nbkv.park_ram)")
    @argument("--park-dir", metavar="DIR",
              help="load: where parked conversations go when they leave RAM (Nbkv.park_dir)")
    @argument("--all", action="store_true",
              help="clear: every slot; park, unpark: every conversation")
    @argument("--parked", action="store_true",
              help="clear: forget the parked conversations too (alone: only them)")
    @argument("-n", "--last", type=int, metavar="N", help="history: records shown (20)")
    @line_magic
    @usage_errors
    def kvcache(self, line: str = "") -> Any:
        """Load, connect, inspect and clear the engine (in the kernel, or a server).

        ::

          %kvcache load [MODEL] [--mmproj F] [--slots N] [--ctx N] [--mode imc|spc|off]
                        [--min-tokens N] [--template F] [--restore [--trust]] [--reload]
                        [--gpu-layers N] [--kv-type T] [--flash-attn auto|on|off]
                        [--park-ram BYTES] [--park-dir DIR]
          %kvcache connect URL [--slots N] [--api-key-env VAR]
          %kvcache [status] | slots | stats | history [-n N] | explain [N] | verify [N]
          %kvcache clear SLOT | clear --all [--parked] | clear --parked
          %kvcache save [DIR] | restore [DIR] [--trust]
          %kvcache parked | park [SESSION | --all] | unpark [SESSION | --all]
          %kvcache widget | report [FILE] | unload | config
        """
        args = parse_argstring(self.kvcache, line)
        run, options, takes_target = commands.COMMANDS[args.command]
        given = {k for k, v in vars(args).items()  # 0 is given, though `0 in (None, False)`
                 if k not in ("command", "target") and v is not None and v is not False}
        if given - options:
            flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given - options))
            raise UsageError(f"%kvcache {args.command} does not take {flags}")
        if args.target is not None and not takes_target:
            raise UsageError(f"%kvcache {args.command} takes no argument ({args.target!r})")
        return run(self._workspace(), args)

    @observe("autosave", "autosave_interval")
    def _sync_autosave(self, change: Any = None) -> None:
        self._workspace().sync_autosave()

    # ------------------------------------------------------------------ %%chat

    @magic_arguments()
    @argument("session", nargs="?", help="conversation name (default: Nbkv.session)")
    @argument("--system", metavar="TEXT", help="set the session's system prompt")
    @argument("--new", action="store_true", help="start the session over")
    @argument("--from", dest="fork", metavar="SESSION[:TURN]",
              help="start the session as a fork of SESSION's first TURN turns (default: "
                   "all), sharing their KV")
    @argument("--max-tokens", type=int, metavar="N", help="longest reply (Nbkv.max_tokens)")
    @argument("--temp", type=float, metavar="T", help="temperature (Nbkv.temperature)")
    @argument("--seed", type=int, metavar="S", help="sampling seed")
    @argument("--image", action="extend", nargs="+", metavar="PATH",
              help="attach image files (load the engine with --mmproj)")
    @argument("--out", metavar="VAR", help="store the reply (a str with .record) in VAR")
    @argument("--fresh", action="store_true",
              help="decode the reply even when the cell runs again with the same prompt and "
                   "settings (by default the cached reply is replayed: Nbkv.replay)")
    @argument("--stats", dest="stats", action="store_const", const=True, default=None,
              help="show the cache figures (Nbkv.stats)")
    @argument("--no-stats", dest="stats", action="store_const", const=False,
              help="hide the cache figures")
    @cell_magic
    @usage_errors
    def chat(self, line: str, cell: str) -> None:
        """Send the cell as a user message of a session and stream the reply.

        A cell is a turn: running the cell again replaces its turn (answered on the turns of
        the cells run before it) and marks the later turns stale. Run again with the same
        prompt and deterministic settings, it gets the reply the cache holds, decoding
        nothing, and the later turns stay (``--fresh`` decodes anyway). ``{name}`` in the cell
        inserts the kernel variable ``name`` (``{{`` and ``}}`` for literal braces). The
        conversation stays in the kernel: ``nbkv.session(NAME)``.
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
        if args.fork is not None and args.new:
            raise UsageError("--from and --new both say how the session starts: give one")
        fork = _fork_spec(args.fork) if args.fork is not None else None
        if fork is not None and fork[0] not in self.store:
            raise UsageError(f"--from {args.fork}: no session {fork[0]!r} to fork from")
        engine = self._engine(autoload=self.autoload)
        name = args.session or self.session
        sampling: dict[str, Any] = dict(
            max_tokens=self.max_tokens if args.max_tokens is None else args.max_tokens,
            temperature=self.temperature if args.temp is None else args.temp,
        )
        if args.seed is not None:
            sampling["seed"] = args.seed
        content = content_with_images(text, args.image or [])
        if (getattr(engine, "projector", False) is None
                and contains_images([{"role": "user", "content": content}])):
            raise UsageError("this cell attaches an image, but the engine has no vision "
                             "projector: load one with %kvcache load [MODEL] --mmproj "
                             "PROJECTOR.gguf (the model's mmproj file)")
        session = (self.store[fork[0]].fork(name, fork[1]) if fork is not None
                   else self.store.get(name))
        turn = session.start(engine, content, new=args.new, system=args.system,
                             cell=self.cells.current if self.cells is not None else None,
                             replay=self.replay and not args.fresh, **sampling)
        view = chat_view(self._notebook(), self.refresh)
        reply, interrupted = view.stream(
            turn, engine.subscribe, self.stats if args.stats is None else args.stats)
        if args.out and self.shell is not None:
            self.shell.user_ns[args.out] = reply
        if interrupted:  # so that a "run all" stops here, with one line instead of a traceback
            raise Interrupted(reply.record.generated_tokens if reply.record else 0)

    # ------------------------------------------------------------------ helpers

    def _notebook(self) -> bool:
        if self.frontend != "auto":
            return self.frontend == "notebook"
        return getattr(self.shell, "kernel", None) is not None

    def _workspace(self) -> commands.Workspace:
        return commands.Workspace(self.store, self, self._notebook(),
                                  self.shell.user_ns if self.shell is not None else {})

    def _engine(self, autoload: bool = False) -> Any:
        if self.store.engine is None and autoload:
            self.kvcache("load")
        return self._workspace().engine()

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


def _fork_spec(text: str) -> tuple[str, int | None]:
    """``alice:2`` -> ("alice", 2); ``alice`` -> ("alice", None): every turn."""
    name, sep, turn = text.rpartition(":")
    if not sep:
        name, turn = text, ""
    if not name:
        raise UsageError(f"--from {text}: give SESSION or SESSION:TURN, e.g. --from alice:2")
    if not turn:
        return name, None
    try:
        return name, int(turn)
    except ValueError:
        raise UsageError(f"--from {text}: the turn must be a number, e.g. --from "
                         f"{name}:2") from None


def load(ipython: Any) -> None:
    """Register the magics with ``ipython`` and follow its cells.

    Long work started in this kernel without a reporter of its own (an ``Engine(...)`` made
    in a cell, ``LlamaServer.start()``) then shows its progress in the running cell.
    ``%load_ext nbkv`` run again ("Run All" a second time) is then quiet: IPython would print
    "The nbkv extension is already loaded"; loading it again changes nothing.
    """
    from nbkv.core import progress
    from nbkv.ui.progress import ProgressBar

    magics = Nbkv(shell=ipython)
    ipython.register_magics(magics)
    if magics.cells is not None:
        magics.cells.register()
    progress.set_default(lambda: ProgressBar(magics._notebook()))
    # a session shows as its conversation view (the model itself knows no HTML)
    ipython.display_formatter.formatters["text/html"].for_type(Session, session_html)
    manager = getattr(ipython, "extension_manager", None)
    if manager is not None and "load_extension" not in vars(manager):
        manager.load_extension = _quiet_when_loaded(manager, manager.load_extension)


def _quiet_when_loaded(manager: Any, load_extension: Callable[[str], Any]) -> Any:
    """``load_extension`` that answers "loaded" (None) for nbkv when it already is."""
    def load_ext(module_str: str) -> Any:
        if module_str == "nbkv" and module_str in manager.loaded:
            return None
        return load_extension(module_str)
    load_ext.__wrapped__ = load_extension  # type: ignore[attr-defined]
    return load_ext


def unload(ipython: Any) -> None:
    """Unregister the magics and close the engine.

    IPython has no public call that unregisters magics (``MagicsManager`` only registers),
    so this removes the entries ``register_magics`` made, and nothing else.
    """
    mm = ipython.magics_manager
    inst = mm.registry.pop("Nbkv", None)
    mm.magics["line"].pop("kvcache", None)
    mm.magics["cell"].pop("chat", None)
    manager = getattr(ipython, "extension_manager", None)
    if manager is not None and "load_extension" in vars(manager):
        del manager.load_extension  # IPython's own again
    if inst is not None:
        if inst.cells is not None:
            inst.cells.unregister()
        if inst in ipython.configurables:
            ipython.configurables.remove(inst)
        inst.store.close_engine()
    ipython.display_formatter.formatters["text/html"].pop(Session, None)
    from nbkv.core import progress

    progress.set_default(None)
