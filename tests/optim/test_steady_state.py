"""The steady-state plan: once the tensors stop changing, a step names, splits and
agrees on nothing per tensor; a change is still seen at the step it happens."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
from pyro_distributed.exchange import agreement
from pyro_distributed.optim import distributed, reducer

from ..support.harness import WorkerFailure, run_workers
from ..support.models import TOTAL, param_values, regression_data

#: The per-tensor passes that the steady state skips, by where they are looked up.
PASSES = [(distributed, "_by_store_name"), (reducer, "split_local"), (agreement, "digest_int")]


def _counted(calls: Counter[str]) -> None:
    for module, name in PASSES:
        original = getattr(module, name)

        @functools.wraps(original)
        def counting(
            *args: Any, _original: Any = original, _name: str = name, **kwargs: Any
        ) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counting)


def _model(x: torch.Tensor, y: torch.Tensor, late: bool) -> None:
    w = pyro.param("w", torch.zeros(x.shape[1]))
    b = pyro.param("late", torch.tensor(0.0)) if late else 0.0
    with pyro.plate("data", TOTAL, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(x @ w + b, 1.0), obs=y)


def _passes_per_phase(late_on: tuple[int, ...]) -> tuple[list[dict[str, int]], dict[str, Any]]:
    calls: Counter[str] = Counter()
    _counted(calls)
    x, y = regression_data(pd.rank(), 16)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    svi = SVI(_model, lambda *_, **__: None, optim, Trace_ELBO())
    seen = []
    for number in range(1, 13):
        svi.step(x, y, late=number >= 9 and pd.rank() in late_on)
        if number in (3, 8, 12):
            seen.append(dict(calls))
    return seen, param_values()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_steady_step_makes_no_per_tensor_pass_and_a_new_parameter_is_still_seen(
    world_size: int,
) -> None:
    results = run_workers(_passes_per_phase, tuple(range(world_size)), world_size=world_size)
    for seen, _ in results:
        settled, steady, grown = seen
        assert steady == settled, "steps 4-8 named, split or agreed per tensor again"
        # Step 9 brings a new parameter: named, split and agreed once more, then steady.
        for name in ("_by_store_name", "split_local"):
            assert grown[name] == steady[name] + 1, name
        assert grown["digest_int"] > steady["digest_int"]
    _, first = results[0]
    assert first.keys() == {"w", "late"}
    for rank, (_, other) in enumerate(results[1:], start=1):
        assert other.keys() == first.keys()
        for name in first:
            assert torch.equal(first[name], other[name]), f"{name!r} differs on worker {rank}"


def test_a_parameter_new_on_one_worker_only_is_caught_at_that_step_in_the_steady_state() -> None:
    # Worker 1 alone creates "late" at step 9; worker 0's param store lacks it.
    with pytest.raises(WorkerFailure) as failure:
        run_workers(_passes_per_phase, (1,))
    assert failure.value.reports.keys() == {0, 1}
    for report in failure.value.reports.values():
        assert "PyroDistributedError" in report
        assert "parameter 'late' is used on worker 1" in report
