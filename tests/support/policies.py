"""Step policies as the tests of ``tests/policies/`` run them: a small
regression on each worker's shard, the policies by name, and the guide's
policy of one's own (which keeps no state)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

import pyro_distributed as pd
from pyro_distributed.policies import StepContext


class AverageEvery(pd.StepPolicy):
    """The guide's policy of one's own, which keeps no state: averages the
    parameters after every ``period``-th step after ``warmup_steps``."""

    steps_alone = True

    def __init__(self, period: int, warmup_steps: int) -> None:
        self.period, self.warmup_steps = period, warmup_steps

    def averages_gradients(self, step: int) -> bool:
        return step < self.warmup_steps

    def after_step(self, context: StepContext) -> bool:
        if context.averaged:
            return True
        if (context.step + 1 - self.warmup_steps) % self.period:
            return False
        pd.policies.average_parameters(context.engine, context.shared, context.step)
        return True


def make_policy(name: str) -> pd.StepPolicy:
    return {
        "local_sgd": lambda: pd.LocalSGD(4),
        "local_sgd_warmup": lambda: pd.LocalSGD(3, warmup_steps=2),
        "diloco": lambda: pd.DiLoCo(4),
        "diloco_plain": lambda: pd.DiLoCo(4, outer_lr=1.0, momentum=0.0),
        "stateless": lambda: AverageEvery(3, 2),
    }[name]()


def data(world_size_rows: int = 240) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(world_size_rows, 6, generator=generator)
    y = x @ torch.randn(6, 3, generator=generator) + 0.3 * torch.randn(240, 3, generator=generator)
    return pd.shard(x), pd.shard(y)


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    weight = pyro.param("weight", torch.zeros(6, 3))
    bias = pyro.param("bias", torch.zeros(3))
    with pyro.plate("data", 240, subsample_size=len(x)):
        pyro.sample("y", dist.Normal(x @ weight + bias, 0.5).to_event(1), obs=y)


def guide(x: torch.Tensor, y: torch.Tensor) -> None:
    pass
