"""nbval runs the notebooks; ``05_remote_engine.ipynb`` needs the llama-server binary.

Without it the notebook's cells are skipped with a clear message (``make test`` builds the
binary first and sets ``NBKV_REQUIRE_SERVER``, so there it always runs).
"""

from __future__ import annotations

import os

import pytest

from nbkv.server import binary


def pytest_collection_modifyitems(config, items):
    if binary() is not None or os.environ.get("NBKV_REQUIRE_SERVER"):
        return
    skip = pytest.mark.skip(reason="05_remote_engine.ipynb needs llama-server: run "
                                   "`make llama-server`")
    for item in items:
        if "05_remote_engine" in str(item.fspath):
            item.add_marker(skip)
