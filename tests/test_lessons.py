"""The teaching notebooks as committed: outputs current, readable with no kernel, small.

Their outputs come from ``make notebooks`` (``tools/notebooks.py``); nbval runs them again
in CI (``make test``). A notebook whose cells changed since its outputs were made, or made
by another nbkv version, fails here until ``make notebooks`` runs again.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

import nbkv

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("nbkv_notebooks_tool",
                                               ROOT / "tools" / "notebooks.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def outputs(nb):
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_outputs_are_current(path):
    why = tool.stale(path, nbkv.__version__)
    assert not why, f"{path.name}: {why}: run `make notebooks` and commit the result"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_committed_notebook_reads_without_a_kernel(path):
    """GitHub and nbviewer show HTML and SVG outputs: the figures, the static snapshots."""
    nb = json.loads(path.read_text())
    assert path.stat().st_size <= tool.MAX_BYTES
    assert "widgets" not in nb["metadata"]  # no widget state: the snapshots stand in
    outs = outputs(nb)
    assert not any(tool.WIDGET_VIEW in o.get("data", {}) for o in outs)
    assert any({"text/html", "image/svg+xml"} & set(o.get("data", {})) for o in outs)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(isinstance(c.get("execution_count"), int) for c in code)  # every cell ran
    assert not any(o["output_type"] == "error" for o in outs)


def test_the_digest_follows_the_inputs_and_the_version(tmp_path):
    nb = json.loads(NOTEBOOKS[0].read_text())
    nb["metadata"]["nbkv"] = {"nbkv": "1.0", "inputs": tool.inputs_digest(nb, "1.0")}
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb))
    assert tool.stale(path, "1.0") == ""
    assert "nbkv 1.0, this is 1.1" in tool.stale(path, "1.1")
    edited = copy.deepcopy(nb)
    cell = next(c for c in edited["cells"] if c["cell_type"] == "code")
    cell["source"] = "".join(cell["source"]) + "\n# edited"
    path.write_text(json.dumps(edited))
    assert tool.stale(path, "1.0") == "its cells changed since its outputs were made"
    outputs_only = copy.deepcopy(nb)  # outputs and counts are not inputs
    for c in outputs_only["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    path.write_text(json.dumps(outputs_only))
    assert tool.stale(path, "1.0") == ""
    del nb["metadata"]["nbkv"]
    path.write_text(json.dumps(nb))
    assert tool.stale(path, "1.0") == "it has no outputs from make notebooks"
