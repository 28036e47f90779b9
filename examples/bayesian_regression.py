"""Bayesian linear regression with SVI on subsampled minibatches, on any number of workers.

One process:        python examples/bayesian_regression.py
Two workers:        torchrun --standalone --nproc-per-node 2 examples/bayesian_regression.py
Horovod, two:       horovodrun --gloo -np 2 -H localhost:2 python examples/bayesian_regression.py

The model subsamples its data with ``pyro.plate(..., subsample_size=b)``.
Under ``pd.shard_subsamples()`` each worker's plate takes a different b of
one shared random permutation, so W workers use W*b distinct points per step,
and Pyro's scaling (size / b) makes the averaged gradient unbiased.
``pd.set_rng_seed`` gives every worker its own guide noise. With
``--checkpoint``, the run saves every ``--checkpoint-every`` steps and resumes
from the file if it exists: ``torchrun --max-restarts 3`` can then restart it
after a crash, and it finishes as if it had never stopped. Only worker 0
prints and writes files.
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


def model(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
    weights = pyro.sample("weights", dist.Normal(torch.zeros(x.shape[1]), 10.0).to_event(1))
    bias = pyro.sample("bias", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(x), subsample_size=batch_size) as idx:
        pyro.sample("y", dist.Normal(x[idx] @ weights + bias, NOISE), obs=y[idx])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000, help="data set size")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch size per worker")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="save to (and resume from) this file")
    parser.add_argument("--checkpoint-every", type=int, default=250)
    args = parser.parse_args()

    torch.set_num_threads(1)
    pd.init()
    pd.set_rng_seed(args.seed)
    x, y = make_data(args.size, args.seed)

    guide = AutoNormal(model)
    with pd.shard_subsamples():
        guide(x, y, args.batch_size)  # create the guide's parameters
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": args.lr}))
    svi = SVI(model, guide, optim, Trace_ELBO())
    start = 0
    if args.checkpoint:
        start = pd.load_checkpoint(args.checkpoint, optim, missing_ok=True)

    workers = pd.current_engine().allgather_object((pd.rank(), pd.local_rank()))
    if pd.is_main():
        print(f"training on {pd.world_size()} worker(s), {args.batch_size} points each per step")
        print("ranks (global, local):", workers)
        if start:
            print(f"resumed from {args.checkpoint} at step {start}")
    for step in range(start + 1, args.steps + 1):
        with pd.shard_subsamples():
            loss = svi.step(x, y, args.batch_size)
        if step % 250 == 0 or step == args.steps:
            loss = pd.all_mean(loss)  # the same number on every worker
            if pd.is_main():
                print(f"step {step:5d}  loss {loss:12.1f}")
        if args.checkpoint and (step % args.checkpoint_every == 0 or step == args.steps):
            pd.save_checkpoint(args.checkpoint, optim)

    if pd.is_main():
        median = guide.median()
        print("weights:", [round(w, 2) for w in median["weights"].tolist()])
        print("   true:", TRUE_WEIGHTS.tolist())
        print(f"bias: {median['bias'].item():.2f}   true: {TRUE_BIAS}")
    pd.shutdown()


if __name__ == "__main__":
    main()
