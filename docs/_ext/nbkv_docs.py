"""Pages nbkv's docs generate at build time, so they cannot drift from the code.

- ``{nbkv-magic} kvcache`` / ``{nbkv-magic} chat``: a magic's reference, read from the
  ``magic_arguments`` parser IPython builds for it (usage, docstring, every option).
- ``{nbkv-settings}``: the ``Nbkv`` traits (``%config Nbkv.X``), from their ``help=``.
- ``{nbkv-engine-options}``: the engine's settings, from their fields in ``nbkv.core.config``.
- ``{nbkv-errors}``: every named error, from :mod:`nbkv.core.errors`.
- ``{nbkv-bench} PATH``: a ``python -m nbkv.bench`` results JSON as tables, with the run's
  machine, date and command.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def magic_lines(name: str) -> list[str]:
    """A magic's reference as Markdown lines, from its parser and docstring."""
    from nbkv.notebook.magics import Nbkv

    func = getattr(Nbkv, name)
    parser: argparse.ArgumentParser = func.parser
    prefix = "%%" if name == "chat" else "%"
    usage = parser.format_usage().replace("usage: ", "").strip()
    doc = inspect.cleandoc(func.__doc__ or "")
    lines = ["```text", usage.replace(f"%{name}", f"{prefix}{name}", 1), "```", ""]
    lines += ["```text", doc, "```", ""]
    rows = []
    for act in parser._actions:
        if isinstance(act, argparse._HelpAction):
            continue
        flag = ", ".join(f"`{o}`" for o in act.option_strings) or f"`{act.dest}`"
        if act.metavar:
            flag += f" `{act.metavar}`"
        choices = ", ".join(f"`{c}`" for c in act.choices) if act.choices else ""
        rows.append([flag, act.help or "", choices])
    lines += _table(["argument", "what it does", "choices"], rows)
    return lines


def settings_lines() -> list[str]:
    """The ``Nbkv`` traits as a Markdown table."""
    from nbkv.notebook.settings import Settings

    rows = []
    for name, trait in sorted(Settings.class_traits(config=True).items()):
        default = trait.default_value
        rows.append([f"`Nbkv.{name}`", f"`{default!r}`", trait.help])
    return _table(["setting", "default", "what it is for"], rows)


def engine_options_lines() -> list[str]:
    """The engine's settings as a Markdown table, from their fields (nbkv.core.config)."""
    from nbkv.core.config import described

    rows = [[f"`{f.name}`", f"`{group}`", f"`{f.metadata['default']!r}`", f.metadata["help"]]
            for group, f in described()]
    return _table(["argument", "group", "default", "what it is for"], rows)


def errors_lines() -> list[str]:
    """Every ``NbkvError`` subclass, with its parent and its docstring's first line."""
    from nbkv.core import errors

    found = [obj for _, obj in inspect.getmembers(errors, inspect.isclass)
             if issubclass(obj, errors.NbkvError) and obj.__module__ == errors.__name__]
    found.sort(key=lambda c: (len(c.__mro__), c.__name__))
    rows = []
    for cls in found:
        base = cls.__bases__[0].__name__ if cls is not errors.NbkvError else "Exception"
        first = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        rows.append([f"`{cls.__name__}`", f"`{base}`", first])
    return _table(["error", "is a", "raised when"], rows)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def bench_lines(path: Path) -> list[str]:
    """A bench results JSON: the run's facts, each scenario's ratios, the targets."""
    if not path.exists():
        return [":::{note}", f"No results file at `docs/{path.parent.name}/{path.name}` in this "
                "build: run `python -m nbkv.bench --quick --scenario single --out "
                f"docs/{path.parent.name}/{path.name}` and build the docs again.", ":::"]
    report = json.loads(path.read_text())
    run = report.get("run", {})
    lines = [
        f"- **command:** `{run.get('command', 'not recorded')}`",
        f"- **date:** {run.get('date', 'not recorded')}",
        f"- **machine:** {run.get('machine', 'not recorded')}",
        f"- **load average at start:** {_fmt(run.get('load_avg', 'not recorded'))}",
        f"- **model:** `{Path(report.get('model', '?')).name}`, replies of at most "
        f"{report.get('max_tokens', '?')} tokens",
        "",
    ]
    for name, scen in report.items():
        if not isinstance(scen, dict) or "ratios" not in scen:
            continue
        lines += [f"### `{name}`", "", f"Wall time of the scenario: {scen.get('wall_s', 0):.0f} s.",
                  ""]
        lines += _table(["ratio", "value"],
                        [[f"`{k}`", _fmt(v)] for k, v in scen["ratios"].items()])
        lines.append("")
    if report.get("targets"):
        lines += ["### Targets", ""]
        lines += _table(["scenario", "ratio", "target", "got", "met"],
                        [[t["scenario"], f"`{t['ratio']}`", t["target"], _fmt(t["got"]),
                          "yes" if t["met"] else "**no**"] for t in report["targets"]])
    return lines


class _Generated(SphinxDirective):
    """Parse generated Markdown lines as if they were in the page."""

    def lines(self) -> list[str]:
        """The Markdown to parse."""
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        self.state.nested_parse(StringList(self.lines(), source=self.get_source_info()[0]),
                                self.content_offset, container)
        return container.children


class MagicDirective(_Generated):
    """``{nbkv-magic} NAME``: a magic's usage, docstring and options."""

    required_arguments = 1

    def lines(self) -> list[str]:
        """The magic's reference."""
        return magic_lines(self.arguments[0])


class SettingsDirective(_Generated):
    """``{nbkv-settings}``: the ``Nbkv`` traits."""

    def lines(self) -> list[str]:
        """The traits' table."""
        return settings_lines()


class EngineOptionsDirective(_Generated):
    """``{nbkv-engine-options}``: every engine setting."""

    def lines(self) -> list[str]:
        """The settings' table."""
        return engine_options_lines()


class ErrorsDirective(_Generated):
    """``{nbkv-errors}``: every named error."""

    def lines(self) -> list[str]:
        """The errors' table."""
        return errors_lines()


class BenchDirective(_Generated):
    """``{nbkv-bench} PATH``: a bench results JSON (relative to docs/)."""

    required_arguments = 1

    def lines(self) -> list[str]:
        """The run's facts and tables."""
        path = Path(self.env.srcdir) / self.arguments[0]
        self.env.note_dependency(str(path))
        return bench_lines(path)


def _exists(dotted: str, module: str | None, cls: str | None) -> bool:
    """Whether ``dotted`` names a real object, as the docstring's module would see it."""
    import importlib

    starts = [dotted, f"nbkv.{dotted}"]  # nbkv.Engine is a public name
    if module:
        starts += [f"{module}.{cls}.{dotted}" if cls else "", f"{module}.{dotted}"]
    for full in filter(None, starts):
        parts = full.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            rest = parts[i:]
            try:
                while rest:
                    obj = getattr(obj, rest[0])
                    rest = rest[1:]
            except AttributeError:
                # an instance attribute, set in the class's own code
                if len(rest) == 1 and inspect.isclass(obj) and re.search(
                        rf"self\.{rest[0]}\b\s*[:=]", inspect.getsource(obj)):
                    return True
                break
            return True
    return False


def resolve_short_name(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """A docstring's reference, resolved as its module imports the name.

    Docstrings name things as their module sees them (``:class:`ChatStream```). A name that
    matches one documented object (the one nearest the docstring's module and class when
    several do) links there; a name that exists in the code but is not documented is kept as
    plain text; any other stays a broken reference, an error in ``make test``.
    """
    if node.get("refdomain") != "py":
        return None
    from sphinx.util.nodes import make_refnode

    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module"), node.get("py:class")
    short = target.split(".", 1)[1] if target.startswith("nbkv.") and target.count(".") == 1 \
        else target  # nbkv.Engine: a public name
    domain = env.get_domain("py")
    found = [(name, obj) for name, obj in domain.objects.items()
             if name == short or name.endswith("." + short)]
    for scope in (f"{module}.{cls}." if cls else None, f"{module}." if module else None):
        near = [f for f in found if scope and f[0].startswith(scope)]
        if len(near) == 1:
            found = near
            break
    if len(found) == 1:
        name, obj = found[0]
        return make_refnode(app.builder, node["refdoc"], obj.docname, obj.node_id, contnode,
                            name)
    if _exists(target, module, cls):
        return contnode
    return None


# what myst-nb renders itself; nbkv's charts add plotly's JSON, which the site shows as the
# PNG every chart bundle carries beside it (nbkv/ui/chartfig.py)
RENDERED_MIME = {"text/plain", "text/html", "text/markdown", "text/latex", "image/png",
                 "image/jpeg", "image/svg+xml", "image/gif", "application/javascript",
                 "application/vnd.jupyter.widget-view+json"}
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def check_lesson_outputs(app: Any) -> None:
    """Warn (an error under ``-W``) for a lesson output the site could not show.

    conf.py silences myst-nb's own "unknown mime type" warning, which every chart's plotly
    JSON raises; this check keeps what that warning guarded: a plotly bundle must carry its
    PNG, and no other unknown type may appear.
    """
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    for path in sorted(Path(app.srcdir, "lessons").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for n, cell in enumerate(cells):
            for out in cell.get("outputs", []):
                kinds = set(out.get("data", {}))
                unknown = kinds - RENDERED_MIME - {PLOTLY_MIME}
                if unknown:
                    log.warning("%s cell %d: output type(s) the site cannot show: %s",
                                path.name, n, ", ".join(sorted(unknown)))
                if PLOTLY_MIME in kinds and "image/png" not in kinds:
                    log.warning("%s cell %d: a chart without its PNG fallback", path.name, n)


def setup(app: Any) -> dict[str, Any]:
    """Register the directives, the short-name resolver and the lessons' output check."""
    app.connect("missing-reference", resolve_short_name)
    app.connect("builder-inited", check_lesson_outputs)
    app.add_directive("nbkv-magic", MagicDirective)
    app.add_directive("nbkv-settings", SettingsDirective)
    app.add_directive("nbkv-engine-options", EngineOptionsDirective)
    app.add_directive("nbkv-errors", ErrorsDirective)
    app.add_directive("nbkv-bench", BenchDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
