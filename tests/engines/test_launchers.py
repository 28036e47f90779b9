"""Every launcher's count of the workers, checked against the world the engine joined."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyro_distributed.engines.launchers import (
    check_world_size,
    declared_world_size,
    first_host,
    slurm_step,
)
from pyro_distributed.errors import PyroDistributedError

from ..harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "join_and_report.py"
_LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "HOROVOD_RANK",
    "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
    "PMIX_RANK", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RESTART_COUNT",
)  # fmt: skip


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher's variables (the test command may itself run under one)."""
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_stray_world_size_alone_declares_nothing(bare: pytest.MonkeyPatch) -> None:
    bare.setenv("WORLD_SIZE", "4")  # left in a shell: not a torchrun worker
    assert declared_world_size() is None


def test_the_innermost_launcher_counts(bare: pytest.MonkeyPatch) -> None:
    # srun started one torchrun per node; torchrun started the workers.
    for name, value in [
        ("SLURM_PROCID", "0"),
        ("SLURM_STEP_NUM_TASKS", "2"),
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("MASTER_ADDR", "n1"),
        ("MASTER_PORT", "1"),
    ]:
        bare.setenv(name, value)  # fmt: skip
    declared = declared_world_size()
    assert declared is not None
    assert (declared.launcher, declared.world_size) == ("torchrun", 8)


def test_srun_counts_only_for_a_multi_task_step(bare: pytest.MonkeyPatch) -> None:
    bare.setenv("SLURM_PROCID", "0")  # inside a batch script: one process
    bare.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert not slurm_step()
    assert declared_world_size() is None
    bare.setenv("SLURM_STEP_NUM_TASKS", "2")
    declared = declared_world_size()
    assert declared is not None
    assert (declared.variable, declared.world_size) == ("SLURM_STEP_NUM_TASKS", 2)


def test_a_singleton_under_srun_is_refused_with_the_fix(bare: pytest.MonkeyPatch) -> None:
    bare.setenv("SLURM_PROCID", "1")
    bare.setenv("SLURM_STEP_NUM_TASKS", "2")
    with pytest.raises(PyroDistributedError) as info:
        check_world_size("mpi", 1)
    message = str(info.value)
    assert "joined 1 worker(s), but srun started 2 (SLURM_STEP_NUM_TASKS=2)" in message
    assert "--mpi=pmi2" in message
    check_world_size("mpi", 2)  # the same count: nothing to say


def test_an_mpi4py_for_another_mpi_is_named(bare: pytest.MonkeyPatch) -> None:
    bare.setenv("OMPI_COMM_WORLD_RANK", "0")
    bare.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(PyroDistributedError, match=r"Open MPI's mpirun started 4 .*another MPI"):
        check_world_size("mpi", 1)


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node7", "node7"), ("a,b", "a"), ("gpu[07-09,12],cpu1", "gpu07"), ("r[3,5]x", "r3x"),
     ("", "")],
)  # fmt: skip
def test_the_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def _srun_tasks(engine: str, tasks: int = 2) -> list[tuple[int, str]]:
    """``tasks`` real processes with the environment ``srun -n TASKS --mpi=none`` gives."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    port, processes = free_port(), []
    for rank in range(tasks):
        env = {
            **base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
            "MASTER_PORT": str(port),
        }  # fmt: skip
        command = [sys.executable, str(SCRIPT), engine]
        output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        processes.append(subprocess.Popen(command, env=env, cwd=ROOT, text=True, **output))
    outcomes = []
    for process in processes:
        output, _ = process.communicate(timeout=120)
        outcomes.append((process.returncode, output))
    return outcomes


def test_srun_without_a_pmi_trains_one_model_through_torch() -> None:
    for rank, (code, output) in enumerate(_srun_tasks("auto")):
        assert code == 0, output
        assert f"joined torch {rank} 2 2" in output, output


@pytest.mark.mpi
def test_mpi_singletons_under_srun_refuse_on_every_task() -> None:
    for code, output in _srun_tasks("mpi"):
        assert code == 3, output
        assert "the mpi engine joined 1 worker(s), but srun started 2" in output, output
