"""HorovodOptimizer and the horovod engine, under the real ``horovodrun --gloo``.

All scenarios of one world size run in a single horovodrun launch (starting
Horovod costs seconds); each test then checks its own scenario's results.
Horovod is built by ``scripts/test.sh``; these tests fail, not skip, without it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

from ..evaluation.test_loss import losses
from ..evaluation.test_predictive import by_data, by_samples
from ..harness import WorkerFailure, run_under_horovodrun, run_workers
from ..local.test_ownership import gathered_and_local_rows
from ..local.test_ownership import train as train_locally
from ..models import bayesian_regression, param_values, regression_data
from ..test_faults import nan_on_worker_one, uneven_epoch
from ..test_runtime import _flags
from ..test_semantics import clip_cases, train_each_elbo
from .test_consistency import drift
from .test_noise_scale import measured_against_exact
from .test_schedulers import train_each_scheduler

pytestmark = pytest.mark.horovod

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
    return {"a": a.grad, "b": b.grad, "c": c.grad, "buckets": optim.sync.bucket_count}


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


def engine_view() -> dict[str, Any]:
    engine = pd.current_engine()
    gathered = engine.allgather_object({"rank": pd.rank(), "payload": "x" * (10 * pd.rank())})
    pd.barrier()
    return {
        "engine": engine.name,
        "rank": pd.rank(),
        "world": pd.world_size(),
        "mean": pd.all_mean(float(pd.rank())),
        "gathered": gathered,
        "auto": pd.init("auto") is engine,
    }


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
    ("engine", engine_view, ()),
    ("process_set", process_set_global, ()),
    ("every_elbo", train_each_elbo, (False,)),
    ("every_scheduler", train_each_scheduler, (False,)),
    ("clip_cases", clip_cases, (False,)),
    ("noise_scale", measured_against_exact, (True, "none")),
]


@functools.cache
def results_at(world_size: int, suite: str = "main") -> dict[str, Any]:
    """One horovodrun launch per (suite, world size), shared by the tests that read it."""
    return run_under_horovodrun(SUITES[suite], world_size=world_size)


def outcome(name: str, world_size: int = 2, suite: str = "main") -> list[Any]:
    result = results_at(world_size, suite)[name]
    if isinstance(result, WorkerFailure):
        raise result
    assert len(result) == world_size
    return result


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
    if world_size > 1:  # one worker sends nothing
        # 3 params in 2 contiguous groups; [[a, c]] plus b on its own: 2 buffers either way
        assert by_count[0]["buckets"] == 2 and by_lists[0]["buckets"] == 2
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
    assert "backward_passes_per_step must be > 0" in messages["zero_passes"]
    assert "groups should be a non-negative integer" in messages["bad_groups"]
    assert "op=hvd.Adasum is not supported" in messages["adasum"]
    assert "compression must be" in messages["bad_compression"]
    assert "op must be hvd.Average or hvd.Sum" in messages["bad_op"]
    assert "pyro_optim must be a pyro.optim.PyroOptim" in messages["not_pyro_optim"]


def test_engine_auto_picks_horovod_under_horovodrun() -> None:
    for rank, view in enumerate(outcome("engine")):
        assert (view["engine"], view["rank"], view["world"], view["auto"]) == (
            "horovod",
            rank,
            2,
            True,
        )
        assert view["mean"] == 0.5
        assert view["gathered"] == [{"rank": 0, "payload": ""}, {"rank": 1, "payload": "x" * 10}]


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


SUITES: dict[str, list[tuple[str, Any, tuple[Any, ...]]]] = {
    "main": SCENARIOS,
    "faults": [
        ("nan_skip", nan_on_worker_one, ("skip",)),
        ("drift", drift, ("param",)),
        ("uneven", uneven_epoch, ()),
    ],
    "adasum": [("adasum", adasum_error, ())],
    "evaluation": [
        ("losses", losses, (2,)),
        ("by_samples", by_samples, (0, "main")),
        ("by_data", by_data, (1,)),
        ("flags", _flags, ()),
        ("owned", train_locally, (True, "adam", "hand")),
        ("replicated", train_locally, (False, "adam", "hand")),
        ("gathered", gathered_and_local_rows, ()),
    ],
}


def test_local_parameters_on_horovod_are_the_replicated_numbers() -> None:
    owned = outcome("owned", suite="evaluation")
    replicated = outcome("replicated", suite="evaluation")
    for rank, (mine, reference) in enumerate(zip(owned, replicated, strict=True)):
        indices, _ = mine["local"]["z_loc"]
        assert torch.equal(mine["values"]["mu_loc"], reference["values"]["mu_loc"])
        assert torch.equal(mine["values"]["z_loc"], reference["values"]["z_loc"][indices]), rank
    gathered = outcome("gathered", suite="evaluation")
    assert torch.equal(gathered[0]["gathered"], replicated[0]["values"]["z_loc"])
    assert gathered[1]["gathered"] is None


def test_evaluation_prediction_and_flags_on_horovod_match_one_process() -> None:
    for result in outcome("losses", suite="evaluation"):
        for kind in ("global", "batch"):
            assert result[kind] == pytest.approx(result[f"{kind}_reference"], rel=1e-6)
    for scenario, args in (("by_samples", (0, "main")), ("by_data", (1,))):
        gathered, nothing = outcome(scenario, suite="evaluation")
        (alone,) = run_workers(SCENARIO_FUNCTIONS[scenario], *args, world_size=1)
        assert nothing is None
        assert gathered.keys() == alone.keys()
        for name, value in alone.items():
            assert gathered[name].shape == value.shape, name
        # Seeded sample chunks are the same draws at any W; split by data, the
        # deterministic site shows every point in its place.
        exact = alone.keys() if scenario == "by_samples" else ["mean"]
        assert all(torch.equal(gathered[name], alone[name]) for name in exact)
    assert (
        outcome("flags", suite="evaluation")
        == [{"any": True, "all": False, "all_true": True, "none": False}] * 2
    )


SCENARIO_FUNCTIONS = {"by_samples": by_samples, "by_data": by_data}


def test_nan_skip_drift_and_uneven_epochs_on_horovod() -> None:
    first, second = outcome("nan_skip", suite="faults")
    before, skipped, _ = first["values"]
    assert torch.equal(before["p"], skipped["p"]) and torch.equal(
        second["values"][1]["p"], skipped["p"]
    )
    drift_messages = outcome("drift", suite="faults")
    assert drift_messages[0] == drift_messages[1]
    assert "workers have drifted apart: parameter 'p' differs" in drift_messages[0]
    uneven = outcome("uneven", suite="faults")
    assert uneven[0]["used"] == uneven[1]["used"] == 6


def test_a_killed_horovod_worker_ends_the_job_quickly_and_is_named(tmp_path: Any) -> None:
    script = tmp_path / "die.py"
    script.write_text(
        "import os, signal, torch, pyro, pyro_distributed as pd\n"
        "pd.init()\n"
        "p = pyro.param('p', torch.ones(2)).unconstrained()\n"
        "optim = pd.DistributedOptimizer(pyro.optim.SGD({'lr': 0.1}))\n"
        "for step in range(100):\n"
        "    if step == 5 and pd.rank() == 1:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    p.sum().backward(); optim([p]); p.grad = None\n"
    )
    command = [
        str(BIN / "horovodrun"),
        "--gloo",
        "-np",
        "2",
        "-H",
        "localhost:2",
        sys.executable,
        str(script),
    ]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert "Process 1 exit with status code 137" in done.stdout + done.stderr
    assert time.monotonic() - start < 60


def test_noise_scale_norms_are_exact_on_horovod() -> None:
    for record in outcome("noise_scale")[0]:
        assert record["gradient_sq"] == pytest.approx(record["exact_gradient_sq"], rel=1e-4)
        assert record["trace_sigma"] == pytest.approx(record["exact_trace_sigma"], rel=1e-4)
