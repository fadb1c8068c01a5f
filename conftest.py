"""Notebook runs (nbval) for the whole repository, as JupyterLab's "Run All", twice; calibration.

Loaded by pytest for every path in the repository (``pytest notebooks/02_how_imc_works.ipynb``
as well as ``make test``); the tests' own fixtures and helpers are in ``tests/conftest.py``
(a script run from the repository's root that imports ``conftest`` gets this one: run it
from ``tests/``). It also sets the calibration every engine of a test run uses (below).
"""

from __future__ import annotations

import os

import pytest

# Every engine the tests and the notebooks' kernels load calibrates a model it has never seen
# during the load (``calibration="cached"``), so that exactness is read from the first reply;
# by default an engine would serve at once and prove in the background. Set before any engine
# loads; kernels and subprocesses inherit it. Tests of the default unset it (monkeypatch).
os.environ["NBKV_CALIBRATION"] = "cached"


def pytest_collection_modifyitems(config, items):
    """Run notebooks as JupyterLab's "Run All" does, twice.

    ``notebooks/05_remote_engine.ipynb`` runs with or without llama-server: without one, its
    first cell says so and the lesson runs on the in-kernel engine. ``make test`` builds the
    server and sets NBKV_REQUIRE_SERVER, so there it runs on the server (or fails).
    """
    import os

    from nbkv.remote.server import binary

    if binary() is None and os.environ.get("NBKV_REQUIRE_SERVER") and any(
            "05_remote_engine" in str(item.fspath) for item in items):
        raise pytest.UsageError("no llama-server binary, and NBKV_REQUIRE_SERVER is set: "
                                "run `make llama-server`")
    items[:] = run_all_twice(items)


def run_all_twice(items):
    """Each notebook's cells, then the same cells again in the same kernel, with cell ids.

    nbval (like nbclient) sends a cell's code with no metadata, so the kernel sees no cell
    id (``jupyter_client``'s ``execute`` has no metadata argument): a ``%%chat`` cell then
    appends, as in a terminal. JupyterLab, Notebook 7 and VS Code send ``cellId``; with it,
    running a notebook again must replace its turns, not append to them.
    """
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:
        return items
    out, group = [], []

    def flush():
        if not group:
            return
        for item in group:
            twin = IPyNbCell.from_parent(item.parent, name=f"{item.name} (run 2)",
                                         cell_num=item.cell_num, cell=item.cell,
                                         options=item.options)
            for mark in item.own_markers:  # e.g. the skip above (add_marker's own steps)
                twin.keywords[mark.name] = mark
                twin.own_markers.append(mark)
            out.append(twin)
        for item in out[-2 * len(group):]:
            _send_cell_id(item)
        group.clear()

    for item in items:
        if isinstance(item, IPyNbCell):
            if group and item.parent is not group[-1].parent:
                flush()
            group.append(item)
            out.append(item)
        else:
            flush()
            out.append(item)
    flush()
    return out


def _send_cell_id(item):
    """Make nbval send ``item``'s cell id (``cellId``) with its code, as JupyterLab does.

    History is stored too (execution counts), as in JupyterLab.
    """
    run = item.runtest
    cell_id = item.cell.get("id")

    def runtest():
        kernel = item.parent.kernel

        def execute_cell_input(cell_input, allow_stdin=None):
            content = {"code": cell_input, "silent": False, "store_history": True,
                       "user_expressions": {}, "allow_stdin": bool(allow_stdin),
                       "stop_on_error": False}
            msg = kernel.kc.session.msg("execute_request", content,
                                        metadata={"cellId": cell_id} if cell_id else {})
            kernel.kc.shell_channel.send(msg)
            return msg["header"]["msg_id"]

        kernel.execute_cell_input = execute_cell_input
        try:
            run()
        finally:
            del kernel.execute_cell_input

    item.runtest = runtest
