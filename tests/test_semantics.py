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
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    Trace_ELBO,
    TraceEnum_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
    config_enumerate,
)
from pyro.optim.multi import Newton, PyroMultiOptimizer, TorchMultiOptimizer

import pyro_distributed as pd

from .support.harness import run_workers
from .support.models import TOTAL, empty_guide, param_values, point_regression, regression_data

STEPS = 12


def batch_for(ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [regression_data(seed, 8) for seed in ranks]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def my_ranks(single: bool) -> list[int]:
    """The single process takes both workers' batches."""
    return [0, 1] if single else [pd.rank()]


def compare_with_single_process(worker: Callable[..., Any], *args: Any, rtol: float = 1e-4) -> Any:
    distributed = run_workers(worker, False, *args, world_size=2)
    (single,) = run_workers(worker, True, *args, world_size=1)
    for case, expected in single.items():
        for rank, got in enumerate(distributed):
            assert got[case].keys() == expected.keys(), case
            for name, value in expected.items():
                assert torch.equal(got[case][name], distributed[0][case][name]), (case, name, rank)
                assert torch.allclose(got[case][name], value, rtol=rtol, atol=1e-5), (case, name)
    return single


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


def clip_cases(single: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Worker gradients for which clip(average) differs from average(clip).

    Worker 0's gradient is (4, 0), worker 1's is (0, 0.5); the single
    process sees their average, (2, 0.25), as its one gradient.
    """
    grads = {0: torch.tensor([4.0, 0.0]), 1: torch.tensor([0.0, 0.5])}
    grad = (grads[0] + grads[1]) / 2 if single else grads[pd.rank()]
    clip_args: dict[str, Any] = {
        "norm": {"clip_norm": 1.0},
        "value": {"clip_value": 0.3},
        "callable": lambda module, name: {"clip_value": 0.3} if name == "p" else {},
    }
    results = {}
    for case, clip in clip_args.items():
        pyro.clear_param_store()
        p = pyro.param("p", torch.zeros(2)).unconstrained()
        optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 1.0}, clip_args=clip))
        (p * grad).sum().backward()
        optim([p])
        results[case] = param_values()
    return results


def test_clipping_applies_to_the_averaged_gradient() -> None:
    single = compare_with_single_process(clip_cases, rtol=1e-6)
    assert torch.allclose(single["value"]["p"], torch.tensor([-0.3, -0.25]))
    # average(clip) would have given ((-0.3 - 0.0) / 2, (-0.0 - 0.3) / 2)


# --- several backward passes per call -------------------------------------------------------


@config_enumerate
def mixture(x: torch.Tensor, y: torch.Tensor) -> None:
    """Two-component mixture on y; the assignment is enumerated, so the loss is exact."""
    weights = pyro.param("weights", torch.tensor([0.4, 0.6]), constraint=dist.constraints.simplex)
    locs = pyro.param("locs", torch.tensor([-1.0, 1.0]))
    with pyro.plate("data", TOTAL, subsample=torch.arange(len(y))):
        assignment = pyro.sample("assignment", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[assignment], 1.0), obs=y / 5)


ELBOS: dict[str, tuple[Callable[[], Any], Callable[..., None]]] = {
    "Trace_ELBO(num_particles=3)": (lambda: Trace_ELBO(num_particles=3), point_regression),
    "TraceGraph_ELBO": (TraceGraph_ELBO, point_regression),
    "TraceMeanField_ELBO": (TraceMeanField_ELBO, point_regression),
    "JitTrace_ELBO": (lambda: JitTrace_ELBO(ignore_jit_warnings=True), point_regression),
    "TraceEnum_ELBO": (lambda: TraceEnum_ELBO(max_plate_nesting=1), mixture),
}


def train_each_elbo(single: bool) -> dict[str, dict[str, torch.Tensor]]:
    x, y = batch_for(my_ranks(single))
    results = {}
    for case, (make_elbo, model) in ELBOS.items():
        pyro.clear_param_store()
        svi = SVI(
            model, empty_guide, pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05})), make_elbo()
        )
        for _ in range(STEPS):
            svi.step(x, y)
        results[case] = param_values()
    return results


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.slow
def test_every_elbo_matches_one_process() -> None:
    compare_with_single_process(train_each_elbo)


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
