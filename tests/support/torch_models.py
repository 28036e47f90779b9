"""Small torch modules with replicated and local parameters, for the torch-native
front end (``DistributedTorchOptimizer``) and the tests that share its models."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule


def small_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


N_LOCAL = 41  # divides by neither 2 nor 3
D_LOCAL = 3
BATCH_LOCAL = 4


class LocalModel(PyroModule):
    def forward(self, x: torch.Tensor) -> None:
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0).expand([D_LOCAL]).to_event(1))
        with pyro.plate("data", N_LOCAL, subsample_size=BATCH_LOCAL) as idx:
            z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
            pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=x[idx])


def local_plates(x: torch.Tensor) -> pyro.plate:
    return pyro.plate("data", N_LOCAL, subsample_size=BATCH_LOCAL)
