"""The README and the docs pages: every code block runs, every repository path exists.

A fenced ```python block is executed (blocks that need a model get the embedded one, with
short replies). Any other fenced block (shell commands, magics, output) must say why it is
not run, in an HTML comment on the line before it: ``<!-- no-run: REASON -->``. MyST
directives (```{toctree}, ```{eval-rst}, ...) and ```text blocks (diagrams) are not code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PAGES = [p for p in PAGES if "_build" not in p.parts]

FENCE = re.compile(r"^(?P<marker>[ \t]*<!-- no-run: (?P<why>[^>]+) -->\n)?"
                   r"(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
#: files the docs tell the reader to write (the bench's results), not ones they say exist
OUTPUTS = {"docs/_data/bench.json"}
#: a repository path named in prose or code: nbkv/kv/policy.py, tests/test_docs.py, binder/
PATH = re.compile(r"(?<![\w/.:-])((?:nbkv|tests|notebooks|binder|tools|docs|\.ci)/[\w./-]*)")


def blocks() -> list[tuple[Path, int, str, str, str | None]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            lang = m["lang"].strip()
            if lang.startswith("{") or lang == "text":
                continue
            line = text.count("\n", 0, m.start("indent")) + 1
            out.append((page, line, lang, m["body"], m["why"]))
    return out


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if b[2] == "python" and b[4] is None]


def _id(b: tuple[Path, int, str, str, str | None]) -> str:
    return f"{b[0].relative_to(ROOT)}:{b[1]}"


def test_pages_found() -> None:
    assert ROOT / "README.md" in PAGES and len(PAGES) > 20
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("block", [b for b in BLOCKS if b[2] != "python" or b[4]], ids=_id)
def test_block_not_run_says_why(block: tuple[Path, int, str, str, str | None]) -> None:
    """A block that is not run says so, with a reason, where the reader sees the source."""
    assert block[4], (f"{_id(block)}: a ```{block[2]} block is not run: mark it "
                      "<!-- no-run: REASON --> (or make it a ```python block that runs)")


@pytest.mark.parametrize("block", RUNNABLE, ids=_id)
def test_python_block_runs(block: tuple[Path, int, str, str, str | None], tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(block[3], _id(block), "exec")
    exec(code, {"__name__": "__docs__"})


def named_paths() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for m in PATH.finditer(page.read_text()):
            path = m.group(1).rstrip(".")
            if path.startswith("docs/_build") or path in OUTPUTS:
                continue
            found.append((str(page.relative_to(ROOT)), path))
    links = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s#]+)")
    for page in PAGES:
        for m in links.finditer(page.read_text()):
            target = (page.parent / m.group(1)).resolve()
            found.append((str(page.relative_to(ROOT)), str(target.relative_to(ROOT))))
    return found


def test_named_paths_exist() -> None:
    paths = named_paths()
    assert len(paths) > 50
    missing = sorted({f"{page}: {path}" for page, path in paths if not (ROOT / path).exists()})
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def test_path_check_catches_a_stale_path(tmp_path: Path) -> None:
    """The pattern finds a moved module's old path, so the check above can fail."""
    assert PATH.findall("see `nbkv/calibrate.py` and nbkv/kv/policy.py.") == [
        "nbkv/calibrate.py", "nbkv/kv/policy.py."]
    assert not (ROOT / "nbkv/calibrate.py").exists()


def _ext():  # docs/_ext/nbkv_docs.py (needs sphinx: the docs extra)
    import importlib
    import sys

    pytest.importorskip("sphinx")
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        return importlib.import_module("nbkv_docs")
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))


@pytest.mark.parametrize("name", ["kvcache", "chat"])
def test_magics_reference_lists_every_option(name: str) -> None:
    """The generated reference holds every argument the magic's parser takes."""
    from nbkv.notebook.magics import Nbkv

    text = "\n".join(_ext().magic_lines(name))
    parser = getattr(Nbkv, name).parser
    for action in parser._actions:
        for flag in action.option_strings or [action.dest]:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in text, flag


def test_reference_resolver_refuses_a_name_the_code_lacks() -> None:
    ext = _ext()
    assert ext._exists("text", "nbkv.core.streams", "ChatStream")  # an instance attribute
    assert ext._exists("Engine.achat", "nbkv.core.streams", None)  # a public name
    assert not ext._exists("no_such_name", "nbkv.core.streams", "ChatStream")


def test_docstrings_stay_short() -> None:
    """A docstring says what a thing is for in a few lines; the docs pages hold the rest."""
    import ast

    long = []
    for path in sorted((ROOT / "nbkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and doc.count("\n") + 1 > 25:
                    long.append(f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}")
    assert long == []
