"""The step's plan (optim/plan.py): made once per set of tensors, dropped to forget.

What the steady state must not do again is observed on the plan itself:
the same plan, the same bucket plan and the same multi-tensor groups step
after step; a new plan when the tensors change (a parameter added, a
checkpoint loaded), on every worker alike.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd

from ..support.harness import run_workers


def model(y: torch.Tensor, extra: bool) -> None:
    loc = pyro.param("loc", torch.zeros(3))
    if extra:  # a parameter that joins at a later step
        loc = loc + pyro.param("shift", torch.zeros(3))
    pyro.sample("y", dist.Normal(loc, 1.0).to_event(1), obs=y)


def guide(y: torch.Tensor, extra: bool) -> None:
    pass


KEPT = ("plan", "proposal", "buckets", "groups")


def kept(optim: pd.DistributedOptimizer) -> dict[str, Any]:
    """What the step keeps, at one step (the objects themselves)."""
    plan = optim._step._plan
    assert plan is not None
    exchange = plan.exchange
    return {
        "plan": plan,
        "proposal": None if exchange is None else exchange.proposal,
        "buckets": None if exchange is None else exchange.buckets,
        "groups": plan.groups,
        "stepped": len(plan.stepped),
    }


def same_as_before(steps: list[dict[str, Any]]) -> dict[str, list[bool]]:
    """Per kept object, whether each step had the very object of the step before."""
    return {key: [now[key] is before[key] for before, now in pairwise(steps)] for key in KEPT}


def svi_steps(path: str) -> dict[str, Any]:
    pyro.clear_param_store()
    y = torch.full((3,), float(pd.rank() + 1))
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), overlap=True)
    svi = SVI(model, guide, optim, Trace_ELBO())
    steps = []
    for step in range(6):
        svi.step(y, step >= 3)
        steps.append(kept(optim))
    pd.save_checkpoint(path, optim)
    pd.load_checkpoint(path, optim)  # replaces the tensors
    dropped = optim._step._plan is None
    svi.step(y, True)
    return {
        "same": same_as_before([*steps, kept(optim)]),
        "stepped": [record["stepped"] for record in steps],
        "exchanges": steps[0]["buckets"] is not None,
        "dropped": dropped,
        "armed": optim.sync is not None and optim.sync.overlap_armed,
        "loc": pyro.param("loc").detach().clone(),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_steady_state_reuses_one_plan_and_a_change_makes_a_new_one(
    world_size: int, tmp_path: Path
) -> None:
    results = run_workers(svi_steps, str(tmp_path / "run.pt"), world_size=world_size)
    for result in results:
        same = result["same"]
        # Steps 0-2 step "loc"; steps 3-5 also "shift"; step 6 follows a load.
        assert same["plan"] == [True, True, False, True, True, False]
        # The multi-tensor groups (Adam groups exactly) are made once per plan.
        assert same["groups"] == [True, True, False, True, True, False]
        assert result["stepped"] == [1, 1, 1, 2, 2, 2]
        assert result["dropped"], "loading a checkpoint drops the plan"
        assert result["exchanges"] is (world_size == 2)
        if world_size == 2:
            # The proposal is made again at the end of a plan's first step,
            # once its new tensors were synchronised, and then kept; the
            # buckets once per set of tensors, and the same tensors after the
            # load keep theirs.
            assert same["proposal"] == [True, True, False, True, True, False]
            assert same["buckets"] == [True, True, False, True, True, True]
    if world_size == 2:
        assert torch.equal(results[0]["loc"], results[1]["loc"])
