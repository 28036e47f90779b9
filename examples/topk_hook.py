"""A communication hook of your own: top-k sparsification with error feedback.

One process:   python examples/topk_hook.py
Two workers:   torchrun --standalone --nproc-per-node 2 examples/topk_hook.py

Each worker sends only the ``k`` largest entries of each bucket of
gradients (by magnitude), and keeps what it did not send to add to its next
gradient (error feedback), so no direction is lost, only delayed. Every
worker receives every worker's entries with :meth:`Engine.all_gather
<pyro_distributed.engines.Engine.all_gather>` (exact: a copy, not a sum)
and adds them up in rank order, so every worker holds the same average and
the parameters stay bitwise in sync.

The hook follows the rules for state that outlives a step: its state is
kept by the bucket's name, changed only in ``commit()`` (a result the step
drops, when a bucket is sent again, commits nothing), and returned by
``state_dict()`` as plain tensors, which checkpoints save for every worker.
So the run below, cut in two by a checkpoint and resumed with a fresh hook
and optimizer, ends bitwise where the straight run ends.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd


class TopKHook(pd.CommHook):
    """Sends the ``ratio`` largest entries of each bucket's gradients, by magnitude."""

    in_place = True  # wait() returns the bucket's own buffer

    def __init__(self, ratio: float = 0.1) -> None:
        self.ratio = ratio
        self.errors: dict[str, torch.Tensor] = {}  # by bucket name: what was not sent

    def __call__(self, bucket: pd.GradBucket, engine: pd.Engine) -> pd.Reducing:
        return TopK(self, bucket, engine)

    def state_dict(self) -> dict[str, Any]:
        return {"errors": dict(self.errors)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.errors = dict(state.get("errors", {}))


class TopK(pd.Reducing):
    """One bucket's trip: every worker's top entries gathered, summed in rank order."""

    def __init__(self, hook: TopKHook, bucket: pd.GradBucket, engine: pd.Engine) -> None:
        self.hook, self.bucket, self.engine = hook, bucket, engine
        gradients = bucket.gradients()
        error = hook.errors.get(bucket.name)
        if error is not None and error.shape == gradients.shape:
            self.corrected = gradients + error
        else:  # a bucket seen for the first time (or of a new shape)
            self.corrected = gradients.clone()
        k = max(1, math.ceil(hook.ratio * gradients.numel()))
        self.index = self.corrected.abs().topk(k).indices
        self.unsent: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        bucket, engine, name = self.bucket, self.engine, self.bucket.name
        values = engine.all_gather(self.corrected[self.index], f"{name}.values")
        indices = engine.all_gather(self.index, f"{name}.indices")
        tail = bucket.tail().clone()  # presence flags and riders: summed exactly
        engine.allreduce_([tail], "sum", [f"{name}.tail"])
        average = torch.zeros_like(self.corrected)
        for rank in range(bucket.world_size):  # the same order on every worker
            average.index_add_(0, indices[rank], values[rank])
        bucket.gradients().copy_(average.div_(bucket.world_size))
        bucket.tail().copy_(tail)
        self.unsent = self.corrected.index_fill(0, self.index, 0.0)
        return bucket.buffer

    def commit(self) -> None:
        assert self.unsent is not None
        self.hook.errors[self.bucket.name] = self.unsent


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    weight = pyro.param("weight", torch.zeros(x.shape[1], y.shape[1]))
    with pd.data_plate("data", x):
        pyro.sample("y", dist.Normal(x @ weight, 0.5).to_event(1), obs=y)


def guide(x: torch.Tensor, y: torch.Tensor) -> None:
    pass


def train(steps: int, path: str, *, resume: bool = False, save_at: int | None = None) -> Any:
    """Train to ``steps`` steps (from the checkpoint at ``path`` with ``resume``),
    saving after step ``save_at``."""
    pyro.clear_param_store()
    pd.set_rng_seed(0)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), comm_hook=TopKHook(0.1))
    svi = SVI(model, guide, optim, Trace_ELBO())
    start = pd.load_checkpoint(path, optim) if resume else 0
    for step in range(start, steps):
        svi.step(x_mine, y_mine)
        if step + 1 == save_at:
            pd.save_checkpoint(path, optim)
    return pyro.param("weight").detach().clone()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    pd.init()
    generator = torch.Generator().manual_seed(0)
    true_weight = torch.randn(20, 8, generator=generator)
    x = torch.randn(1_000, 20, generator=generator)
    y = x @ true_weight + 0.5 * torch.randn(1_000, 8, generator=generator)
    x_mine, y_mine = pd.shard(x), pd.shard(y)
    # Worker 0's temporary directory, for every worker (only worker 0 writes the file).
    folder = pd.current_engine().allgather_object(tempfile.mkdtemp() if pd.is_main() else None)[0]
    path = os.path.join(folder, "run.pt")
    half = args.steps // 2
    straight = train(args.steps, path)
    train(half, path, save_at=half)  # stops after its checkpoint
    resumed = train(args.steps, path, resume=True)  # a fresh hook and optimizer
    assert torch.equal(straight, resumed), "the resumed run continues bitwise"
    error = (straight - true_weight).abs().max().item()
    if pd.is_main():
        print(f"trained on {pd.world_size()} worker(s), sending 10% of each bucket")
        print(f"resumed run equals the straight run; largest weight error {error:.3f}")
