"""Bayesian linear regression with SVI on subsampled minibatches, on any number of workers.

One process:        python examples/bayesian_regression.py
Two workers:        torchrun --nproc-per-node 2 examples/bayesian_regression.py
Horovod, two:       horovodrun --gloo -np 2 -H localhost:2 python examples/bayesian_regression.py

Every worker owns a disjoint shard of the data set and draws its own
minibatches from it. ``pyro.plate`` scales each minibatch's log-likelihood by
(data set size / batch size), so averaging the workers' gradients gives an
unbiased gradient estimate from all their minibatches together. Only worker 0
prints.
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

TRUE_WEIGHTS = torch.tensor([2.0, -1.0, 0.5])
TRUE_BIAS = 1.0
NOISE = 0.5


def make_data(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same synthetic data set on every worker (it is generated from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, len(TRUE_WEIGHTS), generator=generator)
    y = x @ TRUE_WEIGHTS + TRUE_BIAS + NOISE * torch.randn(size, generator=generator)
    return x, y


def model(x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor, size: int) -> None:
    weights = pyro.sample("weights", dist.Normal(torch.zeros(x.shape[1]), 10.0).to_event(1))
    bias = pyro.sample("bias", dist.Normal(0.0, 10.0))
    with pyro.plate("data", size, subsample=indices):
        pyro.sample("y", dist.Normal(x[indices] @ weights + bias, NOISE), obs=y[indices])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000, help="data set size")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch size per worker")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    pd.init()
    rank, workers = pd.rank(), pd.world_size()
    pyro.set_rng_seed(args.seed + rank)  # independent guide noise on each worker

    x, y = make_data(args.size, args.seed)
    shard = torch.arange(rank, args.size, workers)  # this worker's disjoint share
    minibatches = torch.Generator().manual_seed(args.seed * 1000 + rank)

    guide = AutoNormal(model)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": args.lr}))
    svi = SVI(model, guide, optim, Trace_ELBO())
    if pd.is_main():
        print(f"training on {workers} worker(s), {args.batch_size} points each per step")
    for step in range(1, args.steps + 1):
        pick = torch.randint(len(shard), (args.batch_size,), generator=minibatches)
        loss = svi.step(x, y, shard[pick], args.size)
        if step % 250 == 0 or step == args.steps:
            loss = pd.all_mean(loss)  # the same number on every worker
            if pd.is_main():
                print(f"step {step:5d}  loss {loss:12.1f}")

    if pd.is_main():
        median = guide.median()
        print("weights:", [round(w, 2) for w in median["weights"].tolist()])
        print("   true:", TRUE_WEIGHTS.tolist())
        print(f"bias: {median['bias'].item():.2f}   true: {TRUE_BIAS}")
    pd.shutdown()


if __name__ == "__main__":
    main()
