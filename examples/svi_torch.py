"""Pyro's torch-native training loop, data-parallel: an ELBO module and a torch optimizer.

One process:   python examples/svi_torch.py
Two workers:   torchrun --standalone --nproc-per-node 2 examples/svi_torch.py

This is the loop Pyro teaches for anything beyond the basics: PyroModule
parameters are plain ``nn.Parameter``\\s (``module_local_params``), the ELBO is
an ``nn.Module`` whose forward is the loss, and a torch optimizer, DataLoader
and learning-rate scheduler do the rest. Three edits make it data-parallel,
each marked ``# (n)`` below:

1. ``pd.init()`` joins the workers that torchrun (or horovodrun) started;
2. ``pd.ShardSampler`` gives each worker its own share of every epoch;
3. ``pd.DistributedTorchOptimizer`` around the torch optimizer averages the
   gradients at every ``step()``.

The model's plate is sized by the whole data set and subsampled by the batch,
so each worker's loss estimates the full-data ELBO and the averaged gradient
is that of all the data: the posterior is the same at any number of workers.
Only worker 0 prints.
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule
from torch.utils.data import DataLoader, TensorDataset

import pyro_distributed as pd

TRUE_SLOPE, TRUE_BIAS, TRUE_SCALE = 1.5, -0.5, 0.7


class Regression(PyroModule):
    """y ~ Normal(bias + slope * x, scale), with priors on all three."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        # A buffer, so that the priors follow the module's device and dtype.
        self.register_buffer("zero", torch.tensor(0.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        slope = pyro.sample("slope", dist.Normal(self.zero, 10.0))
        bias = pyro.sample("bias", dist.Normal(self.zero, 10.0))
        scale = pyro.sample("scale", dist.LogNormal(self.zero, 1.0))
        # Sized by the whole data set; each batch is a subsample of it.
        with pyro.plate("data", self.size, subsample_size=len(x)):
            return pyro.sample("y", dist.Normal(bias + slope * x, scale), obs=y)


def make_data(size: int, seed: int) -> TensorDataset:
    """The same data set on every worker (generated from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=generator)
    y = TRUE_BIAS + TRUE_SLOPE * x + TRUE_SCALE * torch.randn(size, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=200, help="over all workers")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    pd.init()  # (1)
    pyro.settings.set(module_local_params=True)
    pd.set_rng_seed(args.seed)

    dataset = make_data(args.size, seed=args.seed)
    sampler = pd.ShardSampler(dataset, shuffle=True, seed=args.seed)  # (2)
    # Each worker takes its share of the global batch, so that a step sees the
    # same amount of data, and an epoch has the same steps, at any world size.
    loader = DataLoader(dataset, batch_size=args.batch_size // pd.world_size(), sampler=sampler)

    model = Regression(args.size)
    guide = AutoNormal(model)
    loss_fn = Trace_ELBO()(model, guide)
    loss_fn(*dataset[: args.batch_size])  # AutoNormal creates its parameters on first use
    optimizer = pd.DistributedTorchOptimizer(  # (3)
        torch.optim.Adam(loss_fn.parameters(), lr=args.lr)
    )
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.92)

    if pd.is_main():
        print(f"training on {pd.world_size()} worker(s), {len(loader)} steps per epoch")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(x, y)
            loss.backward()
            optimizer.step()
        scheduler.step()
        loss = pd.all_mean(loss.detach())
        if pd.is_main():
            print(f"epoch {epoch}: loss {float(loss):.1f}")

    with torch.no_grad():
        medians = guide.median()
        slope_sd = float(guide.scales.slope)  # the posterior sd of the slope
    if pd.is_main():
        print(
            f"posterior: slope {float(medians['slope']):.3f} +- {slope_sd:.4f}, "
            f"bias {float(medians['bias']):.3f}, scale {float(medians['scale']):.3f}"
        )


if __name__ == "__main__":
    main()
