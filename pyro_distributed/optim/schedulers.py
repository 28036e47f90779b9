"""Learning-rate schedulers stepped alike on every worker.

Pyro's ``PyroLRScheduler`` keeps one torch scheduler per parameter and steps
them all with whatever ``step()`` is given. Most schedulers count steps and
stay in step by themselves; ``ReduceLROnPlateau`` decides from a metric,
usually each worker's own loss, which differs between workers. Its metric is
therefore averaged across workers first (one float64 collective), so that
every worker lowers its learning rate at the same step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import runtime
from ..engines import Engine


def step_schedulers(
    wrapped: Any, engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Step ``wrapped``'s schedulers, averaging a ``ReduceLROnPlateau`` metric first."""
    wrapped_step = getattr(wrapped, "step", None)
    if wrapped_step is None:
        raise TypeError(
            f"the wrapped {type(wrapped).__name__} has no step(); only learning-rate "
            f"schedulers (pyro.optim.PyroLRScheduler) can be stepped"
        )
    constructor = getattr(wrapped, "pt_scheduler_constructor", None)
    plateau = isinstance(constructor, type) and issubclass(
        constructor, torch.optim.lr_scheduler.ReduceLROnPlateau
    )
    if plateau and engine.world_size > 1:
        if args:
            args = (_metric_mean(engine, args[0]), *args[1:])
        elif "metrics" in kwargs:
            kwargs = {**kwargs, "metrics": _metric_mean(engine, kwargs["metrics"])}
    wrapped_step(*args, **kwargs)


def _metric_mean(engine: Engine, metric: Any) -> float:
    value = metric.detach().item() if isinstance(metric, Tensor) else metric
    return runtime.float_mean(engine, float(value))
