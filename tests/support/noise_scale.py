"""The noise-scale workload: a regression whose gradient norms are measured
by the library and computed exactly from the gathered gradients
(``tests/optim/test_noise_scale.py``, ``tests/test_scaling.py``, and the same on
Horovod)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from torch import Tensor

import pyro_distributed as pd

N = 1000  # data points
DIM = 32
BATCH = 16  # per worker, drawn with replacement
SIGMA = 1.0  # the likelihood's scale
TAU = 1.0  # the prior's scale
OFFSET = 3.0  # |w - w_true|: how far the fixed parameters sit from the truth


def dataset(label_noise: float) -> tuple[Tensor, Tensor, Tensor]:
    """The same data on every worker: x, y and the fixed parameters w."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(N, DIM, generator=generator)
    truth = torch.randn(DIM, generator=generator)
    y = x @ truth + label_noise * torch.randn(N, generator=generator)
    w = truth + OFFSET * torch.ones(DIM) / DIM**0.5
    return x, y, w


def model(x: Tensor, y: Tensor, indices: Tensor) -> None:
    w = pyro.sample("w", dist.Normal(torch.zeros(DIM), TAU).to_event(1))
    with pyro.plate("data", N, subsample=indices):
        pyro.sample("y", dist.Normal(x[indices] @ w, SIGMA), obs=y[indices])


def delta_guide(x: Tensor, y: Tensor, indices: Tensor) -> None:
    pyro.sample("w", dist.Delta(pyro.param("w_loc"), event_dim=1))


def normal_guide(x: Tensor, y: Tensor, indices: Tensor) -> None:
    """A fixed-width normal: its Monte Carlo noise adds to the subsampling noise."""
    pyro.sample("w", dist.Normal(pyro.param("w_loc"), 1.0).to_event(1))


STEPS = 5


def exact_norms(local: list[Tensor]) -> tuple[float, float]:
    """mean_i |g_i|^2 and |mean_i g_i|^2 from every worker's flattened local gradient."""
    gathered = torch.stack(pd.current_engine().allgather_object(local)).double()
    return float((gathered**2).sum(-1).mean()), float(gathered.mean(0).pow(2).sum())


def measured_against_exact(overlap: bool, compression: str) -> list[dict[str, float]]:
    """A manual loop that records every worker's gradient before the optimizer call."""
    pyro.clear_param_store()
    x, y, w = dataset(1.0)
    pyro.param("w_loc", w.clone())
    for i in range(6):  # more parameters, so that a small cap makes several buckets
        pyro.param(f"extra{i}", torch.full((8,), 0.1 * i))
    # Nearly no smoothing: the estimate is the last step's own.
    optim = pd.DistributedOptimizer(
        # Clipping tighter than any gradient: a measurement after it would differ.
        pyro.optim.ClippedAdam({"lr": 0.0, "clip_norm": 1e-3}),
        overlap=overlap,
        compression=compression,  # type: ignore[arg-type]
        bucket_cap_mb=200 / 2**20,
        noise_scale=1 - 1e-9,
    )
    draws = torch.Generator().manual_seed(1000 + pd.rank())
    records = []
    for _ in range(STEPS):
        indices = torch.randint(N, (BATCH,), generator=draws)
        with pyro.poutine.trace(param_only=True) as capture:
            loss = Trace_ELBO().differentiable_loss(model, delta_guide, x, y, indices)
            loss = loss + sum(
                (pyro.param(f"extra{i}") ** 2).sum() * (pd.rank() + 1) for i in range(6)
            )
        loss.backward()
        params = sorted(
            (site["name"], site["value"].unconstrained()) for site in capture.trace.nodes.values()
        )
        local = torch.cat([p.grad.reshape(-1) for _, p in params])  # type: ignore[union-attr]
        small, big = exact_norms(local.clone())
        optim({p for _, p in params})
        pyro.infer.util.zero_grads({p for _, p in params})
        size = pd.world_size()
        got = optim.noise_scale()
        records.append(
            {
                "gradient_sq": got.gradient_sq,
                "trace_sigma": got.trace_sigma,
                "exact_gradient_sq": (size * big - small) / (size - 1),
                "exact_trace_sigma": (small - big) / (1 - 1 / size),
            }
        )
    return records
