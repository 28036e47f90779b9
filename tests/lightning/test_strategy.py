"""PyroDistributedStrategy with real processes: Lightning's launcher and the outside ones.

Each test runs ``scripts/fit_regression.py`` as a user would (Lightning's
launcher starts the second process by re-running the script) and reads what
every worker ended with. Lightning is a test dependency: if it is missing,
these tests fail at import, they are not skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch  # noqa: F401 (a missing Lightning fails the run here)
import pytest
import torch

from pyro_distributed import safe_files

from ..support.harness import one_pytest_worker
from ..support.lightning_reference import (
    ROOT,
    assert_each_epoch_shares_the_rows,
    assert_in_sync,
    fit,
    launch,
)
from .scripts.fit_regression import N_TEST, N_VAL, SIGMA, N, make_data


def exact_posterior() -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior of w given all N rows (conjugate: prior N(0, 10^2), known sigma)."""
    x, y = make_data(N, 0).tensors
    precision = x.T @ x / SIGMA**2 + torch.eye(3) / 100.0
    covariance = torch.linalg.inv(precision)
    return covariance @ x.T @ y / SIGMA**2, covariance.diag().sqrt()


def assert_matches_all_the_data(record: Any) -> None:
    """The posterior of all N rows, not of one worker's half (whose widths
    would be sqrt(2) times too wide)."""
    loc, scale = exact_posterior()
    fitted = record["posterior"]
    assert torch.allclose(fitted["loc"], loc, atol=0.05), (fitted["loc"], loc)
    ratio = fitted["scale"] / scale
    assert ((ratio > 0.75) & (ratio < 1.3)).all(), (fitted["scale"], scale)


def test_automatic_optimization_on_lightnings_launcher(tmp_path: Path) -> None:
    records = fit(tmp_path, "--plan", "auto", "--epochs", "4", "--lr", "0.05")
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["engine_world_size"] == 2 for r in records)
    assert_in_sync(records)
    assert_each_epoch_shares_the_rows(records, epochs=4)
    assert [r["global_step"] for r in records] == [20, 20]
    # Validation: each row once, on one worker; the logged sum is global.
    first, second = (set(r["val_seen"]) for r in records)
    assert not first & second and first | second == set(range(N_VAL))
    assert all(r["metrics"]["val_rows"] == N_VAL for r in records)
    assert records[0]["metrics"]["train_loss"] == records[1]["metrics"]["train_loss"]
    # Testing too: the rows split between both workers, each once; the logged sum is global.
    first, second = (r["test_seen"] for r in records)
    assert first and second
    assert sorted(first + second) == list(range(N_TEST))
    assert all(r["test_metrics"]["test_rows"] == N_TEST for r in records)
    # Collectives on the engine; predictions in the data's order on worker 0.
    assert [r["reduce_sum"] for r in records] == [3.0, 3.0]
    assert [r["reduce_min"] for r in records] == [1.0, 1.0]
    assert [r["broadcast"] for r in records] == ["from 1", "from 1"]
    assert records[0]["predictions"] == list(range(N_VAL))
    assert records[1]["predictions"] == []


def test_scvi_style_manual_plan_stays_in_sync_and_fits_all_the_data(tmp_path: Path) -> None:
    records = fit(tmp_path, "--plan", "manual", "--epochs", "60")
    assert [r["built_alone"] for r in records] == [1, 1]  # built before the process group
    assert_in_sync(records)
    assert_each_epoch_shares_the_rows(records, epochs=60)
    assert_matches_all_the_data(records[0])


def test_scvi_style_manual_plan_under_plain_ddp_stays_in_sync(tmp_path: Path) -> None:
    # Plain DDP arms no reducer for SVI.step; our optimizer, built before
    # Lightning made the process group, adopts it at its first step.
    records = fit(tmp_path, "--plan", "manual", "--strategy", "ddp", "--epochs", "60")
    assert [r["built_alone"] for r in records] == [1, 1]
    assert [r["engine_world_size"] for r in records] == [2, 2]
    assert_in_sync(records)
    assert_matches_all_the_data(records[0])


def test_the_strategy_under_torchrun(tmp_path: Path) -> None:
    # optimizer_options reach the optimizers the strategy wraps: a drift check
    # after every step (which would raise on drift), and multi_tensor, which
    # concerns pyro.optim optimizers alone, left out for this torch one.
    options = '{"check_every": 1, "bucket_cap_mb": 1, "multi_tensor": true}'
    records = fit(
        tmp_path, "--plan", "auto", "--epochs", "2", "--optimizer-options", options, torchrun=True
    )
    assert [r["check_every"] for r in records] == [1, 1]
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["engine_world_size"] == 2 for r in records)
    assert_in_sync(records)
    assert_each_epoch_shares_the_rows(records, epochs=2)
    assert records[0]["predictions"] == list(range(N_VAL))


def test_early_stopping_stops_every_worker_at_the_same_step(tmp_path: Path) -> None:
    # Worker 1's signal gets worse at epoch 1 (patience 1: it stops there);
    # worker 0's keeps improving. Both must stop together.
    records = fit(tmp_path, "--plan", "auto", "--epochs", "8", "--early-stop")
    assert [r["global_step"] for r in records] == [10, 10]  # 2 epochs of 5 steps, not 8
    assert_in_sync(records)


AUTO_PLAN = ("--plan", "auto", "--val-every", "1")
SHARES_AUTO_CHECKPOINTS = one_pytest_worker(f"{__name__}.auto_checkpoints")


@pytest.fixture(scope="module")
def auto_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A W=2 run that writes checkpoints (2 epochs), read by both resume tests.

    Validation runs every epoch, here and in every resumed or straight run:
    its loader draws from the RNG.
    """
    root = tmp_path_factory.mktemp("auto-checkpoints")
    directory = root / "checkpoints"
    first = fit(root / "first", *AUTO_PLAN, "--epochs", "2", "--checkpoint-dir", str(directory))
    return {"first": first, "last": directory / "last.ckpt"}


@SHARES_AUTO_CHECKPOINTS
def test_a_run_resumed_from_model_checkpoint_continues_bitwise(
    tmp_path: Path, auto_checkpoints: dict[str, Any]
) -> None:
    straight = fit(tmp_path / "straight", *AUTO_PLAN, "--epochs", "4")
    resume = ["--epochs", "4", "--resume", str(auto_checkpoints["last"])]
    resumed = fit(tmp_path / "resumed", *AUTO_PLAN, *resume)
    assert [r["global_step"] for r in resumed] == [20, 20]
    for a, b in zip(straight, resumed, strict=True):
        for name in a["posterior"]:
            assert torch.equal(a["posterior"][name], b["posterior"][name]), name


@SHARES_AUTO_CHECKPOINTS
def test_a_checkpoint_resumes_at_another_world_size(
    tmp_path: Path, auto_checkpoints: dict[str, Any]
) -> None:
    # Written by 2 workers, resumed by 1: the module and optimizer state are
    # whole; RNG states are per worker and restored only at the same W.
    resume = ["--epochs", "3", "--resume", str(auto_checkpoints["last"])]
    (one,) = fit(tmp_path / "one", *AUTO_PLAN, *resume, workers=1)
    # 2 x 5 steps restored, then one epoch of 10 steps alone (from scratch: 30).
    assert one["world_size"] == 1 and one["global_step"] == 10 + 10
    assert len(one["seen"]) == N  # the third epoch: every row, on the one worker
    assert [r["global_step"] for r in auto_checkpoints["first"]] == [10, 10]


@pytest.mark.horovod
def test_the_strategy_on_horovod_under_horovodrun(tmp_path: Path) -> None:
    # Lightning 2 has no Horovod strategy; this is one: no torch process group,
    # every collective (gradients, logging, prediction) on Horovod.
    options = ["--plan", "auto", "--epochs", "2", "--engine", "horovod"]
    records = fit(tmp_path, *options, horovodrun=True)
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["engine_world_size"] == 2 for r in records)
    assert_in_sync(records)
    assert_each_epoch_shares_the_rows(records, epochs=2)
    assert all(r["metrics"]["val_rows"] == N_VAL for r in records)
    assert [r["reduce_sum"] for r in records] == [3.0, 3.0]
    assert records[0]["predictions"] == list(range(N_VAL))


@pytest.mark.horovod
def test_engine_auto_and_devices_under_horovodrun_mean_what_they_mean_elsewhere(
    tmp_path: Path,
) -> None:
    # The same Trainer line as under torchrun and mpiexec (devices=2 for the
    # two workers horovodrun started, engine="auto"): one model, on Horovod,
    # never Lightning's own launcher starting more workers inside Horovod's.
    records = fit(tmp_path, "--plan", "auto", "--epochs", "2", horovodrun=True)
    assert_a_full_run_on_two_workers(records, "horovod")


@pytest.mark.horovod
def test_devices_that_do_not_count_horovodruns_workers_are_refused(tmp_path: Path) -> None:
    code, output = launch(tmp_path, "--plan", "auto", "--devices", "1", horovodrun=True)
    assert code != 0, output
    assert "horovodrun started 2 worker(s) but the Trainer counts devices=1 x num_nodes=1" in (
        output
    )


def assert_a_full_run_on_two_workers(records: list[Any], engine: str) -> None:
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["engine_world_size"] == 2 for r in records)
    assert [r["engine"] for r in records] == [engine, engine]
    assert_in_sync(records)
    assert_each_epoch_shares_the_rows(records, epochs=2)
    assert all(r["metrics"]["val_rows"] == N_VAL for r in records)  # a global sum
    assert [r["reduce_sum"] for r in records] == [3.0, 3.0]
    assert records[0]["predictions"] == list(range(N_VAL))
    assert records[1]["predictions"] == []


@pytest.mark.mpi
def test_the_strategy_on_mpi_under_mpiexec(tmp_path: Path) -> None:
    # mpiexec starts both workers (devices=2: workers per machine, as under
    # torchrun); every collective runs on MPI, with no torch process group,
    # those of a checkpoint of local parameters (each worker's own rows) included.
    directory = tmp_path / "checkpoints"
    options = ["--plan", "local", "--epochs", "2", "--checkpoint-dir", str(directory)]
    records = fit(tmp_path, *options, "--engine", "mpi", mpiexec=True)
    assert_a_full_run_on_two_workers(records, "mpi")
    local = torch.load(directory / "last.ckpt")["pyro_distributed"]["local"]
    for rank, record in enumerate(records):
        path = directory / f"last.ckpt.{local['token']}.block{rank}of2"
        block = safe_files.load(path, "block", trusted=False)[1]
        for name, value in block["params"].items():
            assert torch.equal(value, record["params"][name]["value"]), (rank, name)


@pytest.mark.mpi
def test_engine_auto_under_mpiexec_trains_one_model_on_lightnings_process_group(
    tmp_path: Path,
) -> None:
    # Lightning's MPIEnvironment counts mpiexec's workers and makes the torch
    # process group: "auto" adopts it, never one replica per process.
    records = fit(tmp_path, "--plan", "auto", "--epochs", "2", mpiexec=True)
    assert_a_full_run_on_two_workers(records, "torch")


@pytest.mark.mpi
def test_devices_that_do_not_count_mpiexecs_workers_are_refused(tmp_path: Path) -> None:
    options = ["--plan", "auto", "--epochs", "1", "--engine", "mpi", "--devices", "1"]
    code, output = launch(tmp_path, *options, mpiexec=True)
    assert code != 0, output
    assert "mpiexec started 2 worker(s) but the Trainer counts devices=1" in output


@pytest.mark.parametrize("engine", ["local", "mpi-ish"])
def test_an_engine_the_strategy_cannot_use_is_refused(engine: str) -> None:
    from pyro_distributed.integrations.lightning import PyroDistributedStrategy

    refused = f"PyroDistributedStrategy: unknown engine '{engine}'; choose one of 'auto', "
    with pytest.raises(ValueError, match=refused + "'horovod', 'torch', 'mpi'$"):
        PyroDistributedStrategy(engine=engine)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"local_updates": "sparse"}, ValueError, "needs own_local_params=True"),
        ({"local_updates": "lazy", "own_local_params": True}, ValueError, "'dense' or 'sparse'"),
        ({"local_updates": True, "own_local_params": True}, TypeError, "'dense' or 'sparse'"),
    ],
)
def test_local_updates_the_strategy_cannot_use_are_refused(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    from pyro_distributed.integrations.lightning import PyroDistributedStrategy

    with pytest.raises(error, match=message) as raised:
        PyroDistributedStrategy(**options)
    assert str(raised.value).startswith("PyroDistributedStrategy:")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ([("overlap", True)], TypeError, "optimizer_options must be a dict, got list"),
        ({"engine": "torch"}, TypeError, "cannot hold 'engine'; pass engine= instead"),
        ({"bucket_cap": 1}, TypeError, "unknown optimizer option\\(s\\) 'bucket_cap'; choose"),
        ({"bucket_cap_mb": -1}, ValueError, "bucket_cap_mb"),
        ({"compression": "fp8"}, ValueError, "compression must be"),
        ({"overlap": "yes"}, TypeError, "overlap must be True or False"),
        ({"multi_tensor": 1}, TypeError, "multi_tensor must be True, False or None"),
    ],
)
def test_optimizer_options_are_checked_when_the_strategy_is_made(
    options: Any, error: type[Exception], message: str
) -> None:
    from pyro_distributed.integrations.lightning import PyroDistributedStrategy

    with pytest.raises(error, match=message) as raised:
        PyroDistributedStrategy(optimizer_options=options)
    assert str(raised.value).startswith("PyroDistributedStrategy:")


def test_the_core_package_never_imports_lightning() -> None:
    code = "import sys, pyro_distributed; assert 'lightning' not in sys.modules, 'imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_the_strategy_is_registered_under_its_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from pyro_distributed.integrations.lightning import PyroDistributedStrategy

    assert StrategyRegistry.get("pyro_distributed").__class__ is PyroDistributedStrategy
