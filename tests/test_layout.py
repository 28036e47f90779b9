"""The layout of the tests, as ``docs/development.md`` ('Tests mirror the
package') writes it down: no test module imports another, and every module
of the package has a test file of its own or a row in that page's table of
the modules tested through others."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "pyro_distributed"
PAGE = ROOT / "docs" / "development.md"


def imported_modules(path: Path) -> set[str]:
    """The dotted names that ``path`` imports, with its relative imports resolved
    (``from . import x`` counts as importing ``<package>.x``)."""
    package = list(path.relative_to(ROOT).parent.parts)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            found.add(".".join(module))
            found.update(".".join([*module, alias.name]) for alias in node.names)
    return found


def test_no_test_module_imports_another() -> None:
    offenders = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        others = sorted(
            name
            for name in imported_modules(path)
            if name.startswith("tests.")
            and name.rsplit(".", 1)[-1].startswith("test_")
            and (ROOT / (name.replace(".", "/") + ".py")).is_file()
        )
        if others:
            offenders[str(path.relative_to(ROOT))] = others
    assert not offenders, f"move what they share into tests/support/: {offenders}"


def listed_without_a_test_file() -> set[str]:
    """The modules in the page's table of modules tested through others."""
    text = PAGE.read_text()
    section = text[text.index("## Tests mirror the package") :]
    listed = set()
    for row in re.findall(r"^\| (`[^|]*) \|", section, re.MULTILINE):
        folder = ""
        for name in re.findall(r"`([^`]+\.py)`", row):
            if "/" in name:
                folder, _, name = name.rpartition("/")
            listed.add(f"{folder}/{name}" if folder else name)
    return listed


def test_every_module_has_a_test_file_or_says_which_tests_cover_it() -> None:
    without = {
        str(module.relative_to(PACKAGE))
        for module in PACKAGE.rglob("*.py")
        if module.name != "__init__.py"
        and not (TESTS / module.relative_to(PACKAGE).parent / f"test_{module.name}").is_file()
    }
    listed = listed_without_a_test_file()
    assert not without - listed, (
        "modules without tests/<same path>/test_<name>.py, missing from the table in "
        f"docs/development.md ('Tests mirror the package'): {sorted(without - listed)}"
    )
    assert not listed - without, (
        f"listed, but have a test file or are gone: {sorted(listed - without)}"
    )
