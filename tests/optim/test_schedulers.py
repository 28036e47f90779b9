"""Learning-rate schedulers, distributed: stepped alike on every worker.

Every scheduler Pyro wraps follows the one-process trajectory (the reference
of :mod:`tests.test_semantics`); ReduceLROnPlateau decides from the mean of
the workers' metrics, however the metric is passed.
"""

from __future__ import annotations

import functools
from typing import Any

import pyro
import pytest
import torch

import pyro_distributed as pd

from ..support.harness import ENGINES, run_workers
from ..support.semantics import (
    compare_with_single_process,
    train_each_scheduler,
)


@functools.cache
def scheduler_runs(engine: str) -> Any:
    return compare_with_single_process(train_each_scheduler, engine=engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_scheduler_matches_one_process(engine: str) -> None:
    single = scheduler_runs(engine=engine)
    for case, values in single.items():
        assert len(set(values["lr"].tolist())) > 1, f"{case}: the learning rate never changed"


@pytest.mark.parametrize("engine", ENGINES)
def test_reduce_lr_on_plateau_averages_the_loss_it_is_given(engine: str) -> None:
    # Each worker passes its own local loss; the single process passes the mean loss.
    single = scheduler_runs(engine=engine)
    assert single["ReduceLROnPlateau"]["lr"][-1] < 1e-4


def stepping_a_plain_optimizer() -> str:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    with pytest.raises(TypeError) as info:
        optim.step()
    return str(info.value)


def test_step_on_a_plain_optimizer_says_only_schedulers_step() -> None:
    (message,) = run_workers(stepping_a_plain_optimizer, world_size=1)
    assert "the wrapped PyroOptim has no step()" in message
    assert "only learning-rate schedulers" in message


def plateau_learning_rates(metrics: list[list[float]], how: str) -> list[float]:
    """ReduceLROnPlateau stepped with this worker's row of ``metrics``, passed ``how``."""
    scheduler = pyro.optim.ReduceLROnPlateau(
        {"optimizer": torch.optim.SGD, "optim_args": {"lr": 1.0}, "patience": 0, "factor": 0.5}
    )
    optim = pd.DistributedOptimizer(scheduler)
    p = pyro.param("p", torch.ones(2)).unconstrained()
    p.sum().backward()
    optim([p])
    lrs = []
    for metric in metrics[pd.rank()]:
        if how == "tensor":
            optim.step(torch.tensor(metric))
        else:
            optim.step(metrics=metric)
        (lr,) = {o.optimizer.param_groups[0]["lr"] for o in optim.optim_objs.values()}
        lrs.append(lr)
    return lrs


# Worker 0's own metric never improves; the mean of both workers' improves at every step.
PLATEAU_METRICS = [[1.0] * 4, [9.0, 7.0, 5.0, 3.0]]


@pytest.mark.parametrize("how", ["tensor", "keyword"])
@pytest.mark.slow
def test_reduce_lr_on_plateau_follows_the_mean_metric_not_the_workers_own(how: str) -> None:
    results = run_workers(plateau_learning_rates, PLATEAU_METRICS, how)
    assert results[0] == results[1] == [1.0] * 4
    # The same scheduler alone on worker 0's metric would have lowered the rate.
    (alone,) = run_workers(plateau_learning_rates, PLATEAU_METRICS[:1], how, world_size=1)
    assert alone == [1.0, 0.5, 0.25, 0.125]
