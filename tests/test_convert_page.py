"""The "Convert your script" page's diffs, applied and run as users run them.

``docs/getting-started/convert.md`` shows, as unified diffs, how a
single-device Pyro script becomes a data-parallel one. Three kinds of block:

- the DataLoader case, the diff from ``examples/svi_single_device.py`` to a
  converted ``train.py``: applied here to the example, it must give a script
  that trains on two workers under the real torchrun;
- whole-file diffs (the full-batch and subsampling cases): one hunk from line
  1 with every line of both scripts, so that both sides are read from the
  diff itself; the single-device side runs as one process, the converted
  side on two workers;
- diffs to the converted ``train.py`` (the noise scale): they must apply.

Diffs are applied strictly (:func:`apply_diff`): every hunk where its header
says, every context and removed line as the file has it, so a page whose diff
no longer matches the example fails here.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .support.examples import python_or_torchrun
from .support.harness import run_script

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "getting-started" / "convert.md"
EXAMPLE = ROOT / "examples" / "svi_single_device.py"
EXAMPLE_NAME = "examples/svi_single_device.py"
CONVERTED_NAME = "train.py"
TIMEOUT = 240.0

DIFF_BLOCK = re.compile(r"^```diff[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
EPOCH = re.compile(r"^epoch +(\d+) +loss (\S+)$", re.MULTILINE)
STEP = re.compile(r"^step (\d+) +loss (\S+)$", re.MULTILINE)
FINAL_WEIGHTS = re.compile(r"^weights \[([^]]*)\]", re.MULTILINE)
TRUE_WEIGHTS = (2.0, -1.0, 0.5)


class DiffDoesNotApply(AssertionError):
    """A diff whose hunks do not match the file it is applied to."""


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    lines: tuple[str, ...]  # each with its tag: " ", "-" or "+"


@dataclass(frozen=True)
class Diff:
    old_name: str
    new_name: str
    hunks: tuple[Hunk, ...]

    def side(self, tags: str) -> str:
        """The text of one side of a whole-file diff: ``" -"`` before, ``" +"`` after."""
        lines = [line for hunk in self.hunks for line in hunk.lines if line[0] in tags]
        return "".join(line[1:] + "\n" for line in lines)


def parse_diff(text: str) -> Diff:
    """A unified diff's file names and hunks. An empty line is an empty context
    line (Markdown pages often lose the space that tags it)."""
    lines = text.splitlines()
    if len(lines) < 3 or not lines[0].startswith("--- ") or not lines[1].startswith("+++ "):
        raise DiffDoesNotApply(f"not a unified diff (no ---/+++ header): {text[:80]!r}")
    hunks: list[Hunk] = []
    position = 2
    while position < len(lines):
        header = HUNK.match(lines[position])
        if header is None:
            raise DiffDoesNotApply(f"expected a hunk header, found {lines[position]!r}")
        old_start, old_count, new_start, new_count = (
            int(value) if value is not None else 1 for value in header.groups()
        )
        position += 1
        body: list[str] = []
        while position < len(lines) and not lines[position].startswith("@@"):
            line = lines[position] or " "
            if line[0] not in " -+":
                raise DiffDoesNotApply(f"a hunk line must start with ' ', '-' or '+': {line!r}")
            body.append(line)
            position += 1
        old = sum(line[0] in " -" for line in body)
        new = sum(line[0] in " +" for line in body)
        if (old, new) != (old_count, new_count):
            raise DiffDoesNotApply(
                f"hunk {header.group(0)} holds {old} old and {new} new lines, "
                f"not {old_count} and {new_count}"
            )
        hunks.append(Hunk(old_start, old_count, new_start, new_count, tuple(body)))
    return Diff(lines[0][4:].strip(), lines[1][4:].strip(), tuple(hunks))


def apply_diff(diff: Diff, original: str) -> str:
    """``original`` with ``diff`` applied; every hunk exactly where its header
    says, with no fuzz and no offset, or :class:`DiffDoesNotApply`."""
    old = original.splitlines()
    result: list[str] = []
    taken = 0  # lines of ``old`` consumed so far
    for hunk in diff.hunks:
        start = hunk.old_start - 1 if hunk.old_count else hunk.old_start
        if start < taken:
            raise DiffDoesNotApply(f"hunk at line {hunk.old_start} overlaps the one before")
        result += old[taken:start]
        taken = start
        if hunk.new_count and len(result) + 1 != hunk.new_start:
            raise DiffDoesNotApply(
                f"hunk at old line {hunk.old_start} says new line {hunk.new_start}, "
                f"but lands at {len(result) + 1}"
            )
        for line in hunk.lines:
            tag, text = line[0], line[1:]
            if tag in " -":
                found = old[taken] if taken < len(old) else None
                if found != text:
                    raise DiffDoesNotApply(
                        f"line {taken + 1}: the diff expects {text!r}, the file has {found!r}"
                    )
                taken += 1
            if tag in " +":
                result.append(text)
    return "\n".join(result + old[taken:]) + "\n"


def page_diffs() -> list[Diff]:
    return [parse_diff(block) for block in DIFF_BLOCK.findall(PAGE.read_text())]


def example_diff() -> Diff:
    found = [diff for diff in page_diffs() if diff.old_name == EXAMPLE_NAME]
    assert len(found) == 1, f"{PAGE.name} should show one diff from {EXAMPLE_NAME}"
    return found[0]


def is_whole_file(diff: Diff) -> bool:
    return len(diff.hunks) == 1 and diff.hunks[0].old_start == diff.hunks[0].new_start == 1


def converted_script() -> str:
    """The example with the page's DataLoader diff applied, or a failure that
    shows the diff the page should have."""
    original = EXAMPLE.read_text()
    try:
        return apply_diff(example_diff(), original)
    except DiffDoesNotApply as error:
        raise AssertionError(
            f"the DataLoader diff of {PAGE.relative_to(ROOT)} no longer applies to "
            f"{EXAMPLE_NAME}: {error}. Update the page (or the example) so that it does."
        ) from error


def run(command: list[str]) -> str:
    code, output = run_script(command, ROOT, TIMEOUT)
    assert code == 0, f"exit {code}: {' '.join(command)}\n{output}"
    return output


def assert_trains(losses: list[tuple[str, str]], output: str) -> None:
    """Each step's or epoch's loss printed once (by worker 0 alone), in order,
    every loss finite, the last below the first."""
    indices = [int(index) for index, _ in losses]
    assert len(indices) >= 2, f"no losses printed:\n{output}"
    assert indices == sorted(set(indices)), f"each loss should be printed once:\n{output}"
    values = [float(loss) for _, loss in losses]
    assert all(math.isfinite(value) for value in values), output
    assert values[-1] < values[0], output


def assert_fits(output: str) -> None:
    found = FINAL_WEIGHTS.findall(output)
    assert len(found) == 1, f"the fit should be printed once:\n{output}"
    weights = [float(w) for w in found[0].split(",")]
    for fitted, true in zip(weights, TRUE_WEIGHTS, strict=True):
        assert abs(fitted - true) < 0.1, output


EPOCHS = 3


def test_the_single_device_example_trains_as_one_plain_process() -> None:
    output = run([sys.executable, str(EXAMPLE), f"--num-epochs={EPOCHS}"])
    assert_trains(EPOCH.findall(output), output)
    assert len(EPOCH.findall(output)) == EPOCHS, output
    assert_fits(output)


def test_the_dataloader_diff_applies_to_the_example_and_trains_on_two_workers(
    tmp_path: Path,
) -> None:
    script = tmp_path / CONVERTED_NAME
    script.write_text(converted_script())
    output = run([*python_or_torchrun(2), str(script), f"--num-epochs={EPOCHS}"])
    # Only worker 0 prints: each epoch's loss once, not once per worker.
    assert_trains(EPOCH.findall(output), output)
    assert len(EPOCH.findall(output)) == EPOCHS, output
    assert_fits(output)


def test_the_diffs_to_the_converted_script_apply() -> None:
    converted = converted_script()
    later = [d for d in page_diffs() if d.old_name == CONVERTED_NAME and not is_whole_file(d)]
    assert later, f"{PAGE.name} should show the noise-scale diff to {CONVERTED_NAME}"
    for diff in later:
        apply_diff(diff, converted)


def whole_file_diffs() -> list[Diff]:
    return [diff for diff in page_diffs() if is_whole_file(diff)]


def case(diff: Diff) -> str:
    """Which data case a whole-file diff converts, by the call it adds."""
    after = diff.side(" +")
    if "pd.shard_subsamples()" in after:
        return "subsample"
    return "full_batch" if "pd.data_plate(" in after else "other"


def test_the_page_converts_each_data_case() -> None:
    assert sorted(map(case, whole_file_diffs())) == ["full_batch", "subsample"]
    assert "pd.ShardSampler(" in converted_script()


@pytest.mark.parametrize("diff", whole_file_diffs(), ids=case)
def test_a_whole_file_diff_runs_on_one_device_and_on_two_workers(
    diff: Diff, tmp_path: Path
) -> None:
    before, after = tmp_path / "single_device.py", tmp_path / CONVERTED_NAME
    before.write_text(diff.side(" -"))
    after.write_text(diff.side(" +"))
    assert "pyro_distributed" not in before.read_text()
    for command in ([sys.executable, str(before)], [*python_or_torchrun(2), str(after)]):
        output = run(command)
        assert_trains(STEP.findall(output), output)
        assert_fits(output)


def test_the_example_is_plain_pyro() -> None:
    """The page's starting point is a script a Pyro user already has."""
    assert "pyro_distributed" not in EXAMPLE.read_text()


def test_the_applier_refuses_a_diff_that_does_not_match() -> None:
    original = EXAMPLE.read_text()
    diff = example_diff()
    assert apply_diff(diff, original) == converted_script()
    changed = original.replace("def main(args):", "def main(arguments):")
    with pytest.raises(DiffDoesNotApply, match="the diff expects"):
        apply_diff(diff, changed)
    shifted = "# one more line\n" + original
    with pytest.raises(DiffDoesNotApply):
        apply_diff(diff, shifted)
