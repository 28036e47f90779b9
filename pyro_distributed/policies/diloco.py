"""DiLoCo for SVI: ``period`` steps of the wrapped optimizer on each worker,
then one outer step from the period's start.

At a sync point every worker's move since the period's start (the
pseudo-gradient, start minus now) is averaged, and an outer SGD with
Nesterov momentum steps the start by it; every worker continues from the
result. The outer optimizer's momentum is the same on every worker, the
wrapped (inner) optimizer's state each worker's own. Douillard et al.,
"DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08105), with the outer learning rate 0.7 and momentum 0.9 their
experiments use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..checks import check_bool, check_int, check_number
from .base import StepContext, StepPolicy, average_parameters


class DiLoCo(StepPolicy):
    """Inner steps on each worker, an outer Nesterov step every ``period`` steps.

    :param period: inner steps between two outer steps (at least 1).
    :param outer_lr: the outer optimizer's learning rate (1.0 without
        momentum is :class:`LocalSGD`).
    :param momentum: the outer optimizer's momentum, in [0, 1).
    :param nesterov: Nesterov momentum, as torch's ``SGD(nesterov=True)``.
    :param warmup_steps: the first steps average gradients, as the default
        policy does; the first period starts after them.

    Example::

        optim = pd.DistributedOptimizer(
            pyro.optim.Adam({"lr": 0.01}), step_policy=pd.DiLoCo(period=64)
        )

    .. warning::
        Between two outer steps the workers' parameters differ: evaluate,
        save a checkpoint and compare workers at a sync point, where
        :attr:`~pyro_distributed.DistributedOptimizer.in_sync` is true.
    """

    steps_alone = True

    def __init__(
        self,
        period: int,
        *,
        outer_lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        warmup_steps: int = 0,
    ) -> None:
        check_int("DiLoCo period", period, minimum=1)
        check_number("DiLoCo outer_lr", outer_lr, positive=True)
        check_number("DiLoCo momentum", momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"DiLoCo momentum must be in [0, 1), got {momentum}")
        check_bool("DiLoCo nesterov", nesterov)
        check_int("DiLoCo warmup_steps", warmup_steps, minimum=0)
        self.period = period
        self.outer_lr = float(outer_lr)
        self.momentum = float(momentum)
        self.nesterov = nesterov
        self.warmup_steps = warmup_steps
        self._since_sync = 0
        #: The shared parameters at the period's start, and the outer momentum, by name.
        self._start: dict[str, Tensor] = {}
        self._velocity: dict[str, Tensor] = {}

    def averages_gradients(self, step: int) -> bool:
        return step < self.warmup_steps

    def after_step(self, context: StepContext) -> bool:
        shared = context.shared
        if context.averaged:  # identical on every worker: a period starts
            self._start = {name: tensor.detach().clone() for name, tensor in shared.items()}
            self._velocity = {name: v for name, v in self._velocity.items() if name in self._start}
            self._since_sync = 0
            return True
        for name in shared.keys() - self._start.keys():
            # New between two sync points: it took worker 0's value at this
            # step, which averaged its gradient; the period starts there for it.
            self._start[name] = shared[name].detach().clone()
        self._since_sync += 1
        if self._since_sync < self.period:
            return False
        with torch.no_grad():
            # A name of the period's start that this step did not hand over
            # keeps its start until it is stepped again.
            moves = {name: self._start[name] - tensor for name, tensor in shared.items()}
            average_parameters(context.engine, moves, context.step)
            for name, tensor in shared.items():
                self._outer_step(name, moves[name])
                tensor.copy_(self._start[name])
        self._since_sync = 0
        return True

    def _outer_step(self, name: str, move: Tensor) -> None:
        """SGD with momentum on the period's start, as torch's ``SGD`` steps."""
        start, update = self._start[name], move
        if self.momentum:
            velocity = self._velocity.get(name)
            if velocity is None:
                velocity = self._velocity[name] = move.clone()
            else:
                velocity.mul_(self.momentum).add_(move)
            update = move.add(velocity, alpha=self.momentum) if self.nesterov else velocity
        start.add_(update, alpha=-self.outer_lr)

    def state_dict(self) -> dict[str, Any]:
        return {
            "since_sync": self._since_sync,
            "start": {name: t.clone() for name, t in self._start.items()},
            "velocity": {name: t.clone() for name, t in self._velocity.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            self._since_sync, self._start, self._velocity = 0, {}, {}
            return
        unknown = sorted(set(state) - {"since_sync", "start", "velocity"})
        since = state.get("since_sync")
        start, velocity = state.get("start"), state.get("velocity")
        valid = (
            not unknown
            and isinstance(since, int)
            and 0 <= since < self.period
            and isinstance(start, Mapping)
            and isinstance(velocity, Mapping)
            and all(isinstance(t, Tensor) for t in (*start.values(), *velocity.values()))
            and set(velocity) <= set(start)
        )
        if not valid:
            raise ValueError(f"{self!r} cannot take the state {sorted(state)!r}: not a DiLoCo's")
        assert isinstance(start, Mapping) and isinstance(velocity, Mapping)
        assert isinstance(since, int)
        self._since_sync = since
        self._start = {str(name): t.clone() for name, t in start.items()}
        self._velocity = {str(name): t.clone() for name, t in velocity.items()}

    def __repr__(self) -> str:
        return (
            f"DiLoCo(period={self.period}, outer_lr={self.outer_lr}, momentum={self.momentum}, "
            f"nesterov={self.nesterov}, warmup_steps={self.warmup_steps})"
        )
