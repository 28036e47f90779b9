"""Small models shared by the tests, importable by worker processes."""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.distributions import constraints

import pyro_distributed as pd

TOTAL = 1000  # the size of the full data set the plates pretend to subsample


def regression_data(seed: int, n: int, dim: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator)
    y = x @ torch.arange(1.0, dim + 1) + 0.5 + 0.1 * torch.randn(n, generator=generator)
    return x, y


def bayesian_regression(x: torch.Tensor, y: torch.Tensor) -> None:
    """Latent weights, so the guide and the ELBO are stochastic."""
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", TOTAL, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(x @ w + b, 0.1), obs=y)


def point_regression(x: torch.Tensor, y: torch.Tensor) -> None:
    """Parameters only, no latent variables: the loss is deterministic.

    The plate scales each worker's loss by TOTAL / len(x), so the average of
    W workers' gradients equals one process's gradient on all W batches.
    """
    w = pyro.param("w", torch.zeros(x.shape[1]))
    b = pyro.param("b", torch.tensor(0.0))
    scale = pyro.param("scale", torch.tensor(1.0), constraint=constraints.positive)
    with pyro.plate("data", TOTAL, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(x @ w + b, scale), obs=y)


def empty_guide(x: torch.Tensor, y: torch.Tensor) -> None:
    pass


def param_values() -> dict[str, torch.Tensor]:
    """Every parameter's unconstrained value, detached, by name."""
    return {name: p.detach().clone() for name, p in pyro.get_param_store().named_parameters()}


def train_bayesian_regression(optim: pyro.optim.PyroOptim, data_seed: int, steps: int) -> SVI:
    x, y = regression_data(data_seed, 32)
    guide = AutoNormal(bayesian_regression)
    svi = SVI(bayesian_regression, guide, optim, Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)
    return svi


def train_steps(optim: pd.DistributedOptimizer, steps: int, on_step: Any = None) -> None:
    """``steps`` steps of ``optim`` on parameter ``p``, whose gradient differs by worker."""
    p = pyro.param("p", torch.ones(3)).unconstrained()
    for step in range(1, steps + 1):
        if on_step is not None:
            on_step(step)
        (p * (pd.rank() + 1.0)).sum().backward()
        optim([p])
        p.grad = None
