"""Parameters that appear, or come and go, between two sync points.

The first step with new parameters averages gradients under every policy, so
that the new ones take worker 0's values; the others still differ then, and
the policy must not call that step a sync point. Each worker records, after
every step, whether the optimizer says it is in sync and its parameters:
wherever it says so, the workers must hold bitwise the same, and the run's
last sync point must be one.
"""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd

from ..support.harness import run_workers
from ..support.policies import data, make_policy

STEPS = 17


def train(policy_name: str, pattern: str) -> dict[str, Any]:
    """``pattern``: ``"late"``, an offset used from step 6 on; ``"alternate"``,
    used on odd steps only."""
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    x, y = data()

    def model(x: torch.Tensor, y: torch.Tensor, with_offset: bool) -> None:
        weight = pyro.param("weight", torch.zeros(6, 3))
        mean = x @ weight
        if with_offset:
            mean = mean + pyro.param("offset", torch.zeros(3))
        with pyro.plate("data", 240, subsample_size=len(x)):
            pyro.sample("y", dist.Normal(mean, 0.5).to_event(1), obs=y)

    optim = pd.DistributedOptimizer(
        pyro.optim.Adam({"lr": 0.05}), step_policy=make_policy(policy_name)
    )
    svi = SVI(model, lambda *args: None, optim, Trace_ELBO())
    in_sync, params = [], []
    for step in range(STEPS):
        with_offset = step >= 6 if pattern == "late" else step % 2 == 1
        svi.step(x, y, with_offset)
        in_sync.append(optim.in_sync)
        params.append(
            {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
        )
    return {"in_sync": in_sync, "params": params}


@pytest.mark.parametrize("pattern", ["late", "alternate"])
@pytest.mark.parametrize("policy_name", ["local_sgd", "diloco"])
def test_a_sync_point_is_one_when_parameters_come_and_go(policy_name: str, pattern: str) -> None:
    first, second = run_workers(train, policy_name, pattern)
    assert first["in_sync"] == second["in_sync"]
    synced = [step for step, flag in enumerate(first["in_sync"]) if flag]
    assert len(synced) >= 3 and synced[-1] >= STEPS - 4, synced  # averages keep coming
    for step in synced:
        mine, theirs = first["params"][step], second["params"][step]
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (step, name)
