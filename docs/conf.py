"""Sphinx configuration of the pyro-distributed site.

Build it with ``python -m sphinx -W --keep-going docs docs/_build/html`` (the
docs extra: ``pip install -e ".[docs]"``). The build runs offline: no
intersphinx inventories are fetched, so references to torch's, Pyro's and
Lightning's names are either written as plain literals in the docstrings or
listed in ``nitpick_ignore`` below, each with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import pyro_distributed  # noqa: E402 (after the path is set)

project = "pyro-distributed"
author = "the pyro-distributed authors"
copyright = "2026, the pyro-distributed authors"
release = pyro_distributed.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "sphinx_copybutton",
    "public_api",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Every cross-reference must resolve (-W turns a broken one into an error).
nitpicky = True
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
autoclass_content = "both"

# References that the Python domain cannot resolve go through
# ``_ext/public_api.py``: a public object named by its defining module links to
# its public entry, a target that exists (an internal, or torch's, Pyro's and
# Lightning's names, whose inventories cannot be fetched offline) is shown as
# code, and a target that exists nowhere fails the build. Nothing is ignored.
nitpick_ignore: list[tuple[str, str]] = []

html_theme = "furo"
html_title = f"pyro-distributed {release}"
html_static_path: list[str] = []
copybutton_prompt_text = r"\$ "
copybutton_prompt_is_regexp = True
