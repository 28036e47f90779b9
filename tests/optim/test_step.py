"""The shared step (optim/step.py): one scaling of local gradients, the exchange's own.

An owned local row's gradient never travels; the step scales it with the
operations the exchange applies to an average (``GradientSync.average_alone_``),
so that owned rows end bitwise those of the replicated run at any W, with
compression too (the replicated run sends local rows in half precision).
The case of issue 24: a ``PyroModule`` model, ``AutoNormal`` with
``create_plates``, ``module_local_params=True``, torch Adam, at W=3; and the
same model under SVI. One bucket per parameter and no overlap, as in
``tests/local/test_ownership.py``, so that global parameters travel in the
same buffers in both runs (gloo's ring sums a buffer's segments in an order
that depends on their place at W=3).
"""

from __future__ import annotations

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
