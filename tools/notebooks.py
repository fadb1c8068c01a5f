"""``make notebooks``: run the teaching notebooks and commit them with their outputs.

Each notebook runs top to bottom in a fresh kernel of this environment, every cell sent with
its id as JupyterLab sends it (``cellId``), in a scratch copy of ``notebooks/`` (the files a
notebook writes stay out of the repository). Then, before it is saved:

- every nbkv view's snapshot is refreshed (``nbkv.ui.widgets.refresh_all``), so the static
  pictures show the cache after the last request;
- the live-view outputs (``application/vnd.jupyter.widget-view+json``) are dropped: without
  a kernel nothing can show them, and their static snapshot is the output beside them; no
  widget state is stored;
- ``metadata.nbkv`` records the digest of the notebook's inputs and nbkv's version, which
  ``tests/test_lessons.py`` checks: a committed notebook whose cells changed since its
  outputs were made fails the test until ``make notebooks`` runs again.

The kernels calibrate a model they have never seen during its load
(``NBKV_CALIBRATION=cached`` unless set), so the saved outputs show proven engines.

Usage: ``python tools/notebooks.py [NOTEBOOK ...]`` (default: every ``notebooks/*.ipynb``);
``--check`` only says which are stale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MAX_BYTES = 1 << 20  # a committed notebook with its outputs stays under 1 MiB
#: run after the last cell, then dropped: every snapshot shows the cache after the last request
FINAL = "import nbkv.ui.widgets as _nbkv_widgets\n_nbkv_widgets.refresh_all()"


def version() -> str:
    """The version of the nbkv this repository holds."""
    sys.path.insert(0, str(ROOT))
    try:
        import nbkv
    finally:
        sys.path.pop(0)
    return nbkv.__version__


def inputs_digest(nb: Any, nbkv_version: str) -> str:
    """The digest of what a notebook's outputs depend on: its cells' inputs and nbkv."""
    cells = [[c.get("cell_type"), c.get("id"), _source(c.get("source", ""))]
             for c in nb["cells"]]
    text = json.dumps({"cells": cells, "nbkv": nbkv_version}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _source(src: Any) -> str:
    return "".join(src) if isinstance(src, list) else str(src)


def stale(path: Path, nbkv_version: str) -> str:
    """Why ``path``'s committed outputs are out of date ("" when they are current)."""
    nb = json.loads(path.read_text())
    meta = nb.get("metadata", {}).get("nbkv", {})
    if not meta:
        return "it has no outputs from make notebooks"
    if meta.get("nbkv") != nbkv_version:
        return f"its outputs are from nbkv {meta.get('nbkv')}, this is {nbkv_version}"
    if meta.get("inputs") != inputs_digest(nb, nbkv_version):
        return "its cells changed since its outputs were made"
    return ""


class CellIdClient(NotebookClient):
    """An nbclient ``NotebookClient`` that sends each cell's id with its code (``cellId``).

    nbclient (like nbval) sends none: jupyter_client's ``execute`` takes no metadata.
    """

    current: str | None = None  # the id of the cell being executed

    async def async_execute_cell(self, cell: Any, cell_index: int, *a: Any, **k: Any) -> Any:
        """Execute ``cell``, its id sent along."""
        self.current = cell.get("id")
        return await super().async_execute_cell(cell, cell_index, *a, **k)

    async def async_start_new_kernel_client(self) -> Any:
        """The kernel client, its ``execute`` sending the current cell's id."""
        kc = await super().async_start_new_kernel_client()

        def execute(code: str, silent: bool = False, store_history: bool = True,
                    user_expressions: Any = None, allow_stdin: Any = None,
                    stop_on_error: bool = True, **_: Any) -> str:
            content = {"code": code, "silent": silent, "store_history": store_history,
                       "user_expressions": user_expressions or {}, "allow_stdin": False,
                       "stop_on_error": stop_on_error}
            meta = {"cellId": self.current} if self.current else {}
            msg = kc.session.msg("execute_request", content, metadata=meta)
            kc.shell_channel.send(msg)
            return msg["header"]["msg_id"]

        kc.execute = execute
        return kc


def regenerate(path: Path, nbkv_version: str, timeout: int = 900) -> dict[str, Any]:
    """Run ``path`` as JupyterLab's "Run All" and write it back with its outputs."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("nbkv", None)
    final = nbformat.v4.new_code_cell(FINAL, id="nbkv-final-snapshots")
    nb.cells.append(final)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nbkv-notebooks-") as tmp:
        work = Path(tmp) / "notebooks"
        shutil.copytree(NOTEBOOKS, work, ignore=shutil.ignore_patterns("*.ipynb"))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        os.environ.update(env)  # the kernel inherits it: nbkv is this repository's
        client = CellIdClient(nb, kernel_name="python3", timeout=timeout,
                              resources={"metadata": {"path": str(work)}},
                              store_widget_state=False, record_timing=False)
        client.execute()
    nb.cells.remove(final)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if WIDGET_VIEW not in o.get("data", {})]
            for o in cell.outputs:
                o.get("metadata", {}).pop("transient", None)
    nb.metadata.pop("widgets", None)
    nb.metadata["nbkv"] = {"nbkv": nbkv_version, "inputs": inputs_digest(nb, nbkv_version)}
    nbformat.write(nb, path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{path.name}: {size / 1024:.0f} KiB with its outputs, over 1 MiB")
    return {"notebook": path.name, "seconds": round(time.monotonic() - t0, 1),
            "kib": round(size / 1024)}


def main(argv: list[str] | None = None) -> int:
    """Regenerate the notebooks named (default: all), or ``--check`` which are stale."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--check", action="store_true", help="only say which are stale")
    args = ap.parse_args(argv)
    os.environ.setdefault("NBKV_CALIBRATION", "cached")  # inherited by the kernels
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    v = version()
    if args.check:
        why = {p.name: stale(p, v) for p in paths}
        for name, reason in why.items():
            print(f"{name}: {reason or 'current'}")
        return 1 if any(why.values()) else 0
    for p in paths:
        print(json.dumps(regenerate(p.resolve(), v)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
