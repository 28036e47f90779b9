"""The library on a GPU: parameters, optimizer state, buckets, checkpoints,
evaluation and both engines with CUDA tensors.

Every test here is marked ``cuda``: deselected on machines without a GPU
(see ``tests/conftest.py``), run by ``scripts/gpu_check.sh`` with
``pytest --cuda``. ``PYRO_DISTRIBUTED_TEST_DEVICE=cpu`` runs them on the CPU
instead, which checks the tests themselves (the check's dry run does).

The workers are real processes, as everywhere in the suite: at W=1 the torch
engine (NCCL at one worker), at W=2 two workers on the one GPU of the lent
machine, once on the torch engine (which then sends CUDA tensors over gloo,
see :mod:`pyro_distributed.devices`; ``tests/test_devices.py`` checks the
choice) and once on MPI (staged through pinned host memory unless the MPI is
CUDA-aware).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.distributions import constraints

import pyro_distributed as pd

from .support.harness import run_workers

pytestmark = pytest.mark.cuda

#: The device the tests put their tensors on: cuda, or cpu to check the tests.
DEVICE = os.environ.get("PYRO_DISTRIBUTED_TEST_DEVICE", "cuda")
TOTAL = 1000  # the plates' size: each batch stands for a share of TOTAL rows
STEPS = 12


def batch(seed: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Drawn on the CPU (the same numbers on every device), then moved."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=generator)
    return x.to(DEVICE), y.to(DEVICE)


def point_model(x: torch.Tensor, y: torch.Tensor) -> None:
    """A deterministic loss: the average gradient of W batches is one process's on all."""
    w = pyro.param("w", x.new_zeros(3))
    b = pyro.param("b", x.new_zeros(()))
    scale = pyro.param("scale", x.new_ones(()), constraint=constraints.positive)
    with pyro.plate("data", TOTAL, subsample=torch.arange(len(x), device=x.device)):
        pyro.sample("obs", dist.Normal(x @ w + b, scale), obs=y)


def latent_model(x: torch.Tensor, y: torch.Tensor | None = None) -> None:
    w = pyro.sample("w", dist.Normal(x.new_zeros(3), 1.0).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pd.data_plate("data", x):
        pyro.sample("y", dist.Normal(x @ w, sigma), obs=y)


def no_guide(x: torch.Tensor, y: torch.Tensor) -> None:
    pass


def params() -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in pyro.get_param_store().named_parameters()}


def on_cpu(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.cpu() for name, value in values.items()}


def devices_held(optim: pd.DistributedOptimizer) -> set[str]:
    """The device types of every parameter and every optimizer state tensor
    (but torch's step counts, which torch keeps on the CPU)."""
    found = {p.device.type for p in params().values()}
    for state in optim.get_state().values():
        for value in state.get("state", {}).values():
            found |= {
                v.device.type
                for key, v in value.items()
                if isinstance(v, torch.Tensor) and key != "step"
            }
    return found


# --- one worker ------------------------------------------------------------------------------


def train_point(seeds: list[int], steps: int = STEPS) -> dict[str, Any]:
    parts = [batch(seed) for seed in seeds]
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    optim = pd.DistributedOptimizer(pyro.optim.ClippedAdam({"lr": 0.05, "clip_norm": 5.0}))
    svi = SVI(point_model, no_guide, optim, Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)
    return {
        "params": on_cpu(params()),
        "devices": devices_held(optim),
        "engine": pd.current_engine().name,
    }


def test_a_step_keeps_parameters_and_optimizer_state_on_the_device() -> None:
    (result,) = run_workers(train_point, [0], world_size=1)
    assert result["devices"] == {torch.device(DEVICE).type}
    assert result["params"]["w"].abs().sum() > 0.1, "the run moved w"


def train_save_resume(path: str, resume: bool) -> dict[str, torch.Tensor]:
    pyro.set_rng_seed(3)
    x, y = batch(0)
    guide = AutoNormal(latent_model)
    guide(x, y)  # create the guide's parameters before a checkpoint is loaded
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(latent_model, guide, optim, Trace_ELBO())
    if resume:
        assert pd.load_checkpoint(path, optim) == STEPS
    else:
        for _ in range(STEPS):
            svi.step(x, y)
        pd.save_checkpoint(path, optim)
    for _ in range(STEPS):
        svi.step(x, y)
    assert devices_held(optim) == {torch.device(DEVICE).type}
    return on_cpu(params())


def test_a_checkpoint_saved_on_the_device_resumes_bitwise(tmp_path: Path) -> None:
    path = str(tmp_path / "run.pt")
    (straight,) = run_workers(train_save_resume, path, False, world_size=1)
    (resumed,) = run_workers(train_save_resume, path, True, world_size=1)
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def predict_and_evaluate() -> dict[str, Any]:
    pyro.set_rng_seed(0)
    x, y = batch(0, n=200)
    guide = AutoNormal(latent_model)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(latent_model, guide, optim, Trace_ELBO())
    for _ in range(50):
        svi.step(pd.shard(x), pd.shard(y))
    test_x, test_y = batch(1, n=101)
    loss = pd.evaluate_loss(Trace_ELBO(), latent_model, guide, (test_x, test_y), batch_size=32)
    samples = pd.Predictive(latent_model, guide=guide, num_samples=20, seed=0, gather="all")(test_x)
    return {
        "loss": loss,
        "shapes": {name: tuple(value.shape) for name, value in samples.items()},
        "devices": {value.device.type for value in samples.values()},
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_predictive_and_evaluate_loss_run_on_the_device(world_size: int) -> None:
    results = run_workers(predict_and_evaluate, world_size=world_size)
    assert all(r["loss"] == results[0]["loss"] for r in results), "the same loss everywhere"
    assert torch.isfinite(torch.tensor(results[0]["loss"]))
    assert results[0]["shapes"]["y"] == (20, 101)
    assert results[0]["devices"] == {torch.device(DEVICE).type}


# --- local parameters -------------------------------------------------------------------------

LOCAL_ROWS, LOCAL_DIM, LOCAL_BATCH = 203, 3, 8


def local_model(x: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(LOCAL_DIM), 5.0).to_event(1))
    with pyro.plate("data", len(x), subsample_size=LOCAL_BATCH, device=x.device) as idx:
        z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=x[idx])


def local_guide(x: torch.Tensor) -> None:
    mu_loc = pyro.param("mu_loc", x.new_zeros(LOCAL_DIM))
    pyro.sample("mu", dist.Normal(mu_loc, 1.0).to_event(1))
    with pyro.plate("data", len(x), subsample_size=LOCAL_BATCH, device=x.device):
        init = torch.arange(float(len(x) * LOCAL_DIM), device=x.device).reshape(len(x), -1)
        loc = pyro.param("z_loc", init / 100, event_dim=1)
        scale = pyro.param(
            "z_scale", x.new_ones(len(x), LOCAL_DIM), constraint=constraints.positive, event_dim=1
        )
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))


def train_local(local_updates: str) -> dict[str, Any]:
    pd.set_rng_seed(0)
    x = (torch.randn(LOCAL_ROWS, LOCAL_DIM, generator=torch.Generator().manual_seed(2)) + 1).to(
        DEVICE
    )
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(local_model, local_guide, optim, Trace_ELBO())
    with pd.shard_subsamples(own_local_params=True, local_updates=local_updates):
        for _ in range(STEPS):
            svi.step(x)
    rows, locs = pd.local_rows("z_loc")
    whole = pd.gather_param("z_loc")
    return {
        "devices": devices_held(optim),
        "rows": (rows.device.type, len(rows)),
        "locs": locs.device.type,
        "whole": None if whole is None else (tuple(whole.shape), whole.device.type),
        "mu_loc": params()["mu_loc"].cpu(),
    }


@pytest.mark.parametrize("local_updates", ["dense", "sparse"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_owned_local_parameters_step_on_the_device(world_size: int, local_updates: str) -> None:
    results = run_workers(train_local, local_updates, world_size=world_size)
    device = torch.device(DEVICE).type
    for rank, result in enumerate(results):
        assert result["devices"] == {device}, rank
        assert result["rows"][0] == device and result["locs"] == device
        assert torch.equal(result["mu_loc"], results[0]["mu_loc"]), "global params in sync"
    assert sum(result["rows"][1] for result in results) == LOCAL_ROWS
    assert results[0]["whole"] == ((LOCAL_ROWS, LOCAL_DIM), device)


# --- two workers on one GPU, each engine ------------------------------------------------------


def worker_batch(same_batch: bool) -> dict[str, Any]:
    return train_point([0] if same_batch else [pd.rank()])


@pytest.mark.parametrize("engine", ["torch", "mpi"])
def test_two_workers_on_one_gpu_match_one_process(engine: str) -> None:
    # The same batch on both workers: (g + g) / 2 is g exactly, so bitwise.
    same = run_workers(worker_batch, True, world_size=2, engine=engine)
    (single,) = run_workers(train_point, [0], world_size=1, engine=engine)
    for result in same:
        assert result["engine"] == engine
        for name, value in single["params"].items():
            assert torch.equal(result["params"][name], value), name
    # Each worker its own batch: identical workers, one process's numbers on both batches.
    distributed = run_workers(worker_batch, False, world_size=2, engine=engine)
    (both,) = run_workers(train_point, [0, 1], world_size=1, engine=engine)
    for name, value in both["params"].items():
        assert torch.equal(distributed[1]["params"][name], distributed[0]["params"][name]), name
        assert torch.allclose(distributed[0]["params"][name], value, rtol=1e-4, atol=1e-5), name
