"""The gradient noise scale: right on a model with a known answer, free, and unchanged results.

The known answer: Bayesian linear regression y ~ N(x . w, sigma^2), prior
w ~ N(0, tau^2 I), with a delta guide at a fixed w (learning rate 0). Each
worker draws its b data points uniformly *with replacement* from N, with its
own generator, and Pyro's plate scales their log-likelihood by N / b. One
worker's gradient with respect to w is then

    g = w / tau^2 + (1 / b) sum_k h(n_k),   h(n) = N x_n (x_n . w - y_n) / sigma^2,

a mean of b independent draws of h, so E g = G = w / tau^2 + mean_n h(n) and
Cov g = C / b, with C the covariance of h over the N points (divided by N).
Hence |G|^2 and tr(Sigma) = tr(C) / b, computed here from the data, are what
the two-batch estimators must find, in expectation exactly.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import Tensor

import pyro_distributed as pd
from pyro_distributed.optim.noise_scale import NoiseScale

from ..support.harness import CountingEngine, run_workers, with_engines
from ..support.noise_scale import (
    BATCH,
    SIGMA,
    TAU,
    N,
    dataset,
    delta_guide,
    measured_against_exact,
    model,
    normal_guide,
)


def closed_form(x: Tensor, y: Tensor, w: Tensor) -> dict[str, float]:
    """|G|^2, tr(Sigma) of one worker's gradient, and B_simple, from the data."""
    x, y, w = x.double(), y.double(), w.double()
    per_point = N * x * (x @ w - y).unsqueeze(-1) / SIGMA**2  # h(n), one row each
    gradient = w / TAU**2 + per_point.mean(0)
    trace = float(((per_point - per_point.mean(0)) ** 2).sum(-1).mean()) / BATCH
    gradient_sq = float(gradient @ gradient)
    return {"gradient_sq": gradient_sq, "trace_sigma": trace, "b_simple": trace / gradient_sq}


def estimate(
    label_noise: float, steps: int, guide: Any = delta_guide, particles: int = 1
) -> NoiseScale:
    """Train with learning rate 0 for ``steps`` steps; the optimizer's estimate."""
    pyro.clear_param_store()
    x, y, w = dataset(label_noise)
    pyro.param("w_loc", w.clone())
    # A smoothing factor far below 1 / steps: nearly the plain mean of every step.
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.0}), noise_scale=1e-4)
    svi = SVI(model, guide, optim, Trace_ELBO(num_particles=particles))
    pyro.set_rng_seed(11 + pd.rank())
    draws = torch.Generator().manual_seed(1000 + pd.rank())  # each worker its own
    for _ in range(steps):
        svi.step(x, y, torch.randint(N, (BATCH,), generator=draws))
    assert torch.equal(pyro.param("w_loc").detach(), w), "the parameters must stay fixed"
    return optim.noise_scale(batch_size=BATCH)


@pytest.mark.parametrize(("world_size", "steps"), [(2, 600), (4, 300)])
def test_estimates_match_the_closed_form_of_a_linear_regression(
    world_size: int, steps: int
) -> None:
    results = run_workers(estimate, 1.0, steps, world_size=world_size, timeout=240)
    expected = closed_form(*dataset(1.0))
    measured = results[0]
    assert all(result == measured for result in results), "every worker holds the same figures"
    assert measured.steps == steps and measured.world_size == world_size
    print(f"W={world_size}: measured {measured}; closed form {expected}")
    assert measured.gradient_sq == pytest.approx(expected["gradient_sq"], rel=0.10)
    assert measured.trace_sigma == pytest.approx(expected["trace_sigma"], rel=0.10)
    assert measured.b_simple == pytest.approx(expected["b_simple"], rel=0.15)
    assert measured.b_simple_points == pytest.approx(measured.b_simple * BATCH)


def noise_and_particles() -> dict[str, float]:
    return {
        "quiet labels": estimate(0.5, 150).b_simple,
        "noisy labels": estimate(4.0, 150).b_simple,
        "1 particle": estimate(1.0, 150, normal_guide, particles=1).b_simple,
        "8 particles": estimate(1.0, 150, normal_guide, particles=8).b_simple,
    }


def test_b_simple_grows_with_label_noise_and_falls_with_particles() -> None:
    figures = run_workers(noise_and_particles, timeout=240)[0]
    print(figures)
    quiet, noisy = closed_form(*dataset(0.5)), closed_form(*dataset(4.0))
    assert noisy["b_simple"] > 1.5 * quiet["b_simple"]  # what the data promise
    assert figures["noisy labels"] > 1.5 * figures["quiet labels"]
    assert figures["8 particles"] < 0.7 * figures["1 particle"]


# ---------------------------------------------------------------------------
# The norms are exact, on every path a bucket can take.


@pytest.mark.parametrize(
    ("engine", "overlap", "compression", "rel"),
    with_engines(
        [(True, "none", 1e-4), (False, "none", 1e-4), (True, "fp16", 1e-2), (False, "bf16", 5e-2)],
        on_mpi=[(True, "none", 1e-4)],
    ),
)
@pytest.mark.slow
def test_norms_equal_those_of_the_gathered_gradients(
    engine: str, overlap: bool, compression: str, rel: float
) -> None:
    for record in run_workers(measured_against_exact, overlap, compression, engine=engine)[0]:
        assert record["gradient_sq"] == pytest.approx(record["exact_gradient_sq"], rel=rel)
        assert record["trace_sigma"] == pytest.approx(record["exact_trace_sigma"], rel=rel)


# ---------------------------------------------------------------------------
# Free: no collective, the same results; and skipped steps are left out.


def count_and_train(noise: bool, overlap: bool, compression: str) -> dict[str, Any]:
    pyro.clear_param_store()
    engine = CountingEngine(pd.current_engine())
    x, y, w = dataset(1.0)
    pyro.param("w_loc", w.clone())
    optim = pd.DistributedOptimizer(
        pyro.optim.Adam({"lr": 0.01}),
        engine=engine,
        overlap=overlap,
        compression=compression,  # type: ignore[arg-type]
        noise_scale=noise,
    )
    svi = SVI(model, normal_guide, optim, Trace_ELBO())
    pyro.set_rng_seed(3 + pd.rank())
    draws = torch.Generator().manual_seed(pd.rank())
    for _ in range(6):
        svi.step(x, y, torch.randint(N, (BATCH,), generator=draws))
    return {"calls": engine.calls, "w": pyro.param("w_loc").detach().clone()}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.slow
def test_noise_scale_adds_no_collective_and_changes_no_result(overlap: bool) -> None:
    def both(compression: str) -> list[dict[str, Any]]:
        return [
            run_workers(count_and_train, noise, overlap, compression)[0] for noise in (False, True)
        ]

    off, on = both("none")
    assert on["calls"] == off["calls"]
    assert torch.equal(on["w"], off["w"])
    assert not torch.equal(on["w"], dataset(1.0)[2]), "it trained"
    # Compressed buckets cannot carry the norm: one 8-byte all-reduce per step.
    off, on = both("fp16")
    assert torch.equal(on["w"], off["w"])
    assert Counter(on["calls"]) - Counter(off["calls"]) == {("allreduce_sum", 1): 6}
    assert len(on["calls"]) == len(off["calls"]) + 6


def skip_a_nonfinite_step() -> list[NoiseScale]:
    pyro.clear_param_store()
    x, y, w = dataset(1.0)
    pyro.param("w_loc", w.clone())
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.0}), noise_scale=True)
    draws = torch.Generator().manual_seed(pd.rank())
    seen = []
    for step in range(4):
        indices = torch.randint(N, (BATCH,), generator=draws)
        loss = Trace_ELBO().differentiable_loss(model, delta_guide, x, y, indices)
        loss.backward()
        param = pyro.param("w_loc").unconstrained()
        if step == 2 and pd.rank() == 1:
            param.grad[0] = math.nan  # type: ignore[index]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            optim([param])
        param.grad = None
        seen.append(optim.noise_scale())
    return seen


def test_a_skipped_nonfinite_step_leaves_the_estimate_alone() -> None:
    for seen in run_workers(skip_a_nonfinite_step):
        assert [s.steps for s in seen] == [1, 2, 2, 3]
        assert seen[2] == seen[1]
        assert all(math.isfinite(s.b_simple) for s in seen)


# ---------------------------------------------------------------------------
# Bad input, and the reading.


@pytest.mark.parametrize("value", [2.0, 0.0, 1.0, -0.5, math.nan])
def test_a_smoothing_factor_outside_the_unit_interval_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="noise_scale must be"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local", noise_scale=value)


def test_noise_scale_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="noise_scale must be"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local", noise_scale="on")  # type: ignore[arg-type]


def test_one_worker_is_told_it_needs_two_or_more() -> None:
    with pytest.raises(ValueError, match="needs two or more workers"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local", noise_scale=True)


def test_asking_without_measuring_is_refused() -> None:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local")
    with pytest.raises(ValueError, match="noise_scale=True"):
        optim.noise_scale()


def test_the_reading_names_the_critical_worker_count() -> None:
    estimate = NoiseScale(2.0, 12.4, 6.2, world_size=2, steps=100, batch_size=32)
    assert "more than about 6 workers at this batch size will mostly waste compute" in str(estimate)
    assert estimate.critical_workers == 6.2 and estimate.b_simple_points == 6.2 * 32
    buried = NoiseScale(-1.0, 5.0, math.inf, world_size=2, steps=10)
    assert "buried in noise" in buried.advice()
    assert (
        "no noise-scale measurement yet" in NoiseScale(math.nan, math.nan, math.nan, 2, 0).advice()
    )
    assert "past the critical batch size" in NoiseScale(10.0, 3.0, 0.3, 2, 5).advice()
