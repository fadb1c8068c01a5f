"""The layers of ``nbkv``, checked by import-linter (``[tool.importlinter]`` in pyproject).

Type-only imports count (``exclude_type_checking_imports = false``): a lower layer that
needs a higher one's type declares a small ``Protocol`` instead. ``make lint`` runs the same
check; here it runs with the tests, so a wrong arrow fails CI either way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(config: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--config", str(config), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept() -> None:
    run = lint_imports(ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and "KEPT" in run.stdout


def test_a_broken_layer_is_found(tmp_path: Path) -> None:
    # the same tool on a contract the code breaks on purpose: core above ui
    cfg = tmp_path / "contracts.toml"
    cfg.write_text('[tool.importlinter]\nroot_package = "nbkv"\n'
                   'exclude_type_checking_imports = false\n\n'
                   '[[tool.importlinter.contracts]]\nname = "upside down"\ntype = "layers"\n'
                   'layers = ["nbkv.core", "nbkv.ui"]\n')
    run = lint_imports(cfg)
    assert run.returncode != 0 and "BROKEN" in run.stdout
