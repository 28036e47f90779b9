"""Training runs compared with one process on the concatenation of the workers'
batches: every ELBO, clipping, every scheduler (``tests/test_semantics.py``,
``tests/optim/test_schedulers.py``, and the same on Horovod and MPI)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyro
import pyro.distributions as dist
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

import pyro_distributed as pd

from .harness import run_workers
from .models import TOTAL, empty_guide, param_values, point_regression, regression_data

STEPS = 12


def batch_for(ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [regression_data(seed, 8) for seed in ranks]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def my_ranks(single: bool) -> list[int]:
    """The single process takes both workers' batches."""
    return [0, 1] if single else [pd.rank()]


def compare_with_single_process(
    worker: Callable[..., Any], *args: Any, rtol: float = 1e-4, engine: str = "torch"
) -> Any:
    """Run ``worker(single, *args)`` on two workers and on one process (which takes
    both batches); each case's values must agree, bitwise between the workers."""
    distributed = run_workers(worker, False, *args, world_size=2, engine=engine)
    (single,) = run_workers(worker, True, *args, world_size=1, engine=engine)
    for case, expected in single.items():
        for rank, got in enumerate(distributed):
            assert got[case].keys() == expected.keys(), case
            for name, value in expected.items():
                assert torch.equal(got[case][name], distributed[0][case][name]), (case, name, rank)
                assert torch.allclose(got[case][name], value, rtol=rtol, atol=1e-5), (case, name)
    return single


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


SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "StepLR": ("StepLR", {"step_size": 2, "gamma": 0.5}),
    "MultiStepLR": ("MultiStepLR", {"milestones": [2, 5], "gamma": 0.5}),
    "ExponentialLR": ("ExponentialLR", {"gamma": 0.8}),
    "ConstantLR": ("ConstantLR", {"factor": 0.5, "total_iters": 3}),
    "LinearLR": ("LinearLR", {"start_factor": 0.2, "total_iters": 4}),
    "PolynomialLR": ("PolynomialLR", {"total_iters": 6, "power": 2.0}),
    "CosineAnnealingLR": ("CosineAnnealingLR", {"T_max": 6}),
    "CosineAnnealingWarmRestarts": ("CosineAnnealingWarmRestarts", {"T_0": 3}),
    "CyclicLR": ("CyclicLR", {"base_lr": 1e-5, "max_lr": 1e-4, "step_size_up": 2}),
    "OneCycleLR": ("OneCycleLR", {"max_lr": 1e-4, "total_steps": STEPS + 1}),
    "LambdaLR": ("LambdaLR", {"lr_lambda": "halving"}),
    "MultiplicativeLR": ("MultiplicativeLR", {"lr_lambda": "halving"}),
    "ReduceLROnPlateau": ("ReduceLROnPlateau", {"patience": 0, "factor": 0.5, "threshold": 0.5}),
}


def _halving(epoch: int) -> float:
    return 0.5 ** min(epoch, 3) if epoch else 1.0


def train_each_scheduler(single: bool) -> dict[str, dict[str, torch.Tensor]]:
    x, y = batch_for(my_ranks(single))
    results = {}
    for case, (name, scheduler_args) in SCHEDULERS.items():
        pyro.clear_param_store()
        kwargs = {k: _halving if v == "halving" else v for k, v in scheduler_args.items()}
        scheduler = getattr(pyro.optim, name)(
            {"optimizer": torch.optim.SGD, "optim_args": {"lr": 1e-4, "momentum": 0.5}, **kwargs}
        )
        optim = pd.DistributedOptimizer(scheduler)
        svi = SVI(point_regression, empty_guide, optim, Trace_ELBO())
        lrs = []
        for _ in range(STEPS):
            loss = svi.step(x, y)
            optim.step(loss) if name == "ReduceLROnPlateau" else optim.step()
            (lr,) = {o.optimizer.param_groups[0]["lr"] for o in optim.optim_objs.values()}
            lrs.append(lr)
        results[case] = {**param_values(), "lr": torch.tensor(lrs, dtype=torch.float64)}
    return results
