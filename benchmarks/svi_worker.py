"""One SVI benchmark process: time ``--steps`` SVI steps of one workload.

Runs unchanged as one process (``python benchmarks/svi_worker.py ...``), under
``torchrun --nproc-per-node 2`` or under ``horovodrun``. Every worker builds
the same model on its own batch of the same size (weak scaling), runs
``--warmup`` untimed steps, waits for the others, then times ``--steps`` steps.
Worker 0 prints one JSON line::

    {"workload": ..., "optim": ..., "world_size": ..., "ms_per_step": ..., "steps": ...}

and, with ``--json-out PATH``, also writes it to ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import PyroOptim
from torch import Tensor

import pyro_distributed

SEED = 20240601
LEARNING_RATE = 1e-3

# small400: 200 latent sites, so AutoNormal makes 400 small parameters.
GROUPS = 200
GROUP_DIM = 4
SMALL_BATCH = 256

# large1m: a one-hidden-layer regression whose 1000 x 1000 weight is ~1 M floats.
HIDDEN = 1000
LARGE_BATCH = 512

Model = Callable[[Tensor, Tensor], None]
Guide = Callable[[Tensor, Tensor], object]


@dataclass(frozen=True)
class Workload:
    """A model, its guide, and this worker's batch, as ``svi.step`` takes them."""

    model: Model
    guide: Guide
    x: Tensor
    y: Tensor


def grouped_regression(x: Tensor, y: Tensor) -> None:
    """A regression with one small latent coefficient vector per group.

    ``x`` holds the group index in column 0 and the features after it.
    """
    coefs = torch.stack(
        [
            pyro.sample(f"coef_{g}", dist.Normal(torch.zeros(GROUP_DIM), 1.0).to_event(1))
            for g in range(GROUPS)
        ]
    )
    group, features = x[:, 0].long(), x[:, 1:]
    mean = (features * coefs[group]).sum(-1)
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)


def mlp_regression(x: Tensor, y: Tensor) -> None:
    """A point-estimate regression through one hidden layer of ``HIDDEN`` units."""
    w1 = pyro.param("w1", lambda: torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5)
    b1 = pyro.param("b1", lambda: torch.zeros(HIDDEN))
    w2 = pyro.param("w2", lambda: torch.randn(HIDDEN) / HIDDEN**0.5)
    b2 = pyro.param("b2", lambda: torch.zeros(()))
    mean = torch.tanh(x @ w1 + b1) @ w2 + b2
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)


def no_guide(x: Tensor, y: Tensor) -> None:
    """The guide of a model without latent variables."""


def small400(generator: torch.Generator) -> Workload:
    """Many tiny parameters: per-parameter overhead dominates the step."""
    group = torch.randint(GROUPS, (SMALL_BATCH, 1), generator=generator)
    features = torch.randn(SMALL_BATCH, GROUP_DIM, generator=generator)
    y = features.sum(-1) + 0.5 * torch.randn(SMALL_BATCH, generator=generator)
    x = torch.cat([group.float(), features], dim=1)
    return Workload(grouped_regression, AutoNormal(grouped_regression), x, y)


def large1m(generator: torch.Generator) -> Workload:
    """A few parameters, ~1 M floats in all: the gradient volume dominates."""
    x = torch.randn(LARGE_BATCH, HIDDEN, generator=generator)
    y = torch.tanh(x[:, :10].sum(-1)) + 0.5 * torch.randn(LARGE_BATCH, generator=generator)
    return Workload(mlp_regression, no_guide, x, y)


WORKLOADS: dict[str, Callable[[torch.Generator], Workload]] = {
    "small400": small400,
    "large1m": large1m,
}

OPTIMS = ("plain", "ours", "ours-mt", "pyro-horovod")


def make_optimizer(name: str) -> PyroOptim:
    """The optimizer for ``--optim``: plain Adam, wrapped by us (``ours-mt``: with one
    multi-tensor step) or by Pyro's Horovod wrapper."""
    adam = pyro.optim.Adam({"lr": LEARNING_RATE})
    if name == "plain":
        return adam
    if name == "ours":
        return pyro_distributed.DistributedOptimizer(adam)
    if name == "ours-mt":
        return pyro_distributed.DistributedOptimizer(adam, multi_tensor=True)
    import horovod.torch as hvd  # only this configuration needs Horovod

    hvd.init()
    return pyro.optim.HorovodOptimizer(adam)


def time_steps(svi: SVI, workload: Workload, steps: int, warmup: int) -> float:
    """Seconds taken by ``steps`` SVI steps after ``warmup`` untimed ones."""
    for _ in range(warmup):
        svi.step(workload.x, workload.y)
    if pyro_distributed.world_size() > 1:
        pyro_distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(workload.x, workload.y)
    return time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workload", choices=tuple(WORKLOADS), required=True)
    parser.add_argument("--optim", choices=OPTIMS, required=True)
    parser.add_argument("--steps", type=int, default=50, help="timed SVI steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed SVI steps first")
    parser.add_argument("--json-out", type=Path, help="also write the JSON line here")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    optim = make_optimizer(args.optim)  # first: it starts Horovod when asked for
    rank = pyro_distributed.rank()
    pyro.clear_param_store()
    pyro.set_rng_seed(SEED + rank)
    workload = WORKLOADS[args.workload](torch.Generator().manual_seed(SEED + rank))
    svi = SVI(workload.model, workload.guide, optim, Trace_ELBO())
    seconds = time_steps(svi, workload, args.steps, args.warmup)
    if pyro_distributed.is_main():
        line = json.dumps(
            {
                "workload": args.workload,
                "optim": args.optim,
                "world_size": pyro_distributed.world_size(),
                "ms_per_step": 1000.0 * seconds / args.steps,
                "steps": args.steps,
            }
        )
        print(line, flush=True)
        if args.json_out is not None:
            args.json_out.write_text(line + "\n")
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main()
