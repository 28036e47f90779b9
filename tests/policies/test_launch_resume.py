"""Two launches under DiLoCo end bitwise where one launch of both does.

The first launch ends between two sync points (5 steps, a period of 3), so
its checkpoint holds every worker's own parameters and optimizer state, and
the outer optimizer's period start and momentum; the launch that resumes from
it must continue as the straight launch did, loss for loss.
"""

from __future__ import annotations

from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd

from ..support.policies import data, guide, model

STEPS = 5  # per launch; the straight launch makes twice as many


def train(steps: int, seed: int | None = None) -> dict[str, Any]:
    if seed is not None:
        pd.set_rng_seed(seed)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), step_policy=pd.DiLoCo(3))
    svi = SVI(model, guide, optim, Trace_ELBO())
    x, y = data()
    losses = [svi.step(x, y) for _ in range(steps)]
    return {"losses": losses, "in_sync": optim.in_sync, "num_steps": optim.num_steps}


@pytest.mark.slow  # three launches
def test_a_launch_resumed_under_diloco_between_sync_points_ends_bitwise() -> None:
    pyro.clear_param_store()
    straight = pd.launch(train, 2 * STEPS, 0, workers=2)
    whole = {name: pyro.param(name).detach().clone() for name in ("weight", "bias")}
    pyro.clear_param_store()
    first = pd.launch(train, STEPS, 0, workers=2)
    assert not first.value["in_sync"]
    second = pd.launch(train, STEPS, workers=2, resume=first)
    assert second.value["num_steps"] == 2 * STEPS
    assert first.value["losses"] == straight.value["losses"][:STEPS]
    assert second.value["losses"] == straight.value["losses"][STEPS:]
    for name, value in whole.items():
        assert torch.equal(pyro.param(name).detach(), value), name
