"""A run trained under DiLoCo, resumed from a Lightning checkpoint between two
sync points, continues bitwise.

``scripts/fit_with_hook.py --diloco`` at 2 workers trains 8 steps under
``DiLoCo(period=5)``: sync points after steps 1 and 6, each worker alone in
between. Lightning's ``ModelCheckpoint`` writes a file every 2 steps; the one
of step 4 (an epoch's end, where Lightning resumes a plain ``DataLoader``
exactly) falls between two sync points, so it must hold each worker's own
parameters and optimizer state, and the outer optimizer's period start. A
run resumed from it must end with the straight run's parameters and losses on
every worker, bitwise: for the module's own torch optimizer, and for a Pyro
optimizer of an ``SVI`` the module holds (``--svi``: scvi-tools' Pyro plans),
which the strategy wraps only as training starts, after Lightning restored
the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_resume_with_hook import EXTRA_STEPS, RESUMED_AT, run


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
