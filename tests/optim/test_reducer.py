"""The reducer (optim/reducer.py): one plan per set of tensors, and one scaling
of local gradients, the exchange's own.

What the steady state must not do again is observed on the plan itself:
the same plan, the same bucket plan and the same multi-tensor groups step
after step; a new plan when the tensors change (a parameter added, a
checkpoint loaded), on every worker alike.

An owned local row's gradient never travels; the reducer scales it with the
operations the exchange applies to an average (``GradientSync.average_alone_``),
so that owned rows end bitwise those of the replicated run at any W, with
compression too (the replicated run sends local rows in half precision).
The case: a ``PyroModule`` model, ``AutoNormal`` with ``create_plates``,
``module_local_params=True``, torch Adam, at W=3; and the same model under
SVI. One bucket per parameter and no overlap, as in
``tests/local/test_ownership.py``, so that global parameters travel in the
same buffers in both runs (gloo's ring sums a buffer's segments in an order
that depends on their place at W=3).
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
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule

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
    epoch = optim._reducer._epoch
    plan = None if epoch is None else epoch.plan
    assert plan is not None and optim._stepper is not None
    exchange = plan.exchange
    return {
        "plan": plan,
        "proposal": None if exchange is None else exchange.proposal,
        "buckets": None if exchange is None else exchange.buckets,
        "groups": optim._stepper._groups,
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
    dropped = optim._reducer._epoch is None
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
        assert result["dropped"], "loading a checkpoint ends the epoch, and its plan"
        assert result["exchanges"] is (world_size == 2)
        if world_size == 2:
            # The proposal is made again at the end of a plan's first step,
            # once its new tensors were synchronised, and then kept; the
            # buckets once per set of tensors, and again after the load, which
            # ends everything the exchange knew (its buckets included).
            assert same["proposal"] == [True, True, False, True, True, False]
            assert same["buckets"] == [True, True, False, True, True, False]
    if world_size == 2:
        assert torch.equal(results[0]["loc"], results[1]["loc"])


GROUPS = 150
BATCH = 30
STEPS = 25


class Groups(PyroModule):
    def forward(self, y: torch.Tensor) -> None:
        tau = pyro.sample("tau", dist.Normal(0.0, 2.0))
        with pyro.plate("groups", GROUPS, subsample_size=BATCH) as idx:
            b = pyro.sample("b", dist.Normal(tau, 1.0))
            pyro.sample("y", dist.Normal(b, 0.5), obs=y[idx])


def plates(y: torch.Tensor) -> pyro.plate:
    return pyro.plate("groups", GROUPS, subsample_size=BATCH)


def trained(own: bool, front_end: str, compression: str) -> dict[str, Any]:
    torch_path = front_end == "torch"
    pyro.settings.set(module_local_params=torch_path)
    try:
        pd.set_rng_seed(0)
        y = torch.randn(GROUPS, generator=torch.Generator().manual_seed(2)) + 1.0
        model = Groups()
        guide = AutoNormal(model, create_plates=plates)
        options: dict[str, Any] = {
            "bucket_cap_mb": 1e-9,
            "overlap": False,
            "compression": compression,
        }
        sharded = {"own_local_params": own, "by_block": True}
        if torch_path:
            loss_fn = Trace_ELBO()(model, guide)
            with pd.shard_subsamples(**sharded):
                loss_fn(y)  # creates the parameters; under ownership, cuts them
            optimizer = pd.DistributedTorchOptimizer(
                torch.optim.Adam(loss_fn.parameters(), lr=0.02), **options
            )
            for _ in range(STEPS):
                optimizer.zero_grad()
                with pd.shard_subsamples(**sharded):
                    loss_fn(y).backward()
                optimizer.step()
            named = dict(loss_fn.named_parameters())
        else:
            optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.02}), **options)
            svi = SVI(model, guide, optim, Trace_ELBO())
            for _ in range(STEPS):
                with pd.shard_subsamples(**sharded):
                    svi.step(y)
            named = dict(pyro.get_param_store().named_parameters())
        module = loss_fn if torch_path else None
        local = {name: pd.local_rows(name, module=module)[0] for name in named if ".b" in name}
        return {
            "values": {name: p.detach().clone() for name, p in named.items()},
            "local": local if own else {},
        }
    finally:
        pyro.settings.set(module_local_params=False)


@pytest.mark.parametrize(
    ("front_end", "compression"), [("torch", "none"), ("torch", "fp16"), ("svi", "fp16")]
)
def test_owned_rows_are_bitwise_the_replicated_runs_at_three_workers(
    front_end: str, compression: str
) -> None:
    replicated = run_workers(trained, False, front_end, compression, world_size=3, timeout=600)
    owned = run_workers(trained, True, front_end, compression, world_size=3, timeout=600)
    for rank, (mine, reference) in enumerate(zip(owned, replicated, strict=True)):
        assert mine["local"], "the group parameters are local"
        for name, value in reference["values"].items():
            if name in mine["local"]:
                rows = mine["local"][name]
                assert rows.tolist() == list(range(rank * 50, (rank + 1) * 50))
                differ = int((mine["values"][name] != value[rows]).sum())
                assert differ == 0, f"{name}: {differ} rows differ on worker {rank}"
            else:
                assert torch.equal(mine["values"][name], value), f"{name} on worker {rank}"
