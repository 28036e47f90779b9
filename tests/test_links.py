"""Relative links in the pages GitHub renders: the README, docs/ and benchmarks/.

Every link ``[text](path)`` or ``[text](path#anchor)`` (images included) that is
not a web or mail address must name a file of the repository, relative to the
page that links it, and its anchor must be a heading of that file (GitHub's
and MyST's slugs agree for the headings we write). A file that git ignores is a
build product, absent from a clone and from GitHub: ``docs/benchmarks/results/``
is written by ``docs/conf.py`` at every build from the files in
``benchmarks/``, and ``docs/_build/`` is the site. A page links the source file
instead (``../../benchmarks/RESULTS.md``); the Sphinx build points such a link
at the page's copy in the site.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = ("http://", "https://", "mailto:")


def ignored_by_git(paths: list[Path]) -> set[Path]:
    """The paths among ``paths`` that .gitignore ignores (build products)."""
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(str(path.relative_to(ROOT)) for path in paths),
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode in (0, 1), f"git check-ignore failed: {done.stderr}"
    return {ROOT / line for line in done.stdout.splitlines()}


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/ and benchmarks/, build products left out."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found += sorted((ROOT / "benchmarks").rglob("*.md"))
    products = ignored_by_git(found)
    return [page for page in found if page not in products]


def without_code(text: str) -> str:
    """``text`` with its fenced code blocks blanked (a link there is code, not a link)."""
    return FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)


def links(page: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every relative link on ``page``."""
    text = without_code(page.read_text())
    return [
        (text.count("\n", 0, match.start()) + 1, match.group(1))
        for match in LINK.finditer(text)
        if not match.group(1).startswith(EXTERNAL)
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (MyST's default slug is the same)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor on ``page``, numbered as GitHub numbers repeated ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(without_code(page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links() -> list[str]:
    checked: list[tuple[Path, int, str, Path, str]] = []
    for page in pages():
        for line, target in links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            checked.append((page, line, target, resolved, anchor))
    products = ignored_by_git([found for *_, found, _ in checked if found.is_relative_to(ROOT)])
    broken = []
    for page, line, target, resolved, anchor in checked:
        where = f"{page.relative_to(ROOT)}:{line}: ({target})"
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{where} leaves the repository")
        elif resolved in products:
            broken.append(f"{where} is a build product, ignored by git")
        elif not resolved.exists():
            broken.append(f"{where} names no file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{where} names no heading of {resolved.relative_to(ROOT)}")
    return broken


def test_the_pages_have_links_to_check() -> None:
    assert any(links(ROOT / "README.md")), "the README has no relative link: is LINK right?"


def test_every_relative_link_names_a_file_of_the_repository() -> None:
    broken = broken_links()
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        (
            "Sparse local steps: O(batch) per step, not O(N/W)",
            "sparse-local-steps-obatch-per-step-not-onw",
        ),
        ("`pd.launch` in a [notebook](x.md)", "pdlaunch-in-a-notebook"),
        ("Local parameters owned by their worker", "local-parameters-owned-by-their-worker"),
    ],
)
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
