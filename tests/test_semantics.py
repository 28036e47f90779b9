"""Every PyroOptim feature, distributed: the same answer as one process.

The reference is always one process on the concatenation of the workers'
batches, with a deterministic loss. Plates scale each worker's loss by
TOTAL / batch size, so the workers' average gradient equals the single
process's gradient, and any optimizer must follow the same trajectory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import (
    SVI,
    Trace_ELBO,
)
from pyro.optim.multi import Newton, PyroMultiOptimizer, TorchMultiOptimizer

import pyro_distributed as pd

from .support.harness import ENGINES
from .support.models import empty_guide, param_values, point_regression
from .support.semantics import (
    STEPS,
    batch_for,
    clip_cases,
    compare_with_single_process,
    my_ranks,
    train_each_elbo,
)

# --- optimizer types and arguments ----------------------------------------------------------

OPTIMIZERS: dict[str, Callable[[], pyro.optim.PyroOptim]] = {
    "Adam": lambda: pyro.optim.Adam({"lr": 0.05}),
    "AdamW": lambda: pyro.optim.AdamW({"lr": 0.05, "weight_decay": 0.1}),
    "SGD": lambda: pyro.optim.SGD({"lr": 1e-4, "momentum": 0.9}),
    "RMSprop": lambda: pyro.optim.RMSprop({"lr": 0.01}),
    "ClippedAdam": lambda: pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.9, "clip_norm": 5.0}),
    "DCTAdam": lambda: pyro.optim.DCTAdam({"lr": 0.05}),
    "AdagradRMSProp": lambda: pyro.optim.AdagradRMSProp({"eta": 0.5}),
    "per-param, one argument": lambda: pyro.optim.Adam(
        lambda name: {"lr": 0.1 if name == "w" else 0.01}
    ),
    "per-param, two arguments": lambda: pyro.optim.Adam(
        lambda module, name: {"lr": 0.1 if name == "w" else 0.01}
    ),
}


def train_each_optimizer(single: bool) -> dict[str, dict[str, torch.Tensor]]:
    x, y = batch_for(my_ranks(single))
    results = {}
    for case, make in OPTIMIZERS.items():
        pyro.clear_param_store()
        optim = pd.DistributedOptimizer(make())
        svi = SVI(point_regression, empty_guide, optim, Trace_ELBO())
        for _ in range(STEPS):
            svi.step(x, y)
        results[case] = param_values()
    return results


def test_every_optimizer_type_matches_one_process() -> None:
    single = compare_with_single_process(train_each_optimizer)
    for case, values in single.items():
        assert values["w"].abs().sum() > 1e-3, f"{case} did not train"


# --- clipping after averaging ---------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_clipping_applies_to_the_averaged_gradient(engine: str) -> None:
    single = compare_with_single_process(clip_cases, rtol=1e-6, engine=engine)
    assert torch.allclose(single["value"]["p"], torch.tensor([-0.3, -0.25]))
    # average(clip) would have given ((-0.3 - 0.0) / 2, (-0.0 - 0.3) / 2)


# --- several backward passes per call -------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.slow
def test_every_elbo_matches_one_process(engine: str) -> None:
    compare_with_single_process(train_each_elbo, engine=engine)


# --- multi-optimizers -----------------------------------------------------------------------


def _train_with(optim: Any, single: bool) -> dict[str, torch.Tensor]:
    """Drive a MultiOptimizer by hand, as its users do."""
    x, y = batch_for(my_ranks(single))
    elbo = Trace_ELBO()
    for _ in range(STEPS):
        with pyro.poutine.trace(param_only=True) as capture:
            loss = elbo.differentiable_loss(point_regression, empty_guide, x, y)
        params = {name: site["value"].unconstrained() for name, site in capture.trace.nodes.items()}
        optim.step(loss, params)
    return param_values()


def multi_optimizers(single: bool) -> dict[str, dict[str, torch.Tensor]]:
    pyro.clear_param_store()
    pyro_multi = PyroMultiOptimizer(pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05})))
    results = {"PyroMultiOptimizer": _train_with(pyro_multi, single)}
    pyro.clear_param_store()
    # TorchMultiOptimizer builds its own PyroOptim: wrap that one.
    torch_multi = TorchMultiOptimizer(torch.optim.Adam, {"lr": 0.05})
    torch_multi.optim = pd.DistributedOptimizer(torch_multi.optim)
    results["TorchMultiOptimizer"] = _train_with(torch_multi, single)
    return results


def test_multi_optimizers_around_ours_match_one_process() -> None:
    compare_with_single_process(multi_optimizers)


def test_second_order_optimizers_cannot_be_wrapped() -> None:
    # Newton steps use each worker's local Hessian: averaging gradients would
    # not make them agree, so they are refused rather than silently diverging.
    with pytest.raises(TypeError, match=r"pyro_optim must be a pyro\.optim\.PyroOptim"):
        pd.DistributedOptimizer(Newton(), engine="local")  # type: ignore[arg-type]
    pd.shutdown()
