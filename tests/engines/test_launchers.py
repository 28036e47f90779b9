"""Every launcher's count of the workers, checked against the world the engine joined."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pyro_distributed as pd
from pyro_distributed.engines import detect_engine
from pyro_distributed.engines.horovod import HorovodEngine
from pyro_distributed.engines.launchers import (
    check_world_size,
    declared_world_size,
    first_host,
    slurm_step,
    slurm_step_port,
    torch_rendezvous_from_slurm,
)
from pyro_distributed.errors import PyroDistributedError

from ..support.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "join_and_report.py"
_LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "HOROVOD_RANK",
    "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
    "PMIX_RANK", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_RESV_PORTS", "SLURM_PTY_PORT", "SLURM_TASK_PID",
    "TORCHELASTIC_RESTART_COUNT",
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


def _srun_tasks(
    engine: str, tasks: int = 2, ranks: list[int] | None = None, **extra: str
) -> list[tuple[int, str]]:
    """Real processes with the environment ``srun -n TASKS --mpi=none`` gives
    (those of ``ranks`` only, where given; ``extra``: more variables, which
    replace ``MASTER_PORT``)."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    port, processes = free_port(), []
    for rank in range(tasks) if ranks is None else ranks:
        env = {
            **base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
            **(extra or {"MASTER_PORT": str(port)}),
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


def test_a_stray_horovod_rank_alone_launches_nothing(bare: pytest.MonkeyPatch) -> None:
    bare.setenv("HOROVOD_RANK", "0")  # left in a shell: not a horovodrun worker
    assert not HorovodEngine.detected()
    assert detect_engine() == "local"
    assert declared_world_size() is None
    bare.setenv("HOROVOD_SIZE", "2")
    assert HorovodEngine.detected()
    assert detect_engine() == "horovod"


def _slurm_task(bare: pytest.MonkeyPatch, job: int = 4242, step: int = 0, rank: int = 0) -> None:
    """This process as task ``rank`` of a 2-task ``srun`` step on this machine."""
    for name, value in [
        ("SLURM_PROCID", str(rank)),
        ("SLURM_LOCALID", str(rank)),
        ("SLURM_STEP_NUM_TASKS", "2"),
        ("SLURM_STEP_NODELIST", "localhost"),
        ("SLURM_JOB_ID", str(job)),
        ("SLURM_STEP_ID", str(step)),
    ]:
        bare.setenv(name, value)  # fmt: skip


def test_steps_whose_ids_differ_by_a_pattern_get_ports_of_their_own(
    bare: pytest.MonkeyPatch,
) -> None:
    # Job J step s and job J+103 step s+9 met on one port (job*97 + step, mod 10000).
    ports = []
    for job, step in [(4242, 0), (4345, 9)]:
        _slurm_task(bare, job, step)
        ports.append(torch_rendezvous_from_slurm().port)
    assert ports[0] != ports[1]
    assert all(20000 <= port < 32768 for port in ports)  # below the ephemeral range
    met = [
        (job, step)
        for job in range(1000, 1200)
        for step in range(3)
        if slurm_step_port(str(job), str(step)) == slurm_step_port(str(job + 103), str(step + 9))
    ]
    assert met == []


def test_a_port_that_srun_reserved_for_the_step_is_taken_before_a_derived_one(
    bare: pytest.MonkeyPatch,
) -> None:
    _slurm_task(bare)
    bare.setenv("SLURM_STEP_RESV_PORTS", "12000-12003")  # srun --resv-ports=4
    rendezvous = torch_rendezvous_from_slurm()
    assert (rendezvous.port, rendezvous.port_source) == (12000, "SLURM_STEP_RESV_PORTS=12000-12003")
    bare.setenv("SLURM_STEP_RESV_PORTS", "12011")  # srun --resv-ports=1
    assert torch_rendezvous_from_slurm().port == 12011
    bare.setenv("MASTER_PORT", "29517")  # the user's own choice wins
    assert torch_rendezvous_from_slurm().port == 29517


@pytest.mark.parametrize("value", ["abc", "70000", "0", "-5", ""])
def test_a_malformed_master_port_is_refused_by_name_under_srun_and_torchrun(
    bare: pytest.MonkeyPatch, value: str
) -> None:
    bare.setenv("MASTER_PORT", value)
    named = rf"MASTER_PORT={value!r} is not a port: it must be a whole number from 1 to 65535"
    _slurm_task(bare)  # under srun it was ignored, for the derived port
    with pytest.raises(ValueError, match=named):
        pd.init("auto", timeout=5)
    for name in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        bare.delenv(name)
    bare.setenv("RANK", "0")  # under torchrun int() raised a bare ValueError
    bare.setenv("WORLD_SIZE", "1")
    bare.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=named):
        pd.init("auto", timeout=5)


def _listening_on(port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", port))
    listener.listen()
    return listener


def test_a_taken_derived_port_is_refused_by_the_task_that_hosts_the_store(
    bare: pytest.MonkeyPatch,
) -> None:
    # A job whose derived port is free now, taken by another process.
    job = next(job for job in range(7000, 7100) if _binds(slurm_step_port(str(job), "0")))
    _slurm_task(bare, job)
    rendezvous = torch_rendezvous_from_slurm()
    with _listening_on(rendezvous.port):
        with pytest.raises(PyroDistributedError) as info:
            rendezvous.check_port_is_free()
        message = str(info.value)
        assert f"port {rendezvous.port} (derived from SLURM_JOB_ID={job}" in message
        assert "srun --resv-ports=1" in message and "MASTER_PORT" in message
        _slurm_task(bare, job, rank=1)  # a task that hosts nothing cannot tell
        torch_rendezvous_from_slurm().check_port_is_free()
    _slurm_task(bare, job)
    rendezvous.check_port_is_free()  # free again


def _binds(port: int) -> bool:
    try:
        _listening_on(port).close()
    except OSError:
        return False
    return True


def test_a_taken_port_stops_the_store_host_at_once_naming_it() -> None:
    port = free_port()
    with _listening_on(port):
        start = time.monotonic()
        [(code, output)] = _srun_tasks("auto", ranks=[0], SLURM_STEP_RESV_PORTS=f"{port}-{port}")
    assert code == 3, output
    assert f"refused port {port} (SLURM_STEP_RESV_PORTS={port}-{port}), where worker 0" in output
    assert "is already in use" in output and "srun --resv-ports=1" in output
    assert time.monotonic() - start < 25  # not the 30 s time-out of join_and_report.py


def _interactive_shell(typed: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A shell reading commands (no -c, no script), as task 0 of ``srun --pty``
    is, with the variables ``srun -n 2 --pty bash`` gives it (``SLURM_TASK_PID``:
    the shell itself, as it sets it from ``$$``); ``typed``: its commands."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    slurm = {
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4243", "SLURM_STEP_ID": "0",
        "SLURM_PTY_PORT": "42819", "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    return subprocess.run(
        ["bash"], input=f"export SLURM_TASK_PID=$$\n{typed}\nexit\n", env={
            **base, **slurm, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env
        }, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_script_started_from_an_interactive_steps_shell_trains_alone_and_says_why() -> None:
    done = _interactive_shell(f"{sys.executable} {SCRIPT} auto")
    assert "joined local 0 1 1" in done.stdout, done.stdout + done.stderr
    assert "InteractiveStepWarning" in done.stderr
    warning = done.stderr[done.stderr.index("InteractiveStepWarning") :]
    assert "interactive srun step 4243.0" in warning
    assert "srun -n 2 python train.py" in warning
    # But srun -n 2 --pty bash -c 'cd . && python train.py' forks the script
    # from every task's shell: each is a task, and they join one world.
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    processes = []
    for rank in range(2):
        env = {
            **base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_STEP_NUM_TASKS": "2", "SLURM_PTY_PORT": "42819",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4244", "SLURM_STEP_ID": "0",
            "MASTER_PORT": str(port),
        }  # fmt: skip
        command = f"export SLURM_TASK_PID=$$; cd . && {sys.executable} {SCRIPT} auto; true"
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        processes.append(
            subprocess.Popen(["bash", "-c", command], env=env, cwd=ROOT, text=True, **pipes)
        )
    for rank, process in enumerate(processes):
        output, _ = process.communicate(timeout=120)
        assert f"joined torch {rank} 2 2" in output, output
