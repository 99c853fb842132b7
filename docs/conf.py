"""Sphinx configuration: MyST Markdown pages, autodoc API reference, built nitpicky with warnings as errors.

sphinx-build -n -W -b html docs docs/_build/html

Nitpicky (``-n``): a cross-reference to a module, class or function of this package that does not exist fails the
build. References to other libraries are not checked: their inventories (intersphinx) would be downloaded, and the
build runs without a network. ``tests/test_docstring_references.py`` checks the references of the modules these
pages do not render.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # autodoc imports the package from this checkout
os.environ.setdefault("WANDB_MODE", "offline")

project = "lightning_llm"
copyright = "lightning_llm authors"
author = "lightning_llm authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
# The docstrings are Google-style, as Lightning's: "Arguments:", "Attributes:", "Example::".
napoleon_google_docstring = True
napoleon_numpy_docstring = False
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Headings get anchors so pages can link to sections (`page.md#section`).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Re-exported names are documented once, where the public package exports them.
autodoc_inherit_docstrings = False

# Other libraries' names (no intersphinx inventory offline), and the standard library's.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|lightning|numpy|np|pathlib|collections|concurrent|datetime|typing|transformers|deepspeed)\b.*"),
    (r"py:.*", r"(timedelta|Path|Callable|Any|False|True|None|Strategy|L\..*|pl\..*)"),
]

html_theme = "furo"
html_title = "lightning_llm"
