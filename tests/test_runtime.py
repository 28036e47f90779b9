"""The module-level API, in one plain process and on real workers."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import pyro_distributed as pd

from .support.collectives import flags
from .support.harness import ENGINES, run_workers


@pytest.fixture(autouse=True)
def _no_engine_left_running():
    yield
    pd.shutdown()


def test_plain_process_is_rank_zero_of_one() -> None:
    assert (pd.rank(), pd.local_rank(), pd.world_size(), pd.is_main()) == (0, 0, 1, True)
    assert pd.current_engine().name == "local"
    pd.barrier()


def test_all_mean_in_one_process_returns_the_same_type() -> None:
    assert pd.all_mean(2.5) == 2.5 and isinstance(pd.all_mean(2.5), float)
    assert isinstance(pd.all_mean(3), float)
    value = torch.tensor([1.0, 2.0], requires_grad=True)
    mean = pd.all_mean(value)
    assert torch.equal(mean, value.detach()) and not mean.requires_grad
    assert mean is not value


@pytest.mark.parametrize("bad", ["1.0", None, True])
def test_all_mean_rejects_non_numbers(bad: object) -> None:
    with pytest.raises(TypeError, match="all_mean: value must be a float or a tensor"):
        pd.all_mean(bad)  # type: ignore[type-var]


def test_all_mean_rejects_integer_tensors() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        pd.all_mean(torch.tensor([1, 2]))


def test_init_twice_with_the_same_engine_returns_it() -> None:
    engine = pd.init("local")
    assert pd.init("local") is engine
    assert pd.init("auto") is engine
    assert pd.init() is engine


def test_init_with_a_different_engine_is_refused() -> None:
    pd.init("local")
    with pytest.raises(pd.PyroDistributedError, match="already running the 'local' engine"):
        pd.init("torch")


def test_init_with_a_different_timeout_is_refused() -> None:
    pd.init("local", timeout=10)
    assert pd.current_engine().timeout == timedelta(seconds=10)
    with pytest.raises(pd.PyroDistributedError, match="time-out of 10 s"):
        pd.init("local", timeout=timedelta(seconds=20))


def test_unknown_engine_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown engine 'gloo'"):  # a backend, not an engine
        pd.init("gloo")


@pytest.mark.parametrize("timeout", [0, -5, float("inf"), float("nan")])
def test_bad_timeouts_are_value_errors(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive, finite duration"):
        pd.init("local", timeout=timeout)


def test_timeout_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="timeout must be seconds"):
        pd.init("local", timeout="60")  # type: ignore[arg-type]


def _world_view() -> dict[str, object]:
    engine = pd.init("auto")
    pd.barrier()
    return {
        "engine": engine.name,
        "rank": pd.rank(),
        "local_rank": pd.local_rank(),
        "world_size": pd.world_size(),
        "is_main": pd.is_main(),
        "mean_float": pd.all_mean(float(pd.rank()) * 4.0),
        "mean_tensor": pd.all_mean(torch.full((2,), float(pd.rank()), dtype=torch.float64)),
    }


def test_two_workers_see_their_ranks_and_the_means() -> None:
    views = run_workers(_world_view, engine="")  # "auto" must find torchrun's variables
    for rank, view in enumerate(views):
        assert view["engine"] == "torch"
        assert (view["rank"], view["local_rank"], view["world_size"]) == (rank, rank, 2)
        assert view["is_main"] == (rank == 0)
        assert view["mean_float"] == 2.0 and isinstance(view["mean_float"], float)
        mean_tensor = view["mean_tensor"]
        assert isinstance(mean_tensor, torch.Tensor) and mean_tensor.dtype == torch.float64
        assert torch.equal(mean_tensor, torch.full((2,), 0.5, dtype=torch.float64))


@pytest.mark.parametrize("engine", ENGINES)
def test_any_worker_and_all_workers_agree_everywhere(engine: str) -> None:
    expected = {"any": True, "all": False, "all_true": True, "none": False}
    assert run_workers(flags, world_size=3, engine=engine) == [expected] * 3


def _early_stopping() -> int:
    """Each worker's own loss plateaus at a different step; all stop at the first."""
    best, patience = float("inf"), 0
    plateau = 5 + 3 * pd.rank()
    for step in range(100):
        loss = 1.0 / (step + 1) if step < plateau else 1.0
        patience = 0 if loss < best else patience + 1
        best = min(best, loss)
        if pd.any_worker(patience >= 2):
            return step
    return -1


def test_early_stopping_ends_on_every_worker_at_the_same_step() -> None:
    assert run_workers(_early_stopping, world_size=3) == [6, 6, 6]


def test_flags_must_be_booleans() -> None:
    with pytest.raises(TypeError, match="any_worker: flag must be a bool"):
        pd.any_worker(1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="all_workers: flag must be one flag"):
        pd.all_workers(torch.tensor([True, False]))
