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
    slurm_step,
    slurm_step_port,
    torch_rendezvous_from_slurm,
)
from pyro_distributed.engines.variables import first_host
from pyro_distributed.errors import PyroDistributedError

from ..support.harness import free_port, one_pytest_worker

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
    said = f"refused PyroDistributedError: port {port} (SLURM_STEP_RESV_PORTS={port}-{port})"
    assert f"{said}, where worker 0 of this srun step (job.step 4242.0)" in output
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


# --- a launcher's variables that no launcher would write -------------------------------------

#: What each launcher gives a worker (rank 0 of 2), to spoil one variable of.
_TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0"}
_SRUN = {
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
}  # fmt: skip
_HOROVODRUN = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}
_MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
_PMI = {"PMI_RANK": "0", "PMI_SIZE": "2"}
_MVAPICH = {"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"}

#: (launcher's variables, the spoilt one, its value): each refused by name at once.
SPOILT = [
    (_TORCHRUN, "WORLD_SIZE", "abc"),
    (_TORCHRUN, "WORLD_SIZE", "0"),
    (_TORCHRUN, "RANK", "abc"),
    (_TORCHRUN, "RANK", "-1"),
    (_TORCHRUN, "RANK", "2"),
    (_TORCHRUN, "LOCAL_RANK", "x"),
    (_TORCHRUN, "MASTER_ADDR", "node[1-"),
    (_TORCHRUN, "MASTER_PORT", "abc"),
    (_SRUN, "SLURM_STEP_NUM_TASKS", "abc"),
    (_SRUN, "SLURM_STEP_NUM_TASKS", "0"),
    (_SRUN, "SLURM_PROCID", "x"),
    (_SRUN, "SLURM_PROCID", "2"),
    (_SRUN, "SLURM_LOCALID", "-1"),
    (_SRUN, "SLURM_STEP_NODELIST", "node[1-"),
    (_SRUN, "SLURM_STEP_NODELIST", "a,,b"),
    (_SRUN, "SLURM_JOB_ID", "abc"),
    (_SRUN, "SLURM_STEP_ID", "-2"),
    (_SRUN, "SLURM_STEP_RESV_PORTS", "abc"),
    (_SRUN, "SLURM_STEP_RESV_PORTS", "70000"),
    (_SRUN, "MASTER_PORT", "0"),
    ({**_SRUN, "SLURM_PTY_PORT": "42819"}, "SLURM_TASK_PID", "abc"),
    (_HOROVODRUN, "HOROVOD_SIZE", "abc"),
    (_HOROVODRUN, "HOROVOD_RANK", "2"),
    (_MPIRUN, "OMPI_COMM_WORLD_SIZE", "abc"),
    (_MPIRUN, "OMPI_COMM_WORLD_RANK", "-1"),
    (_PMI, "PMI_RANK", "5"),
    (_MVAPICH, "MV2_COMM_WORLD_SIZE", "0"),
    ({"PMIX_RANK": "x"}, "PMIX_RANK", "x"),
]
#: The time-out every spoilt worker starts with: none of them may wait for it.
_SPOILT_TIMEOUT_S = 20


def _worker(variables: dict[str, str], timeout: float) -> tuple[subprocess.Popen[str], float]:
    """``join_and_report.py auto TIMEOUT`` with ``variables`` as its launcher's, started now."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env = {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **variables}
    command = [sys.executable, str(SCRIPT), "auto", str(timeout)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    return subprocess.Popen(command, env=env, cwd=ROOT, text=True, **pipes), time.monotonic()


def _finish(process: subprocess.Popen[str], started: float) -> tuple[int, str, float]:
    """The exit status, the output and the seconds it took."""
    output, _ = process.communicate(timeout=120)
    return process.returncode, output, time.monotonic() - started


@pytest.fixture(scope="module")
def spoilt_outcomes() -> dict[tuple[str, str], tuple[int, str, float]]:
    """Every case of ``SPOILT`` run as a real worker, four at a time."""
    outcomes = {}
    for first in range(0, len(SPOILT), 4):
        running = []
        for variables, name, value in SPOILT[first : first + 4]:
            env = {**variables, "MASTER_PORT": str(free_port()), name: value}
            if name == "SLURM_STEP_RESV_PORTS":
                del env["MASTER_PORT"]  # which would win over the reserved ports
            running.append(((name, value), *_worker(env, _SPOILT_TIMEOUT_S)))
        for case, process, started in running:
            outcomes[case] = _finish(process, started)
    return outcomes


@one_pytest_worker(f"{__name__}.spoilt")  # the cases share one module fixture's workers
@pytest.mark.parametrize(("name", "value"), [(name, value) for _, name, value in SPOILT])
def test_a_launcher_variable_no_launcher_would_write_is_refused_by_name_at_once(
    spoilt_outcomes: dict[tuple[str, str], tuple[int, str, float]], name: str, value: str
) -> None:
    code, output, seconds = spoilt_outcomes[name, value]
    assert code == 3, output
    assert f"refused ValueError: {name}={value!r} is not " in output, output
    assert "must be" in output, output  # what was expected
    assert seconds < _SPOILT_TIMEOUT_S, output  # refused, not timed out


# --- two workers, one of which cannot join ----------------------------------------------------

#: The time-out of the two-worker cases: the worker left waiting raises after it.
_PAIR_TIMEOUT_S = 4


def _pair(variables: list[dict[str, str]]) -> list[tuple[int, str, float]]:
    started = [_worker(env, _PAIR_TIMEOUT_S) for env in variables]
    return [_finish(process, start) for process, start in started]


def _bounded(seconds: float) -> bool:
    """Whether a worker that waited gave up within the time-out and the store's
    grace, with time to start the interpreter on a busy machine."""
    return seconds < _PAIR_TIMEOUT_S + 5 + 12


def test_a_rank_past_the_world_size_is_refused_and_the_worker_left_waiting_says_where() -> None:
    port = free_port()
    worker_0, spoilt = _pair(
        [{**_TORCHRUN, "MASTER_PORT": str(port), "RANK": rank} for rank in ("0", "2")]
    )
    assert spoilt[0] == 3, spoilt[1]
    assert "refused ValueError: RANK='2' is not this worker's rank" in spoilt[1], spoilt[1]
    assert "from 0 to 1 (one less than WORLD_SIZE=2)" in spoilt[1]
    assert spoilt[2] < _PAIR_TIMEOUT_S + 12, spoilt[1]  # without waiting for the time-out
    assert worker_0[0] == 3, worker_0[1]
    said = f"refused PyroDistributedError: worker 0 of this torchrun job waited at 127.0.0.1:{port}"
    assert said in worker_0[1], worker_0[1]
    assert f"(MASTER_ADDR=127.0.0.1, MASTER_PORT={port}) for all 2 workers" in worker_0[1]
    assert _bounded(worker_0[2]), worker_0


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_a_busy_master_port_is_named_by_worker_0_and_the_others_give_up_in_time(
    launcher: str,
) -> None:
    port = free_port()
    if launcher == "torchrun":
        workers = [{**_TORCHRUN, "RANK": str(rank)} for rank in range(2)]
    else:
        workers = [{**_SRUN, "SLURM_PROCID": str(rank)} for rank in range(2)]
    where = f"this {'torchrun job' if launcher == 'torchrun' else 'srun step (job.step 4242.0)'}"
    with _listening_on(port):  # another process's server holds the port
        worker_0, worker_1 = _pair([{**env, "MASTER_PORT": str(port)} for env in workers])
    assert worker_0[0] == 3, worker_0[1]
    said = f"refused PyroDistributedError: port {port} (MASTER_PORT={port}), where worker 0"
    assert f"{said} of {where} would host" in worker_0[1], worker_0[1]
    assert "is already in use" in worker_0[1]
    assert worker_0[2] < _PAIR_TIMEOUT_S + 12, worker_0[1]  # at once, not after the time-out
    assert worker_1[0] == 3, worker_1[1]
    said = f"refused PyroDistributedError: worker 1 of {where} found no rendezvous store at "
    assert said in worker_1[1], worker_1[1]
    assert f"{port} (" in worker_1[1] and f"MASTER_PORT={port}) within the time-out" in worker_1[1]
    assert _bounded(worker_1[2]), worker_1
