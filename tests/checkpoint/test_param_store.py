"""Checkpoints: exact resume in fresh processes, and clear errors for bad files."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule
from torch.distributions import constraints, transform_to
from torch.distributions.transforms import identity_transform

import pyro_distributed as pd
from pyro_distributed import safe_files
from pyro_distributed.checkpoint import files

from ..support.compare import assert_same_state
from ..support.harness import run_workers, with_engines
from ..support.models import bayesian_regression, param_values, regression_data


def _new_run() -> tuple[SVI, pd.DistributedOptimizer, tuple[torch.Tensor, torch.Tensor]]:
    pyro.set_rng_seed(7 + pd.rank())
    x, y = regression_data(pd.rank(), 16)
    guide = AutoNormal(bayesian_regression)
    guide(x, y)  # create the guide's parameters before any checkpoint is loaded
    scheduler = pyro.optim.ExponentialLR(
        {"optimizer": torch.optim.Adam, "optim_args": {"lr": 0.05}, "gamma": 0.95}
    )
    optim = pd.DistributedOptimizer(scheduler)
    return SVI(bayesian_regression, guide, optim, Trace_ELBO()), optim, (x, y)


def _train(svi: SVI, optim: pd.DistributedOptimizer, data: Any, steps: int) -> None:
    for _ in range(steps):
        svi.step(*data)
        optim.step()


def _snapshot(optim: pd.DistributedOptimizer) -> dict[str, Any]:
    return {"params": param_values(), "optim": optim.get_state(), "steps": optim.num_steps}


def train_straight(steps: int) -> dict[str, Any]:
    svi, optim, data = _new_run()
    _train(svi, optim, data, steps)
    return _snapshot(optim)


def train_then_save(steps: int, path: str) -> None:
    svi, optim, data = _new_run()
    _train(svi, optim, data, steps)
    pd.save_checkpoint(path, optim)


def load_then_train(steps: int, path: str) -> dict[str, Any]:
    svi, optim, data = _new_run()
    # Only worker 0 reads the file: the others are given a path that does not exist.
    start = pd.load_checkpoint(path if pd.rank() == 0 else path + ".elsewhere", optim)
    assert start == optim.num_steps
    _train(svi, optim, data, steps)
    return _snapshot(optim)


@pytest.mark.parametrize(("engine", "world_size"), with_engines([1, 2], on_mpi=[2]))
@pytest.mark.slow
def test_resume_in_fresh_processes_equals_an_uninterrupted_run(
    engine: str, world_size: int, tmp_path: Path
) -> None:
    path = str(tmp_path / "run.pt")
    straight = run_workers(train_straight, 20, world_size=world_size, engine=engine)
    run_workers(train_then_save, 10, path, world_size=world_size, engine=engine)
    resumed = run_workers(load_then_train, 10, path, world_size=world_size, engine=engine)
    for rank in range(world_size):
        assert_same_state(resumed[rank], straight[rank])
    assert resumed[0]["steps"] == 20
    assert_same_state(resumed[-1]["params"], resumed[0]["params"])
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


def _load_expecting(path: str, error: type[Exception]) -> str:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    with pytest.raises(error) as info:
        pd.load_checkpoint(path if pd.rank() == 0 else "/nonexistent", optim)
    return str(info.value)


def _write_checkpoint(path: str) -> None:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    p = pyro.param("w", torch.zeros(3)).unconstrained()
    p.sum().backward()
    optim([p])
    pd.save_checkpoint(path, optim)


def test_corrupt_truncated_foreign_and_missing_files_give_clear_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    run_workers(_write_checkpoint, str(good))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)

    cases = [
        (garbage, ValueError, "is not a pyro_distributed file"),
        (truncated, ValueError, "is truncated"),
        (foreign, ValueError, "is a plain torch.save file"),
        (tmp_path / "missing.pt", FileNotFoundError, "no checkpoint at"),
    ]
    for path, error, message in cases:
        for rank_message in run_workers(_load_expecting, str(path), error):
            assert message in rank_message and str(path) in rank_message


def _model_with_w_of_size(size: int, path: str) -> str:
    pyro.param("w", torch.zeros(size))
    return _load_expecting(path, ValueError)


def test_checkpoint_of_a_different_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    run_workers(_write_checkpoint, str(path))
    for message in run_workers(_model_with_w_of_size, 5, str(path)):
        assert "is of a different model" in message
        assert "'w': [3] torch.float32 saved, [5] torch.float32 now" in message


class _Unpicklable(constraints.Constraint):
    def __reduce__(self) -> Any:
        raise TypeError("this constraint cannot be saved")


transform_to.register(_Unpicklable, lambda constraint: identity_transform)


def _save_fails(path: str) -> str:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    pyro.param("w", torch.zeros(3), constraint=_Unpicklable())
    with pytest.raises(pd.PyroDistributedError) as info:
        pd.save_checkpoint(path, optim)
    return str(info.value)


def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    run_workers(_write_checkpoint, str(path))
    before = path.read_bytes()
    for message in run_workers(_save_fails, str(path)):
        assert "worker 0 could not write the checkpoint" in message
        assert "cannot be saved" in message and "intact" in message
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]


def test_checkpoint_functions_need_the_distributed_optimizer(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="must be the run's DistributedOptimizer"):
        pd.save_checkpoint(tmp_path / "x.pt", pyro.optim.Adam({"lr": 0.1}))  # type: ignore[arg-type]


class _Net(PyroModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = PyroModule[torch.nn.Linear](2, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(self.linear(x).squeeze(-1), 1.0), obs=y)


def _pyro_module_run(path: str, load: bool, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = _Net()
    x, y = torch.randn(16, 2), torch.randn(16)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    svi = SVI(net, lambda x, y: None, optim, Trace_ELBO())
    svi.step(x, y)  # registers the module's parameters in the param store
    if load:
        pd.load_checkpoint(path, optim)
        assert torch.equal(net.linear.weight.detach(), param_values()["linear.weight"])
    for _ in range(steps):
        svi.step(x, y)
    if not load:
        pd.save_checkpoint(path, optim)
    return {"weight": net.linear.weight.detach().clone(), **param_values()}


@pytest.mark.slow
def test_pyro_module_networks_train_on_from_the_loaded_values(tmp_path: Path) -> None:
    path = str(tmp_path / "net.pt")
    saved, _ = run_workers(_pyro_module_run, path, False, 5)
    resumed, _ = run_workers(_pyro_module_run, path, True, 0)
    # The module itself holds the saved weights, not only the param store.
    assert torch.equal(resumed["weight"], saved["weight"])
    moved, _ = run_workers(_pyro_module_run, path, True, 3)
    assert not torch.equal(moved["weight"], saved["weight"]), "training goes on from there"


def _model_a(x: torch.Tensor) -> None:
    loc = pyro.param("a_loc", torch.zeros(()))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=x)


def _model_b(x: torch.Tensor) -> None:
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(0.0, scale), obs=x)


def _another_models_guide_after_clearing_the_store(path: str) -> dict[str, Any]:
    """Save model A, clear the store, build model B's guide (no parameters yet), load."""
    x = torch.randn(8)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    svi = SVI(_model_a, lambda x: None, optim, Trace_ELBO())
    for _ in range(5):
        svi.step(x)
    pd.save_checkpoint(path, optim)
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    svi = SVI(_model_b, AutoNormal(_model_b), optim, Trace_ELBO())
    start = pd.load_checkpoint(path, optim)
    with pytest.raises(ValueError) as info:
        svi.step(x)
    names = sorted(pyro.get_param_store().keys())
    values = {name: pyro.param(name).detach().clone() for name in names}
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    pyro.clear_param_store()
    svi = SVI(_model_b, AutoNormal(_model_b), optim, Trace_ELBO())
    partial = pd.load_checkpoint(path, optim, strict=False)
    svi.step(x)  # strict=False: what the two share (nothing) is loaded, and B trains
    return {"start": start, "error": str(info.value), "values": values, "partial": partial}


def test_another_models_checkpoint_is_refused_when_the_store_is_empty(tmp_path: Path) -> None:
    path = str(tmp_path / "a.pt")
    workers = run_workers(_another_models_guide_after_clearing_the_store, path)
    for worker in workers:
        assert worker["start"] == 5
        assert "is of a different model" in worker["error"], worker["error"]
        assert "['AutoNormal.locs.scale', 'AutoNormal.scales.scale'] are trained" in worker["error"]
        assert "['a_loc'] are in the checkpoint but not trained" in worker["error"]
        assert "strict=False" in worker["error"]
        assert worker["partial"] == 5
    # The refused step changed nothing: B's initial values, A's loaded ones.
    assert workers[0]["values"]["AutoNormal.scales.scale"].item() == pytest.approx(0.1)


def _constraint_changed(path: str) -> str:
    pyro.param("w", torch.ones(3), constraint=constraints.positive)
    return _load_expecting(path, ValueError)


def test_a_parameter_of_another_constraint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    run_workers(_write_checkpoint, str(path))
    for message in run_workers(_constraint_changed, str(path)):
        assert "is of a different model" in message
        assert "parameters differ in constraint ('w': Real() saved, GreaterThan" in message


def _slow_write(path: Path, state: dict[str, Any]) -> None:
    time.sleep(SLOW_S)  # longer than the engine's time-out: storage this slow must not fail
    safe_files.write(path, "checkpoint", {"format": "x"}, state)


def _save_and_load_on_slow_storage(path: str) -> dict[str, Any]:
    pd.init("torch", timeout=TIME_OUT_S)
    svi, optim, data = _new_run()
    _train(svi, optim, data, 3)
    before = _snapshot(optim)
    if pd.rank() == 0:
        files.write_checkpoint = _slow_write  # type: ignore[assignment]
        real_read = files.safe_files.read_payload

        def slow_read(*args: Any) -> bytearray:
            time.sleep(SLOW_S)
            return real_read(*args)

        files.safe_files.read_payload = slow_read  # type: ignore[assignment]
    began = time.monotonic()
    pd.save_checkpoint(path, optim)
    _train(svi, optim, data, 2)
    assert pd.load_checkpoint(path, optim) == 3
    return {"before": before, "after": _snapshot(optim), "took": time.monotonic() - began}


#: The engine's time-out, and storage slower than it (a loaded machine's first
#: steps need a few seconds of the time-out themselves).
TIME_OUT_S = 5.0
SLOW_S = 7.0


def test_a_save_and_a_load_on_slow_storage_outlast_the_engines_time_out(tmp_path: Path) -> None:
    path = str(tmp_path / "run.pt")
    workers = run_workers(_save_and_load_on_slow_storage, path, engine="")
    for worker in workers:
        assert worker["took"] > 2 * SLOW_S  # both waited past the engine's time-out
        assert_same_state(worker["after"]["params"], worker["before"]["params"])
