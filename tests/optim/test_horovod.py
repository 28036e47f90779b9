"""HorovodOptimizer, and DistributedOptimizer on the horovod engine, under the real
``horovodrun --gloo``.

All scenarios of one world size run in a single horovodrun launch (starting
Horovod costs seconds); each test then checks its own scenario's results.
Horovod is built by ``scripts/test_newest.sh`` (the test command's newest lane, which
runs every test marked ``horovod``); these tests fail, not skip, without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

from ..support.harness import HorovodSuites, one_pytest_worker, run_workers
from ..support.models import bayesian_regression, param_values, regression_data
from ..support.module_buffers import trained as trained_with_batchnorm
from ..support.noise_scale import measured_against_exact
from ..support.semantics import clip_cases, train_each_elbo, train_each_scheduler

pytestmark = [pytest.mark.horovod, one_pytest_worker(__name__)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def _two_params() -> tuple[torch.Tensor, torch.Tensor]:
    a = pyro.param("a", torch.zeros(3)).unconstrained()
    b = pyro.param("b", torch.zeros(2)).unconstrained()
    return a, b


def _local_grads() -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients that differ by worker, with values fp16 cannot hold exactly."""
    rank = pd.rank()
    return torch.tensor([1.0, -2.0, 3.1416]) * (rank + 1), torch.tensor([0.1, 1e3]) * (rank + 2)


def averaged_grads(**horovod_kwargs: Any) -> dict[str, Any]:
    """One optimizer call with lr=0; report the gradient it averaged."""
    a, b = _two_params()
    grad_a, grad_b = _local_grads()
    optim = pd.HorovodOptimizer(pyro.optim.SGD({"lr": 0.0}), **horovod_kwargs)
    (a * grad_a).sum().backward()
    (b * grad_b).sum().backward()
    optim([a, b])
    return {"a": a.grad, "b": b.grad, "local": (grad_a, grad_b), "world": pd.world_size()}


def two_backward_passes() -> dict[str, Any]:
    a, b = _two_params()
    grad_a, grad_b = _local_grads()
    optim = pd.HorovodOptimizer(pyro.optim.SGD({"lr": 0.0}), backward_passes_per_step=2)
    for _ in range(2):
        (a * grad_a).sum().backward()
        (b * grad_b).sum().backward()
    optim([a, b])
    return {"a": a.grad, "b": b.grad, "local": (grad_a, grad_b), "world": pd.world_size()}


def grouped(groups_by_name: bool) -> dict[str, Any]:
    a, b = _two_params()
    c = pyro.param("c", torch.zeros(4)).unconstrained()
    groups: Any = [[a, c]] if groups_by_name else 2
    optim = pd.HorovodOptimizer(pyro.optim.SGD({"lr": 0.0}), groups=groups)
    grad_a, grad_b = _local_grads()
    (a * grad_a).sum().backward()
    (b * grad_b).sum().backward()
    (c * pd.rank()).sum().backward()
    optim([a, b, c])
    # One worker has no exchange at all (optim.sync is None): it sends nothing.
    buckets = None if optim.sync is None else optim.sync.bucket_count
    return {"a": a.grad, "b": b.grad, "c": c.grad, "buckets": buckets}


def seed_usage_example(steps: int) -> dict[str, Any]:
    """The seed's usage example: SVI, Trace_ELBO, a wrapped Adam."""
    pyro.set_rng_seed(pd.rank())
    x, y = regression_data(pd.rank(), 32)
    guide = AutoNormal(bayesian_regression)
    optim = pd.HorovodOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(bayesian_regression, guide, optim, loss=Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(steps)]
    return {"params": param_values(), "first": losses[0], "last": sum(losses[-10:]) / 10}


def scheduler_is_kept() -> dict[str, Any]:
    p = pyro.param("p", torch.ones(2)).unconstrained()
    scheduler = pyro.optim.ExponentialLR(
        {"optimizer": torch.optim.SGD, "optim_args": {"lr": 0.1}, "gamma": 0.5}
    )
    optim = pd.HorovodOptimizer(scheduler)
    for _ in range(3):
        (p * (pd.rank() + 1.0)).sum().backward()
        optim([p])
        p.grad = None
        optim.step()
    (inner,) = optim.optim_objs.values()
    return {"lr": inner.optimizer.param_groups[0]["lr"], "p": p.detach().clone()}


def multi_particle_elbo(steps: int) -> dict[str, Any]:
    pyro.set_rng_seed(pd.rank())
    x, y = regression_data(pd.rank(), 16)
    guide = AutoNormal(bayesian_regression)
    optim = pd.HorovodOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(bayesian_regression, guide, optim, loss=Trace_ELBO(num_particles=2))
    for _ in range(steps):
        svi.step(x, y)
    return param_values()


def param_used_on_one_worker() -> dict[str, Any]:
    shared = pyro.param("shared", torch.tensor(1.0)).unconstrained()
    always = pyro.param("always", torch.tensor(1.0)).unconstrained()
    optim = pd.HorovodOptimizer(pyro.optim.SGD({"lr": 0.1}))
    for _ in range(3):
        used = [always, shared] if pd.rank() == 1 else [always]
        sum(3.0 * p for p in used).backward()  # type: ignore[union-attr]
        optim(used)
        for p in used:
            p.grad = None
    return param_values()


def param_missing_on_one_worker() -> str:
    params = [pyro.param("common", torch.zeros(2)).unconstrained()]
    if pd.rank() == 1:
        params.append(pyro.param("extra", torch.zeros(2)).unconstrained())
    sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
    with pytest.raises(pd.PyroDistributedError) as info:
        pd.HorovodOptimizer(pyro.optim.SGD({"lr": 0.1}))(params)
    return str(info.value)


def clipping_after_averaging() -> float:
    p = pyro.param("p", torch.tensor(0.0)).unconstrained()
    optim = pd.HorovodOptimizer(pyro.optim.SGD({"lr": 1.0}, clip_args={"clip_value": 1.0}))
    (p * (4.0 if pd.rank() == 0 else 0.0)).backward()
    optim([p])
    return float(p)


def bad_arguments() -> dict[str, str]:
    hvd = _hvd()
    adam = pyro.optim.Adam({"lr": 0.1})
    cases = {
        "unknown": ({"named_parameters": []}, TypeError),
        "predivide_with_sum": ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, ValueError),
        "zero_passes": ({"backward_passes_per_step": 0}, ValueError),
        "bad_groups": ({"groups": "all"}, ValueError),
        "adasum": ({"op": hvd.Adasum}, ValueError),
        "bad_compression": ({"compression": "fp16"}, TypeError),
        "bad_op": ({"op": 99}, ValueError),
    }
    messages = {}
    for name, (kwargs, error) in cases.items():
        with pytest.raises(error) as info:
            pd.HorovodOptimizer(adam, **kwargs)
        messages[name] = str(info.value)
    with pytest.raises(TypeError) as info:
        pd.HorovodOptimizer(torch.optim.Adam)  # type: ignore[arg-type]
    messages["not_pyro_optim"] = str(info.value)
    return messages


def fp16_grads() -> dict[str, Any]:
    return averaged_grads(compression=_hvd().Compression.fp16)


def summed_grads() -> dict[str, Any]:
    return averaged_grads(op=_hvd().Sum)


def predivided_grads() -> dict[str, Any]:
    return averaged_grads(gradient_predivide_factor=2.0)


def process_set_global() -> dict[str, Any]:
    hvd = _hvd()
    return averaged_grads(process_set=hvd.global_process_set)


SCENARIOS: list[tuple[str, Any, tuple[Any, ...]]] = [
    ("plain", averaged_grads, ()),
    ("fp16", fp16_grads, ()),
    ("sum", summed_grads, ()),
    ("predivide", predivided_grads, ()),
    ("two_passes", two_backward_passes, ()),
    ("groups_int", grouped, (False,)),
    ("groups_lists", grouped, (True,)),
    ("seed_example", seed_usage_example, (150,)),
    ("scheduler", scheduler_is_kept, ()),
    ("particles", multi_particle_elbo, (5,)),
    ("used_on_one", param_used_on_one_worker, ()),
    ("missing_on_one", param_missing_on_one_worker, ()),
    ("clipping", clipping_after_averaging, ()),
    ("bad_arguments", bad_arguments, ()),
    ("process_set", process_set_global, ()),
    ("every_elbo", train_each_elbo, (False,)),
    ("every_scheduler", train_each_scheduler, (False,)),
    ("clip_cases", clip_cases, (False,)),
    ("noise_scale", measured_against_exact, (True, "none")),
    ("buffers", trained_with_batchnorm, ("pyro.module",)),
]


def exact_average(local: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack([grads[i] for grads in local]).mean(0) for i in range(2))


def assert_identical(results: list[dict[str, torch.Tensor]]) -> None:
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for name, value in results[0].items():
            assert torch.equal(value, other[name]), name


WORLD_SIZES = pytest.mark.parametrize("world_size", [1, 2])


# The predivide factor moves the division but not the result.
@pytest.mark.parametrize("scenario", ["plain", "predivide"])
@WORLD_SIZES
def test_gradients_are_averaged(scenario: str, world_size: int) -> None:
    results = outcome(scenario, world_size)
    mean_a, mean_b = exact_average([r["local"] for r in results])
    for r in results:
        assert torch.allclose(r["a"], mean_a, rtol=1e-6) and torch.allclose(r["b"], mean_b)


@WORLD_SIZES
def test_fp16_compression_changes_the_average_by_at_most_fp16_rounding(world_size: int) -> None:
    results = outcome("fp16", world_size)
    for exact, got in zip(
        exact_average([r["local"] for r in results]),
        (results[0]["a"], results[0]["b"]),
        strict=True,
    ):
        # one rounding to fp16 of each scaled input and of the sum: 2**-11 relative each
        assert torch.allclose(got, exact, rtol=3 * 2**-11, atol=0)
    if world_size == 2:
        plain = outcome("plain", 2)[0]
        assert not torch.equal(results[0]["a"], plain["a"]), "fp16 changed nothing"
    assert torch.equal(results[0]["a"], results[-1]["a"])


@WORLD_SIZES
def test_two_backward_passes_are_accumulated_before_averaging(world_size: int) -> None:
    results = outcome("two_passes", world_size)
    mean_a, mean_b = exact_average([r["local"] for r in results])
    for r in results:
        assert torch.allclose(r["a"], 2 * mean_a) and torch.allclose(r["b"], 2 * mean_b)


@WORLD_SIZES
def test_op_sum_gives_world_size_times_the_average(world_size: int) -> None:
    results = outcome("sum", world_size)
    mean_a, mean_b = exact_average([r["local"] for r in results])
    for r in results:
        assert torch.allclose(r["a"], world_size * mean_a)
        assert torch.allclose(r["b"], world_size * mean_b)


@WORLD_SIZES
def test_groups_split_the_buffers_without_changing_the_result(world_size: int) -> None:
    by_count, by_lists = outcome("groups_int", world_size), outcome("groups_lists", world_size)
    if world_size > 1:
        # 3 params in 2 contiguous groups; [[a, c]] plus b on its own: 2 buffers either way
        assert by_count[0]["buckets"] == 2 and by_lists[0]["buckets"] == 2
    else:  # one worker sends nothing
        assert by_count[0]["buckets"] is None and by_lists[0]["buckets"] is None
    for name in "abc":
        assert torch.equal(by_count[0][name], by_lists[0][name])
        assert torch.equal(by_count[0][name], by_count[-1][name])
    assert torch.allclose(by_count[0]["c"], torch.full((4,), (world_size - 1) / 2))


@WORLD_SIZES
def test_seed_usage_example_converges_with_identical_params(world_size: int) -> None:
    results = outcome("seed_example", world_size)
    assert_identical([r["params"] for r in results])
    assert results[0]["last"] < results[0]["first"] / 2
    w_loc = results[0]["params"]["AutoNormal.locs.w"]
    assert torch.allclose(w_loc, torch.tensor([1.0, 2.0, 3.0]), atol=0.5)


@WORLD_SIZES
def test_lr_scheduler_is_kept_and_steps_everywhere(world_size: int) -> None:
    # Pyro's HorovodOptimizer silently dropped the scheduler
    results = outcome("scheduler", world_size)
    for r in results:
        assert r["lr"] == pytest.approx(0.1 * 0.5**3)
        assert torch.equal(r["p"], results[0]["p"])
    mean_grad = (world_size + 1) / 2
    expected = 1.0 - mean_grad * (0.1 + 0.05 + 0.025)
    assert torch.allclose(results[0]["p"], torch.full((2,), expected))


@WORLD_SIZES
def test_multi_particle_elbo_runs_with_identical_params(world_size: int) -> None:
    # Pyro's HorovodOptimizer crashed at step 2 with num_particles=2
    assert_identical(outcome("particles", world_size))


def test_param_used_on_one_worker_is_stepped_everywhere_without_hanging() -> None:
    # Pyro's HorovodOptimizer hung both workers
    first, second = outcome("used_on_one")
    assert_identical([first, second])
    assert float(first["shared"]) == pytest.approx(1.0 - 3 * 0.1 * 1.5)


def test_param_missing_on_one_worker_raises_on_every_worker() -> None:
    messages = outcome("missing_on_one")
    assert messages[0] == messages[1]
    assert (
        "'extra' is used on worker 1 but does not exist in the param store of worker 0"
        in messages[0]
    )


def test_clipping_applies_to_the_averaged_gradient() -> None:
    # average 2.0 clipped to 1.0; clipping first would give (1.0 + 0.0) / 2
    assert outcome("clipping") == [-1.0, -1.0]


def test_bad_arguments_get_clear_errors() -> None:
    messages = outcome("bad_arguments")[0]
    assert "unexpected keyword argument(s) 'named_parameters'" in messages["unknown"]
    assert (
        "gradient_predivide_factor not supported with op != Average"
        in messages["predivide_with_sum"]
    )
    assert "backward_passes_per_step must be a positive int" in messages["zero_passes"]
    assert "groups should be a non-negative integer" in messages["bad_groups"]
    assert "op=hvd.Adasum is not supported" in messages["adasum"]
    assert "compression must be" in messages["bad_compression"]
    assert "op must be hvd.Average or hvd.Sum" in messages["bad_op"]
    assert "pyro_optim must be a pyro.optim.PyroOptim" in messages["not_pyro_optim"]


def test_explicit_global_process_set() -> None:
    results = outcome("process_set")
    mean_a, _ = exact_average([r["local"] for r in results])
    assert torch.allclose(results[0]["a"], mean_a)


def test_num_groups_is_accepted_with_horovods_deprecation_warning() -> None:
    pd.init("horovod")
    try:
        with pytest.warns(DeprecationWarning, match="num_groups"):
            pd.HorovodOptimizer(pyro.optim.Adam({"lr": 0.1}), num_groups=2)
    finally:
        pd.shutdown()


def test_unknown_kwarg_is_a_type_error_before_horovod_starts() -> None:
    with pytest.raises(TypeError, match="'lr'"):
        pd.HorovodOptimizer(pyro.optim.Adam({"lr": 0.1}), lr=0.1)


@pytest.mark.parametrize(
    ("scenario", "worker"),
    [
        ("every_elbo", train_each_elbo),
        ("every_scheduler", train_each_scheduler),
        ("clip_cases", clip_cases),
    ],
)
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_semantics_on_horovod_match_one_process(scenario: str, worker: Any) -> None:
    """ELBOs with several backward passes, every scheduler, clipping: as on the torch engine."""
    distributed = outcome(scenario)
    (single,) = run_workers(worker, True, world_size=1)
    for case, expected in single.items():
        for got in distributed:
            for name, value in expected.items():
                assert torch.equal(got[case][name], distributed[0][case][name]), (case, name)
                assert torch.allclose(got[case][name], value, rtol=1e-4, atol=1e-5), (case, name)


def adasum_error() -> str:
    with pytest.raises(ValueError) as info:
        pd.HorovodOptimizer(pyro.optim.Adam({"lr": 0.1}), op=_hvd().Adasum)
    return str(info.value)


def test_adasum_on_three_workers_names_the_power_of_two_rule() -> None:
    assert (
        outcome("adasum", 3, suite="adasum")
        == ["op=hvd.Adasum needs a power-of-2 number of workers, got 3"] * 3
    )


SUITES = HorovodSuites(
    {
        "main": SCENARIOS,
        "adasum": [("adasum", adasum_error, ())],
    }
)
outcome = SUITES.outcome


def test_noise_scale_norms_are_exact_on_horovod() -> None:
    for record in outcome("noise_scale")[0]:
        assert record["gradient_sq"] == pytest.approx(record["exact_gradient_sq"], rel=1e-4)
        assert record["trace_sigma"] == pytest.approx(record["exact_trace_sigma"], rel=1e-4)


def test_batchnorm_statistics_are_averaged_on_horovod() -> None:
    results = outcome("buffers", 2)
    assert not torch.equal(results[0]["own_first"], results[1]["own_first"])
    mean = (results[0]["own_first"] + results[1]["own_first"]) * 0.5
    for result in results:
        assert torch.allclose(result["first"], mean, rtol=1e-6, atol=1e-7)
        for name, value in results[0]["buffers"].items():
            assert torch.equal(result["buffers"][name], value), name
