"""The held-out loss workload: data, models with a global latent and with a batch
plate, and the losses each worker computes (``tests/evaluation/test_loss.py``
and the same on Horovod)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from torch.utils.data import TensorDataset

import pyro_distributed as pd

N = 11  # divides by neither 2 nor 3


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(N, 2, generator=generator)
    return x, x @ torch.tensor([1.0, -2.0]) + torch.randn(N, generator=generator)


def global_latent_model(x: torch.Tensor, y: torch.Tensor) -> None:
    """A global latent variable: only a plate sized by the whole data set counts it once."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pd.data_plate("data", x):
        pyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def batch_plate_model(x: torch.Tensor, y: torch.Tensor) -> None:
    """Parameters only, and a plate sized by whatever batch it is given."""
    w = pyro.param("w_point", torch.tensor([0.5, -1.0]))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def empty_guide(x: torch.Tensor, y: torch.Tensor) -> None:
    pass


def delta_guide() -> AutoDelta:
    torch.manual_seed(0)  # the same point estimate on every worker
    guide = AutoDelta(global_latent_model)
    guide(*data())
    return guide


def losses(batch_size: int | None) -> dict[str, float]:
    x, y = data()
    guide = delta_guide()
    return {
        "global": pd.evaluate_loss(
            Trace_ELBO(), global_latent_model, guide, (x, y), batch_size=batch_size
        ),
        "global_reference": Trace_ELBO().loss(global_latent_model, guide, x, y),
        "batch": pd.evaluate_loss(
            Trace_ELBO(), batch_plate_model, empty_guide, TensorDataset(x, y), batch_size=batch_size
        ),
        "batch_reference": Trace_ELBO().loss(batch_plate_model, empty_guide, x, y),
    }
