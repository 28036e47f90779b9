"""Sphinx configuration of the pyro-distributed site.

Build it with ``python -m sphinx -W --keep-going docs docs/_build/html`` (the
docs extra: ``pip install -e ".[docs]"``). The build runs offline: no
intersphinx inventories are fetched, so references to torch's, Pyro's and
Lightning's names are either written as plain literals in the docstrings or
listed in ``nitpick_ignore`` below, each with the reason.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from sphinx.application import Sphinx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import pyro_distributed  # noqa: E402 (after the path is set)

# The benchmark results pages are the Markdown files that the scripts in
# benchmarks/ write, copied here at every build (docs/benchmarks/ is ignored by
# git), so that re-running a benchmark updates the site. Each gets a title of
# its own, its headings move one level down, and a link out of benchmarks/
# into docs/ is pointed at the copy's place.
BENCHMARK_PAGES = {
    "README.md": "Method, tuning and profiles",
    "RESULTS.md": "The SVI suite",
    "MPI_RESULTS.md": "The MPI engine",
    "mpi_idle/RESULTS.md": "The MPI engine, idle re-run",
    "torch_native/RESULTS.md": "The torch-native loop",
    "torch_native_small400/RESULTS.md": "The torch-native loop, 400 small parameters",
    "LOCAL_RESULTS.md": "Local parameters",
    "local_sparse_idle/LOCAL_RESULTS.md": "Sparse local steps, idle re-run",
    "torch_native_local/LOCAL_RESULTS.md": "Local parameters on the torch-native loop",
    "CONVERGENCE_LOCAL.md": "Convergence of sparse local steps",
    "LIGHTNING_RESULTS.md": "Lightning against DDPStrategy",
    "LINK_RESULTS.md": "Two hosts on a rate-limited link",
    "link_low_rank/LINK_RESULTS.md": "The low-rank hook on a 1 Gbit/s link",
    "POLICY_RESULTS.md": "Step policies on a 1 Gbit/s link: time to a held-out loss",
    "CELL2LOCATION.md": "cell2location: 678,771 bins, owned spots, counts read by rows",
    "first_step/FIRST_STEP_RESULTS.md": "Many workers' first step against DDP",
    "per_step_idle/gloo/RESULTS.md": "Per-step cost against DDP, idle re-run",
    "per_step_idle/mpi/RESULTS.md": "The MPI engine against two processes, idle re-run",
}


def copy_benchmark_pages() -> None:
    source = ROOT / "benchmarks"
    target = Path(__file__).resolve().parent / "benchmarks" / "results"
    shutil.rmtree(target, ignore_errors=True)
    for name, title in BENCHMARK_PAGES.items():
        text = (source / name).read_text()
        text = re.sub(r"^(#+) ", r"#\1 ", text, flags=re.MULTILINE)
        up = "../" * (name.count("/") + 2)  # docs/benchmarks/results/[sub/] -> docs/
        text = text.replace("](../docs/", "](" + up)
        page = target / name
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"# {title}\n\n{text}")
        for figure in (source / name).parent.glob("*.png"):
            shutil.copy(figure, page.parent / figure.name)


copy_benchmark_pages()


def link_benchmark_copies(app: Sphinx, docname: str, source: list[str]) -> None:
    """Point a page's link to a results file in benchmarks/ at the file's copy.

    A page links the file itself (``../../benchmarks/RESULTS.md``), which is
    what GitHub shows; in the site, which holds no file outside docs/, the
    same link goes to the copy in docs/benchmarks/results/.
    """
    up = "../" * (docname.count("/") + 1)  # from the page's folder to the repository root
    for name in BENCHMARK_PAGES:
        source[0] = re.sub(
            r"\]\(" + re.escape(f"{up}benchmarks/{name}") + r"(?=[#)])",
            "](" + up[3:] + "benchmarks/results/" + name,
            source[0],
        )


def setup(app: Sphinx) -> None:
    app.connect("source-read", link_benchmark_copies)


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
# Our docstrings only: an override without one does not show torch's or Lightning's.
autodoc_inherit_docstrings = False

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
