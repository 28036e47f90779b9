"""A run trained through LowRankHook, or under DiLoCo, resumed from a Lightning
checkpoint, continues bitwise.

At 2 workers with overlap, and at 3 without (the layout the performance
guide names for bitwise results from three workers on).

``scripts/fit_with_hook.py --hook`` at 2 workers (4 steps per epoch) trains
8 steps through ``LowRankHook(rank=2, warmup_steps=2)``, writing a checkpoint
every 2 steps. A new run resumed from the step-4 checkpoint, when the hook has
compressed two steps, must end with the straight run's parameters and losses,
bitwise: the checkpoint holds every worker's warm-start factors and error
feedback, and the strategy hands each worker its own back.

The control resumes from the same file with the hook's state taken out (as a
file written before checkpoints held it): the hook then starts afresh, with a
warning, and the run's losses and parameters leave the straight run's after
the first resumed step. So the state in the file is what makes the resume
exact.

Lightning before 2.5 runs one step more after a resume than the straight run
made (Lightning-AI/pytorch-lightning#19403, fixed in 2.5.0): there the resumed
run ends at step 9, and its parameters are compared at step 8.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from packaging.version import Version

from ..support.harness import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "fit_with_hook.py"
# Lightning-AI/pytorch-lightning#19403: one extra step after a resume before 2.5
EXTRA_STEPS = 1 if Version(lightning.__version__) < Version("2.5") else 0
RESUMED_AT = 4
#: Where the strategy keeps its entries in Lightning's checkpoint, and the hooks' states there.
KEY, EXTENSIONS = "pyro_distributed", "extensions"


def run(
    out: Path, *options: str, workers: int = 2, hook: bool = True
) -> tuple[list[dict[str, Any]], str]:
    """Each worker's record, and the end of the run's output (``hook``: through
    ``LowRankHook``)."""
    command = [sys.executable, str(SCRIPT), *(["--hook"] if hook else []), "--out", str(out)]
    command += list(options)
    command += ["--devices", str(workers)]
    code, output = run_script(command, ROOT, timeout=900)
    assert code == 0, f"exit {code}\n{output}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(workers)], output


def without_hook_state(checkpoint: Path, target: Path) -> Path:
    """``checkpoint`` written again without the hooks' states; it must have held
    a compressed state on every worker, errors of their own."""
    saved = torch.load(checkpoint, weights_only=False)
    (states,) = saved[KEY].pop(EXTENSIONS)  # one optimizer: its state on each worker
    assert len(states) == 2
    errors = []
    for rank, state in enumerate(states):
        (bucket,) = state["comm_hook"].values()
        assert bucket["matrices"] == [0, 1], rank  # both 20x16 matrices compressed
        assert len(bucket["q"]) == len(bucket["error"]) == 2, rank
        errors.append(bucket["error"])
    assert not any(map(torch.equal, *errors)), "each worker's error feedback is its own"
    torch.save(saved, target)
    return target


def test_a_run_resumed_through_a_low_rank_hook_continues_bitwise(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    straight, _ = run(
        tmp_path / "straight", "--save-every", "2", "--checkpoint-dir", str(directory)
    )
    checkpoint = directory / f"step={RESUMED_AT}.ckpt"
    resumed, output = run(tmp_path / "resumed", "--resume", str(checkpoint))
    assert "starts afresh" not in output
    stripped = without_hook_state(checkpoint, tmp_path / "no-hook-state.ckpt")
    afresh, output = run(tmp_path / "afresh", "--resume", str(stripped))
    assert "holds no state of the communication hook or step policy: it starts afresh" in output
    after = 8 - RESUMED_AT
    for rank, (whole, again, control) in enumerate(zip(straight, resumed, afresh, strict=True)):
        assert whole["global_step"] == 8
        assert again["global_step"] == control["global_step"] == 8 + EXTRA_STEPS
        assert len(again["losses"]) == len(control["losses"]) == after + EXTRA_STEPS
        assert whole["hook_state"], "the hook kept state to the end"
        assert again["losses"][:after] == whole["losses"][RESUMED_AT:], f"worker {rank}"
        assert (
            set(again["params"])
            == set(whole["params"])
            == {
                "guide.locs.w_unconstrained",
                "guide.scales.w_unconstrained",
            }
        )
        for name, value in whole["params"].items():
            assert value.shape == (20, 16)
            assert torch.equal(again["params"][name], value), (rank, name)
        # Without the hook's state: the first resumed step's loss is computed
        # before any exchange, from the restored parameters and RNG, and is
        # the same; every step after it has been through a fresh hook.
        assert control["losses"][0] == whole["losses"][RESUMED_AT], f"worker {rank}"
        later = zip(control["losses"][1:after], whole["losses"][RESUMED_AT + 1 :], strict=True)
        assert all(a != b for a, b in later), (rank, control["losses"], whole["losses"])
        for name, value in whole["params"].items():
            assert not torch.equal(control["params"][name], value), (rank, name)


def test_at_three_workers_without_overlap_a_resumed_run_continues_bitwise(tmp_path: Path) -> None:
    # From three workers on, bitwise with overlap=False: the first steps after
    # a resume run without overlap (the performance guide's rule).
    directory = tmp_path / "checkpoints"
    options = ("--no-overlap", "--save-every", "2", "--checkpoint-dir", str(directory))
    straight, _ = run(tmp_path / "straight", *options, workers=3)
    checkpoint = directory / f"step={RESUMED_AT}.ckpt"
    resumed, output = run(
        tmp_path / "resumed", "--no-overlap", "--resume", str(checkpoint), workers=3
    )
    assert "starts afresh" not in output
    after = 8 - RESUMED_AT
    for rank, (whole, again) in enumerate(zip(straight, resumed, strict=True)):
        assert whole["global_step"] == 8 and whole["hook_state"], rank
        assert again["losses"][:after] == whole["losses"][RESUMED_AT:], f"worker {rank}"
        for name, value in whole["params"].items():
            assert torch.equal(again["params"][name], value), (rank, name)


# DiLoCo (step_policy=), between two sync points.
#
# A run trained under DiLoCo, resumed from a Lightning checkpoint between two
# sync points, continues bitwise.
#
# ``scripts/fit_with_hook.py --diloco`` at 2 workers trains 8 steps under
# ``DiLoCo(period=5)``: sync points after steps 1 and 6, each worker alone in
# between. Lightning's ``ModelCheckpoint`` writes a file every 2 steps; the one
# of step 4 (an epoch's end, where Lightning resumes a plain ``DataLoader``
# exactly) falls between two sync points, so it must hold each worker's own
# parameters and optimizer state, and the outer optimizer's period start. A
# run resumed from it must end with the straight run's parameters and losses on
# every worker, bitwise: for the module's own torch optimizer, and for a Pyro
# optimizer of an ``SVI`` the module holds (``--svi``: scvi-tools' Pyro plans),
# which the strategy wraps only as training starts, after Lightning restored
# the checkpoint.


@pytest.mark.parametrize("plan", ["module", "svi"])
def test_a_run_resumed_under_diloco_between_sync_points_continues_bitwise(
    tmp_path: Path, plan: str
) -> None:
    directory = tmp_path / "checkpoints"
    chosen = ("--diloco", *(["--svi"] if plan == "svi" else []))
    options = (*chosen, "--save-every", "2", "--checkpoint-dir", str(directory))
    straight, _ = run(tmp_path / "straight", *options, hook=False)
    checkpoint = directory / f"step={RESUMED_AT}.ckpt"
    saved = torch.load(checkpoint, weights_only=False)["pyro_distributed"]
    # One optimizer: each worker's state (the module's, or the SVI's).
    (states,) = saved["extensions"] if plan == "module" else [saved["pyro_optim_extensions"]]
    assert all("parameters" in state for state in states), "saved between two sync points"
    resumed, _ = run(tmp_path / "resumed", *chosen, "--resume", str(checkpoint), hook=False)
    after = 8 - RESUMED_AT
    for rank, (whole, again) in enumerate(zip(straight, resumed, strict=True)):
        assert whole["in_sync"] is False and whole["global_step"] == 8, rank
        assert again["global_step"] == 8 + EXTRA_STEPS
        assert again["losses"][:after] == whole["losses"][RESUMED_AT:], f"worker {rank}"
        for name, value in whole["params"].items():
            assert torch.equal(again["params"][name], value), (rank, name)
    # Between sync points the workers differed: the file held each one's own.
    first, second = (whole["params"] for whole in straight)
    assert any(not torch.equal(first[name], second[name]) for name in first)
