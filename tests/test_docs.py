"""The documentation: the site, its reference, and the code it shows.

- The Sphinx site builds with warnings as errors (a broken cross-reference or
  a malformed docstring fails it). ``scripts/test.sh`` builds it once and
  points ``PYRO_DISTRIBUTED_DOCS_HTML`` at the result; without it, the build
  runs here.
- Every name in the ``__all__`` of ``pyro_distributed``,
  ``pyro_distributed.integrations.lightning`` and
  ``pyro_distributed.integrations.scvi`` has an entry in the built reference,
  with a docstring that has an example, and every ``.. warning::`` rule in the
  package's docstrings appears in the reference.
- Every ``:class:``/``:func:``/``:mod:`` reference in the package's docstrings
  to ``pyro_distributed...`` names something that exists, in the modules the
  site does not render too.
- The README's and the guide's code blocks marked ``python runnable`` run, as
  one plain process or, with ``workers=2``, under the real torchrun; a block
  marked ``python file=PATH`` must equal that example's code (after its
  docstring), which ``tests/test_examples.py`` runs.
"""

from __future__ import annotations

import html
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from sphinx.util.inventory import InventoryFile

import pyro_distributed
import pyro_distributed.integrations.lightning
import pyro_distributed.integrations.scvi

from .support.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
PUBLIC = (
    pyro_distributed,
    pyro_distributed.integrations.lightning,
    pyro_distributed.integrations.scvi,
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built HTML site: scripts/test.sh's build, or one made here with -W."""
    built = os.environ.get("PYRO_DISTRIBUTED_DOCS_HTML")
    if built:
        return Path(built)
    out = tmp_path_factory.mktemp("html")
    command = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q"]
    done = subprocess.run(
        [*command, str(DOCS), str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"the docs build failed:\n{done.stdout}\n{done.stderr}"
    return out


def public_names(module: ModuleType) -> list[tuple[str, object]]:
    """``(dotted name, object)`` for every name in ``__all__``, namespaces included."""
    names = []
    for name in module.__all__:
        obj = getattr(module, name)
        names.append((f"{module.__name__}.{name}", obj))
        if inspect.ismodule(obj):
            names += public_names(obj)
    return names


def every_public_name() -> list[tuple[str, object]]:
    return [entry for module in PUBLIC for entry in public_names(module)]


def test_every_public_name_has_an_entry_in_the_reference(site: Path) -> None:
    with open(site / "objects.inv", "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    entries = {
        name: item.uri
        for kind, items in inventory.items()
        if kind.startswith("py:")
        for name, item in items.items()
    }
    missing = [name for name, _ in every_public_name() if name not in entries]
    assert not missing, f"public names without an entry in the API reference: {missing}"
    elsewhere = [name for name, _ in every_public_name() if "api/index" not in entries[name]]
    assert not elsewhere, f"public names documented outside api/index: {elsewhere}"


def test_every_public_name_has_a_docstring_with_an_example() -> None:
    without = [
        name
        for name, obj in every_public_name()
        if not inspect.ismodule(obj) and "Example" not in (inspect.getdoc(obj) or "")
    ]
    assert not without, f"public names whose docstring has no example: {without}"


def package_modules() -> list[ModuleType]:
    prefix = pyro_distributed.__name__ + "."
    names = [m.name for m in pkgutil.walk_packages(pyro_distributed.__path__, prefix)]
    # pyro_distributed.lightning: the old path of integrations.lightning, which
    # only warns and hands out the moved modules (tests/lightning/test_old_paths.py).
    names = [name for name in names if name != "pyro_distributed.lightning"]
    return [pyro_distributed, *(importlib.import_module(name) for name in names)]


def own_doc(obj: object) -> str:
    """``obj``'s own docstring (``inspect.getdoc`` would inherit torch's for an override)."""
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def package_docstrings() -> list[tuple[str, str]]:
    """``(where, docstring)`` of every module, class, function and method of the package."""
    found = []
    for module in package_modules():
        found.append((module.__name__, module.__doc__ or ""))
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            found.append((f"{module.__name__}.{name}", own_doc(obj)))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr != "__doc__" and not isinstance(member, str):
                        found.append((f"{module.__name__}.{name}.{attr}", own_doc(member)))
    return found


def warning_openings(docstring: str) -> list[str]:
    """The first words without reST markup of each ``.. warning::`` block."""
    openings = []
    for match in re.finditer(r"^( *)\.\. warning::[ \t]*(.*)$", docstring, re.MULTILINE):
        rest = docstring[match.end() :].split("\n\n")[0]
        text = " ".join((match.group(2) + " " + rest).split())
        words = []
        for word in text.split():
            if re.search(r"[`:*|\\]", word):
                if len(words) >= 4:
                    break
                words = []
                continue
            words.append(word)
            if len(words) == 6:
                break
        assert len(words) >= 3, f"no plain words to look for in the warning: {text[:80]!r}"
        openings.append(" ".join(words))
    return openings


def page_text(path: Path) -> str:
    text = html.unescape(re.sub(r"<[^>]+>", " ", path.read_text()))
    # Sphinx prints typographic quotes; the docstrings have plain ones.
    text = text.translate(
        str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"'})
    )
    return " ".join(text.split())


def test_every_warning_rule_in_the_code_is_in_the_reference(site: Path) -> None:
    reference = page_text(site / "api" / "index.html")
    rules = [
        (where, opening)
        for where, docstring in package_docstrings()
        for opening in warning_openings(docstring)
    ]
    assert len(rules) >= 30, f"found only {len(rules)} warning rules: is the scan broken?"
    missing = [f"{where}: {opening!r}" for where, opening in rules if opening not in reference]
    assert not missing, "warning rules missing from the API reference:\n" + "\n".join(missing)


ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):`~?(pyro_distributed[\w.]*)`")


def exists(path: str) -> bool:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_cross_references_in_docstrings_name_what_exists() -> None:
    """The site renders the public docstrings only; this covers every module's."""
    sources = sorted((ROOT / "pyro_distributed").rglob("*.py"))
    targets = {
        (str(path.relative_to(ROOT)), target)
        for path in sources
        for target in ROLE.findall(path.read_text())
    }
    assert len(targets) > 50, "found almost no references: is the pattern broken?"
    broken = sorted(f"{where}: {target}" for where, target in targets if not exists(target))
    assert not broken, "references to names that do not exist:\n" + "\n".join(broken)


FENCE = re.compile(r"^```python[ \t]+([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def marked_blocks() -> list[tuple[str, dict[str, str], str]]:
    """``(where, options, code)`` of every fenced block with options after ``python``."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    blocks = []
    for page in pages:
        if "_build" in page.parts or "results" in page.parts:
            continue
        text = page.read_text()
        for match in FENCE.finditer(text):
            words = match.group(1).split()
            options = dict(word.partition("=")[::2] for word in words)
            line = text[: match.start()].count("\n") + 1
            blocks.append((f"{page.relative_to(ROOT)}:{line}", options, match.group(2)))
    return blocks


RUNNABLE = [(where, opts, code) for where, opts, code in marked_blocks() if "runnable" in opts]
COPIES = [(where, opts, code) for where, opts, code in marked_blocks() if "file" in opts]


def test_the_readme_and_the_guide_mark_their_runnable_blocks() -> None:
    where = {entry[0].split(":")[0] for entry in RUNNABLE + COPIES}
    assert "README.md" in where, "the README's quickstart is no longer checked"
    assert sum(name.startswith("docs/guide/") for name in where) >= 4, where


@pytest.mark.parametrize(("where", "options", "code"), COPIES, ids=[c[0] for c in COPIES])
def test_a_block_shown_as_an_example_is_that_example(
    where: str, options: dict[str, str], code: str
) -> None:
    example = (ROOT / options["file"]).read_text()
    body = example.split('"""', 2)[2].strip() if example.startswith('"""') else example.strip()
    assert code.strip() == body, f"{where} differs from {options['file']}"


@pytest.mark.parametrize(("where", "options", "code"), RUNNABLE, ids=[r[0] for r in RUNNABLE])
def test_runnable_block_runs(
    where: str, options: dict[str, str], code: str, tmp_path: Path
) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    workers = int(options.get("workers", "1"))
    if workers == 1:
        command = [sys.executable, str(script)]
    else:
        command = [
            str(BIN / "torchrun"),
            f"--nproc-per-node={workers}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(script),
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
