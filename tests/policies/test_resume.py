"""A run under a step policy, saved at a sync point or between two, continues
bitwise after a rollback in the same process and after a resume with a new
optimizer and policy, on the Pyro path and torch-native, at W=2 and W=3.

The checkpoint holds, for every worker, the policy's state (its step within
the period; DiLoCo's period start and outer momentum), the worker's own
optimizer state, and between sync points its own parameters. A control
resumed with those thrown away must differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd

from ..support.checkpointed import CheckpointedRun, resumed_against_straight
from ..support.harness import run_workers
from ..support.policies import data, guide, make_policy, model

STEPS, ROLLED_TO = 14, 11


class Run(CheckpointedRun):
    """One training run of a front end, with a new optimizer and policy (the
    steps, saves and loads of the hooks' checkpoint tests)."""

    def __init__(self, front_end: str, policy: str, overlap: bool) -> None:
        self.front_end = front_end
        self.x, self.y = data()
        pyro.clear_param_store()
        options: dict[str, Any] = {"step_policy": make_policy(policy), "overlap": overlap}
        if front_end == "pyro":
            self.optim: Any = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), **options)
            self.svi = SVI(model, guide, self.optim, Trace_ELBO())
        else:
            torch.manual_seed(0)
            # BatchNorm's running statistics: each worker's own between sync points.
            self.module = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.BatchNorm1d(3))
            self.optim = pd.DistributedTorchOptimizer(
                torch.optim.Adam(self.module.parameters(), lr=0.05), **options
            )


def resumes(
    front_end: str, policy: str, save_at: int, overlap: bool, folder: str
) -> dict[str, Any]:
    return resumed_against_straight(
        lambda: Run(front_end, policy, overlap),
        f"{folder}/{front_end}-{policy}-{save_at}.pt",
        STEPS,
        save_at,
        ROLLED_TO,
        lambda run: run.optim.forget(),  # the policy, and this worker's own state, afresh
    )


#: (policy, step saved at): DiLoCo at a sync point and between two; the
#: others, which keep less, between two, where each worker's own is saved.
CASES = (("diloco", 5), ("diloco", 7), ("local_sgd_warmup", 7), ("stateless", 7))


def every_case(overlap: bool, folder: str) -> dict[str, dict[str, Any]]:
    return {
        f"{front_end}/{policy}/{save_at}": resumes(front_end, policy, save_at, overlap, folder)
        for front_end in ("pyro", "torch")
        for policy, save_at in CASES
    }


@pytest.mark.parametrize(("world_size", "overlap"), [(2, True), (3, False)])
def test_a_resumed_or_rolled_back_run_under_a_policy_continues_bitwise(
    world_size: int, overlap: bool, tmp_path: Path
) -> None:
    outcomes = run_workers(every_case, overlap, str(tmp_path), world_size=world_size, timeout=300)
    for rank, outcome in enumerate(outcomes):
        for case, found in outcome.items():
            save_at = int(case.split("/")[2])
            # Sync points: after steps 1, 2, 5, 8 (local SGD, warm-up 2, period 3)
            # (and the stateless policy: the same schedule) or 1, 5, 9 (DiLoCo,
            # period 4); step 7 is between two.
            assert found["saved in sync"] == (save_at == 5), (rank, case)
            assert found["start"], (rank, case)
            assert found["rolled back"], f"worker {rank}, {case}: the rollback differs"
            assert found["resumed"], f"worker {rank}, {case}: the resumed run differs"
            assert not found["control"], f"{case}: the saved state made no difference"
