"""Sphinx configuration of nbkv's documentation (MyST Markdown, pydata-sphinx-theme, myst-nb).

Offline by design: no intersphinx, and the lessons render from their committed outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

project = "nbkv"
author = "nbkv contributors"
copyright = "nbkv contributors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "nbkv_docs",
]

# the six lessons render from the outputs saved in notebooks/ (make notebooks), never run here
nb_execution_mode = "off"
# a chart's output is plotly's JSON plus a PNG: the site shows the PNG, and myst-nb's warning
# for the JSON it skips is silenced; docs/_ext/nbkv_docs.py checks every lesson output instead
suppress_warnings = ["mystnb.unknown_mime_type"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
templates_path: list[str] = []
html_static_path = ["_static"]
html_theme = "pydata_sphinx_theme"
html_title = "nbkv"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}

autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "undoc-members": False}

# Broken cross-references are errors (make test builds with -W -n). A docstring's reference
# to a name that exists in the code but is not on the API pages stays plain text
# (docs/_ext/nbkv_docs.py: resolve_short_name); one to a name that does not exist fails.
nitpicky = True
