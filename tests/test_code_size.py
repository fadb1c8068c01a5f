"""The code stays small enough to hold: modules, functions and the Engine class (no model).

The limits are the developer guide's (issue 44): no module over 600 lines and no function or
method over 80 in ``nbkv/`` (bench and fixtures included), and the ``Engine`` class at most
400 lines. A function is measured from its ``def`` (decorators excluded) to its last line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nbkv"
MODULE_LINES, FUNCTION_LINES, ENGINE_LINES = 600, 80, 400

def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _functions(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """Every function and method in ``tree`` with its qualified name (nested ones too)."""
    found: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined, operator]


def _where(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def test_the_package_is_found():
    assert len(_modules()) > 50 and (PACKAGE / "engine" / "facade.py").is_file()


def test_no_module_over_600_lines():
    over = {_where(p): n for p in _modules()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}"


def test_no_function_over_80_lines():
    over = {}
    for p in _modules():
        for name, node in _functions(ast.parse(p.read_text(encoding="utf-8"))):
            key = f"{_where(p)}::{name}"
            if _lines(node) > FUNCTION_LINES:
                over[key] = _lines(node)
    assert not over, f"functions over {FUNCTION_LINES} lines: {over}"


def test_the_engine_class_is_at_most_400_lines():
    facade = PACKAGE / "engine" / "facade.py"
    tree = ast.parse(facade.read_text(encoding="utf-8"))
    engine = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert len(engine) == 1
    assert _lines(engine[0]) <= ENGINE_LINES, f"Engine is {_lines(engine[0])} lines"


@pytest.mark.parametrize("source, name, lines", [
    ("def f():\n" + "    x = 1\n" * 81, "f", 82),
    ("class A:\n    def m(self):\n        def inner():\n            pass\n", "A.m.inner", 2),
])
def test_functions_are_measured_by_qualified_name(source, name, lines):
    """The measure itself: a method and a nested function, named and counted."""
    found = dict(_functions(ast.parse(source)))
    assert _lines(found[name]) == lines
