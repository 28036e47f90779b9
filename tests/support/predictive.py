"""The prediction workload: a trained guide and ``Predictive`` split by samples
or by data (``tests/evaluation/test_predictive.py`` and the same on Horovod)."""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

N = 7  # data points: divides by neither 2 nor 3
SAMPLES = 10  # divides by neither 3 nor 4


def data() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, N)


def model(x: torch.Tensor) -> None:
    slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
    with pd.data_plate("data", x):
        pyro.deterministic("mean", slope * x)
        local = pyro.sample("local", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(slope * x + local, 0.5), obs=None)


def trained_guide() -> AutoNormal:
    # Only the global site is guided; the same parameters on every worker.
    guide = AutoNormal(pyro.poutine.block(model, expose=["slope"]))
    torch.manual_seed(0)
    guide(data())
    return guide


def by_samples(seed: int | None, gather: str) -> Any:
    if seed is None:
        pd.set_rng_seed(3)
    predictive = pd.Predictive(
        model, guide=trained_guide(), num_samples=SAMPLES, seed=seed, gather=gather
    )
    return predictive(data())


def by_data(seed: int | None) -> Any:
    slopes = torch.linspace(0.5, 2.0, SAMPLES)
    predictive = pd.Predictive(model, posterior_samples={"slope": slopes}, split="data", seed=seed)
    return predictive(data())
