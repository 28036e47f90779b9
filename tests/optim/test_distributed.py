"""DistributedOptimizer on real worker processes (torch engine, gloo, 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Sequence

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_sample

import pyro_distributed as pd

from ..support.harness import CountingEngine, run_workers
from ..support.models import (
    bayesian_regression,
    empty_guide,
    param_values,
    point_regression,
    regression_data,
    train_bayesian_regression,
)


def assert_identical_across_workers(results: Sequence[dict[str, torch.Tensor]]) -> None:
    first = results[0]
    assert first, "no parameters to compare"
    for rank, other in enumerate(results[1:], start=1):
        assert other.keys() == first.keys()
        for name, value in first.items():
            assert torch.equal(value, other[name]), f"{name!r} differs on worker {rank}"


# --- parameters stay identical -------------------------------------------------------------


def _svi_with_own_seed_and_data(steps: int) -> dict[str, torch.Tensor]:
    pyro.set_rng_seed(100 + pd.rank())  # different guide noise and inits per worker
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    train_bayesian_regression(optim, data_seed=pd.rank(), steps=steps)
    return param_values()


@pytest.mark.parametrize("world_size", [1, 2])
def test_params_stay_bitwise_identical_after_many_svi_steps(world_size: int) -> None:
    results = run_workers(_svi_with_own_seed_and_data, 60, world_size=world_size)
    assert_identical_across_workers(results)
    # Training happened: the posterior mean of w moved towards the true (1, 2, 3).
    w_loc = results[0]["AutoNormal.locs.w"]
    assert torch.allclose(w_loc, torch.tensor([1.0, 2.0, 3.0]), atol=1.0)


def _lazy_params_initial_and_final() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    pyro.set_rng_seed(pd.rank())
    x, y = regression_data(pd.rank(), 16)
    guide = AutoNormal(bayesian_regression, init_loc_fn=init_to_sample)
    guide(x, y)  # creates the params from this worker's own random prototype trace
    initial = param_values()
    svi = SVI(
        bayesian_regression,
        guide,
        pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.0})),
        Trace_ELBO(),
    )
    svi.step(x, y)
    return initial, param_values()


def test_lazily_created_params_start_identical_when_seeds_differ() -> None:
    (initial0, final0), (initial1, final1) = run_workers(_lazy_params_initial_and_final)
    assert not torch.equal(initial0["AutoNormal.locs.w"], initial1["AutoNormal.locs.w"])
    assert_identical_across_workers([final0, final1])
    # With lr=0 the broadcast alone sets the values: everyone holds worker 0's init.
    assert_identical_across_workers([initial0, final1])


# --- the average is the right one ---------------------------------------------------------


def _train_point_regression(
    batches: list[int], optim_name: str, steps: int
) -> dict[str, torch.Tensor]:
    """Each worker trains on the concatenation of its assigned batches."""
    parts = [regression_data(seed, 8) for seed in batches]
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    optims = {
        "adam": pyro.optim.Adam({"lr": 0.05}),
        "sgd": pyro.optim.SGD({"lr": 1e-4, "momentum": 0.9}),
    }
    svi = SVI(
        point_regression, empty_guide, pd.DistributedOptimizer(optims[optim_name]), Trace_ELBO()
    )
    for _ in range(steps):
        svi.step(x, y)
    return param_values()


def _worker_batch(optim_name: str, steps: int) -> dict[str, torch.Tensor]:
    return _train_point_regression([pd.rank()], optim_name, steps)


@pytest.mark.parametrize("optim_name", ["adam", "sgd"])
def test_two_workers_match_one_process_on_the_concatenated_batch(optim_name: str) -> None:
    distributed = run_workers(_worker_batch, optim_name, 40, world_size=2)
    (single,) = run_workers(_train_point_regression, [0, 1], optim_name, 40, world_size=1)
    assert_identical_across_workers(distributed)
    for name, value in single.items():
        assert torch.allclose(distributed[0][name], value, rtol=1e-4, atol=1e-5), name
    # And the run did something: w is far from its zero init.
    assert single["w"].abs().sum() > 0.5


def _param_used_by_worker_one_only() -> tuple[float, float | None]:
    store = pyro.get_param_store()
    shared = pyro.param("shared", torch.tensor(1.0)).unconstrained()
    always = pyro.param("always", torch.tensor(1.0)).unconstrained()
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.1}))
    used = [always, shared] if pd.rank() == 1 else [always]
    loss = sum(3.0 * p for p in used)
    loss.backward()  # type: ignore[union-attr]
    optim(used)
    grad_after = shared.grad
    return float(store["shared"]), None if grad_after is None else float(grad_after)


def test_param_used_on_some_workers_is_stepped_everywhere_with_zero_contribution() -> None:
    (value0, grad0), (value1, grad1) = run_workers(_param_used_by_worker_one_only)
    # gradient 3 on worker 1, nothing on worker 0: the average is 1.5
    assert value0 == value1 == pytest.approx(1.0 - 0.1 * 1.5)
    # the worker that did not use it is left with no stale gradient
    assert grad0 is None
    assert grad1 == pytest.approx(1.5)


def _grad_on_some_workers_only() -> dict[str, float]:
    a = pyro.param("a", torch.tensor(1.0)).unconstrained()
    b = pyro.param("b", torch.tensor(1.0)).unconstrained()
    nowhere = pyro.param("nowhere", torch.tensor(1.0)).unconstrained()
    # weight decay would move a parameter stepped with a zero gradient
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.1, "weight_decay": 0.5}))
    loss = 2.0 * a + (4.0 * b if pd.rank() == 0 else 0.0)
    loss.backward()  # type: ignore[union-attr]
    optim([a, b, nowhere])
    return {name: float(p) for name, p in pyro.get_param_store().named_parameters()}


def test_grad_missing_on_one_worker_counts_as_zero_and_missing_everywhere_skips() -> None:
    results = run_workers(_grad_on_some_workers_only)
    assert results[0] == results[1]
    assert results[0]["a"] == pytest.approx(1.0 - 0.1 * (2.0 + 0.5))
    assert results[0]["b"] == pytest.approx(1.0 - 0.1 * (2.0 + 0.5))
    assert results[0]["nowhere"] == 1.0


# --- collectives per step -----------------------------------------------------------------


def _count_collectives(num_params: int, bucket_cap_mb: float) -> list[list[tuple[str, int]]]:
    engine = CountingEngine(pd.current_engine())
    params = [pyro.param(f"p{i:03d}", torch.zeros(10)).unconstrained() for i in range(num_params)]
    optim = pd.DistributedOptimizer(
        pyro.optim.SGD({"lr": 0.1}), engine=engine, bucket_cap_mb=bucket_cap_mb, overlap=False
    )
    per_step = []
    for _ in range(3):
        sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
        engine.calls.clear()
        optim(set(params))
        per_step.append(list(engine.calls))
    return per_step


def test_four_hundred_params_cost_two_collectives_per_step() -> None:
    per_step = run_workers(_count_collectives, 400, 25.0)[0]
    first, *later = per_step
    # header, one broadcast of all new params, one gradient buffer; then, once,
    # the check that every worker found the same module buffers (none here)
    assert first == [
        ("allreduce_max", 1), ("broadcast", 1), ("allreduce_sum", 1), ("allgather_object", 1),
    ]  # fmt: skip
    assert later == [[("allreduce_max", 1), ("allreduce_sum", 1)]] * 2


def test_bucket_cap_splits_the_gradient_buffer() -> None:
    # 400 params x 10 floats x 4 bytes = 16000 bytes; a 4000-byte cap gives 4 buckets
    per_step = run_workers(_count_collectives, 400, 4000 / 2**20)[0]
    assert per_step[-1] == [("allreduce_max", 1), ("allreduce_sum", 4)]


# --- input checking, in one process -------------------------------------------------------


def test_unknown_and_invalid_optimizer_arguments() -> None:
    adam = pyro.optim.Adam({"lr": 0.1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_size'"):
        pd.DistributedOptimizer(adam, engine="local", bucket_size=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="nonfinite must be 'skip' or 'raise'"):
        pd.DistributedOptimizer(adam, engine="local", nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="check_every must be a positive int"):
        pd.DistributedOptimizer(adam, engine="local", check_every=0)
    with pytest.raises(TypeError, match="engine must be a name or an Engine"):
        pd.DistributedOptimizer(adam, engine=2)  # type: ignore[arg-type]
    pd.shutdown()


def test_rejects_a_torch_optimizer_class() -> None:
    with pytest.raises(TypeError, match=r"pyro_optim must be a pyro\.optim\.PyroOptim"):
        pd.DistributedOptimizer(torch.optim.Adam)  # type: ignore[arg-type]


def test_rejects_wrapping_twice() -> None:
    once = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local")
    with pytest.raises(
        TypeError, match="already a DistributedOptimizer; wrap the plain optimizer once"
    ):
        pd.DistributedOptimizer(once)


@pytest.mark.parametrize(
    ("keyword", "value", "message"),
    [
        ("overlap", "yes", "overlap must be True or False, got 'yes'"),
        ("multi_tensor", 1, "multi_tensor must be True, False or None, got 1"),
    ],
)
def test_rejects_non_bool_switches(keyword: str, value: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local", **{keyword: value})


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan")])
def test_rejects_bad_bucket_caps(cap: float) -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive and finite"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local", bucket_cap_mb=cap)


def _tensor_outside_the_store() -> str:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    with pytest.raises(ValueError, match="not in Pyro's param store") as info:
        optim([torch.zeros(2, requires_grad=True)])
    return str(info.value)


def test_rejects_tensors_outside_the_param_store() -> None:
    messages = run_workers(_tensor_outside_the_store)
    assert "shape (2,)" in messages[0]
