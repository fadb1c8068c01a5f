"""The import graph of ``nbkv``: no cycles, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import nbkv

ROOT = Path(nbkv.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Modules of ``nbkv`` that ``path`` imports anywhere (type-checking-only ones excepted)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else (
                base if node.level else node.module or "")
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: _imports(p, name, modules) for name, p in files.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


ENGINE_CORE = ("engine", "scheduler", "placement", "prefill", "rewrite", "generation",
               "vision_decode", "verify", "slot_table", "native", "engine_state", "jobs")
ABOVE = ("persist", "remote", "remote_persist", "magics", "commands", "sessions", "views",
         "display", "widgets", "page", "static")


#: the facade's save() and restore() hand the engine to persistence, which uses only its
#: public state API (export_state / import_state) and imports no engine code
DELEGATES = {("engine", "persist")}


def test_engine_code_imports_only_downwards() -> None:
    g = graph()
    for name in ENGINE_CORE:
        for m in g[f"nbkv.{name}"]:
            up = m.split(".")[1]
            assert up not in ABOVE or (name, up) in DELEGATES, f"nbkv.{name} imports {m}"
    assert not g["nbkv.store.persist"] & {f"nbkv.{m}" for m in (*ENGINE_CORE[:1], "remote",
                                                          "sessions", "magics")}
