"""Local SGD: each worker steps on its own gradients; the shared parameters
are averaged every ``period`` steps.

It follows torch's ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager``:
``warmup_steps`` steps that average gradients as the default policy does,
then an average of the parameters after every ``period``-th step alone
(torch's averager counts its period from the warm-up's last step, so its
averages fall one step earlier for the same arguments). The wrapped
optimizer's state (Adam's moments) stays each worker's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..checks import check_int
from .base import StepContext, StepPolicy, average_parameters


class LocalSGD(StepPolicy):
    """Average the shared parameters every ``period`` steps, not the gradients.

    :param period: steps between two averages of the parameters (at least 1;
        1 averages after every step).
    :param warmup_steps: the first steps average gradients, as the default
        policy does.

    Example::

        optim = pd.DistributedOptimizer(
            pyro.optim.Adam({"lr": 0.01}), step_policy=pd.LocalSGD(period=16)
        )

    .. warning::
        Between two averages the workers' parameters differ: evaluate, save
        a checkpoint and compare workers at a sync point, where
        :attr:`~pyro_distributed.DistributedOptimizer.in_sync` is true.
    """

    steps_alone = True

    def __init__(self, period: int, *, warmup_steps: int = 0) -> None:
        check_int("LocalSGD period", period, minimum=1)
        check_int("LocalSGD warmup_steps", warmup_steps, minimum=0)
        self.period = period
        self.warmup_steps = warmup_steps
        self._since_sync = 0

    def averages_gradients(self, step: int) -> bool:
        return step < self.warmup_steps

    def after_step(self, context: StepContext) -> bool:
        if context.averaged:
            self._since_sync = 0
            return True
        self._since_sync += 1
        if self._since_sync < self.period:
            return False
        average_parameters(context.engine, context.shared, context.step)
        self._since_sync = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"since_sync": self._since_sync}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        since = state.get("since_sync", 0)
        unknown = sorted(set(state) - {"since_sync"})
        if unknown or not isinstance(since, int) or not 0 <= since < self.period:
            raise ValueError(
                f"LocalSGD(period={self.period}) cannot take the state {dict(state)!r}"
            )
        self._since_sync = since

    def __repr__(self) -> str:
        return f"LocalSGD(period={self.period}, warmup_steps={self.warmup_steps})"
