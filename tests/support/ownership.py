"""The workload of the local-parameter tests: a model with one global latent and a
local latent per row, trained with its rows replicated or owned by their worker
(``tests/local/``, and the same runs under Horovod and MPI)."""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal, init_to_mean
from torch.distributions import constraints

import pyro_distributed as pd
from benchmarks.memory import state_bytes

N = 41  # divides by neither 2 nor 3
D = 3
BATCH = 4
STEPS = 12
ONE_BUCKET_PER_PARAM = 1e-9


def data(size: int = N) -> torch.Tensor:
    return torch.randn(size, D, generator=torch.Generator().manual_seed(2)) + 1.0


def model(x: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0).expand([D]).to_event(1))
    with pyro.plate("data", len(x), subsample_size=BATCH) as idx:
        z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=x[idx])


def guide(x: torch.Tensor) -> None:
    mu_loc = pyro.param("mu_loc", torch.zeros(D))
    pyro.sample("mu", dist.Normal(mu_loc, 1.0).to_event(1))
    with pyro.plate("data", len(x), subsample_size=BATCH):
        init = torch.arange(float(len(x) * D)).reshape(len(x), D) / 100
        loc = pyro.param("z_loc", init, event_dim=1)
        scale = pyro.param(
            "z_scale", torch.ones(len(x), D), constraint=constraints.positive, event_dim=1
        )
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))


def optimizer(name: str) -> pyro.optim.PyroOptim:
    if name == "adam":
        return pyro.optim.Adam({"lr": 0.05})
    return pyro.optim.ClippedAdam({"lr": 0.05, "clip_norm": 0.5, "lrd": 0.99})


def train(own: bool, optim_name: str, guide_name: str, size: int = N) -> dict[str, Any]:
    pd.set_rng_seed(0)
    x = data(size)
    chosen = {
        "hand": lambda: guide,
        "auto": lambda: AutoNormal(model, create_plates=plates),
        # A deterministic init: the replicated run copies worker 0's random
        # initial rows to every worker, while an owner keeps its own.
        "delta": lambda: AutoDelta(model, create_plates=plates, init_loc_fn=init_to_mean),
    }[guide_name]()
    optim = pd.DistributedOptimizer(
        optimizer(optim_name), bucket_cap_mb=ONE_BUCKET_PER_PARAM, overlap=False
    )
    svi = SVI(model, chosen, optim, Trace_ELBO())
    for _ in range(STEPS):
        with pd.shard_subsamples(own_local_params=own, by_block=True):
            svi.step(x)
    store = pyro.get_param_store()
    return {
        "values": {name: value.detach().clone() for name, value in store.named_parameters()},
        "local": {name: pd.local_rows(name) for name in pd.local.registry.local_params()},
        "bytes": state_bytes(dict(store.named_parameters()).values(), optim.optim_objs.values()),
    }


def plates(x: torch.Tensor) -> pyro.plate:
    return pyro.plate("data", len(x), subsample_size=BATCH)


def gathered_and_local_rows() -> dict[str, Any]:
    train(True, "adam", "hand")
    return {
        "gathered": pd.gather_param("z_loc"),
        "everywhere": pd.gather_param("z_loc", to="all"),
        "local": pd.local_rows("z_loc"),
        "global": pd.gather_param("mu_loc"),
    }
