"""Run a function on W real worker processes joined by gloo on 127.0.0.1.

Workers are forked from a forkserver that has already imported torch and
Pyro, so a start costs a fraction of a second rather than a fresh import.
Each worker gets torchrun's environment variables on a free port, one thread,
and a started ``pyro_distributed`` engine, then runs ``fn(*args)``. The
parent collects every worker's return value or traceback, and fails with all
of them when any worker fails, dies or overruns the time limit.

With ``engine="mpi"`` the workers are started by the real ``mpiexec``
instead: one launch per world size, whose workers run one call after another
(``tests/support/mpi_pool.py``). A test that runs on both takes ``engine``
from its parametrization (:data:`ENGINES`, :func:`with_engines`), so that
pytest collects its MPI run beside its torch run, in its own module.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from pyro_distributed.engines import Engine
from pyro_distributed.engines.base import ReduceOp

from . import mpi_pool
from .reports import gather_reports

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "pyro", "pyro_distributed"])

#: The engine time-out inside test workers: long enough for a slow shared
#: machine, short enough that a hang fails a test within seconds.
ENGINE_TIMEOUT = 30.0


def with_engines(cases: Iterable[Any], on_mpi: Iterable[Any] = ()) -> list[Any]:
    """Parameter sets ``(engine, *case)`` for ``pytest.mark.parametrize``: every
    case on the torch engine, and the cases of ``on_mpi`` on the real ``mpiexec``
    too, marked ``mpi`` (so ``--quick`` and ``-m "not mpi"`` leave them out).

    A case is one value or a tuple of values; ``on_mpi`` names the cases worth
    their launch on MPI, where a run costs more than on the gloo spawner::

        @pytest.mark.parametrize(("engine", "workers"), with_engines([2, 3], on_mpi=[3]))
        def test_something(engine: str, workers: int) -> None:
            run_workers(fn, world_size=workers, engine=engine)
    """

    def values(case: Any) -> tuple[Any, ...]:
        return case if isinstance(case, tuple) else (case,)

    return [("torch", *values(case)) for case in cases] + [
        pytest.param("mpi", *values(case), marks=pytest.mark.mpi) for case in on_mpi
    ]


#: ``engine`` for a test without other parameters that runs on both engines:
#: ``@pytest.mark.parametrize("engine", ENGINES)``.
ENGINES = ["torch", pytest.param("mpi", marks=pytest.mark.mpi)]


#: Variables through which a launcher tells a process its place in a job.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "HOROVOD_", "TORCHELASTIC_")
_LAUNCHER_VARIABLES = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
})  # fmt: skip


def is_launcher_variable(name: str) -> bool:
    """Whether ``name`` is how some launcher (torchrun, Slurm, an MPI, Horovod)
    tells a process its place in a job; the tests start their own."""
    return name in _LAUNCHER_VARIABLES or name.startswith(_LAUNCHER_PREFIXES)


class WorkerFailure(AssertionError):
    """Some worker raised, died or did not finish; the message shows every worker."""

    def __init__(self, reports: dict[int, str], results: dict[int, Any] | None = None) -> None:
        self.reports = reports
        #: What the workers that did finish returned, by rank.
        self.results = results or {}
        body = "\n".join(f"--- worker {rank} ---\n{text}" for rank, text in sorted(reports.items()))
        super().__init__(f"{len(reports)} worker(s) failed\n{body}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that binds now and that no outgoing connection can take.

    Asking the kernel for port 0 returns an *ephemeral* port, the same pool
    that every client socket draws from: between closing it here and a worker
    listening on it, a gloo or store connection elsewhere could take it (CI
    once failed with EADDRINUSE that way). Ports below the ephemeral range are
    only ever taken by a listener that asked for them by number.
    """
    low, high = _ephemeral_range()
    candidates = [port for port in range(20000, 32768) if not low <= port <= high]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))  # no SO_REUSEADDR: TIME_WAIT counts as taken
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-32767 outside the ephemeral range {low}-{high}")


def run_script(
    command: Sequence[str], root: os.PathLike[str] | str, timeout: float
) -> tuple[int, str]:
    """Run ``command`` (a script a user would run) with this checkout importable, one
    thread per process and a free port for Lightning's launcher; its exit code and
    the end of its output."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(root),
        "MASTER_PORT": str(free_port()),  # Lightning's launcher takes its port from here
    }
    done = subprocess.run(
        list(command), capture_output=True, text=True, timeout=timeout, env=env, cwd=root,
        check=False,
    )  # fmt: skip
    return done.returncode, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _worker(
    rank: int,
    world_size: int,
    port: int,
    engine: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import pyro
    import torch

    import pyro_distributed

    torch.set_num_threads(1)
    pyro.clear_param_store()
    try:
        if engine:
            pyro_distributed.init(engine, timeout=ENGINE_TIMEOUT)
        result = ("ok", fn(*args))
    except BaseException:  # report everything, including KeyboardInterrupt
        result = ("error", traceback.format_exc())
    # Plain pickle copies tensor data; multiprocessing's own pickler would
    # share it through this process, which is about to exit.
    conn.send_bytes(pickle.dumps(result))
    conn.close()
    if result[0] == "ok":
        pyro_distributed.shutdown()
    # After an error, exit without a goodbye, as a crashing script would:
    # peers still blocked in a collective see the connection drop.


def run_workers(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    engine: str = "torch",
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` workers; return their results by rank.

    ``fn`` must be importable (a module-level function). ``engine=""`` starts
    no engine, for tests of start-up itself; ``"mpi"`` runs it under ``mpiexec``.
    """
    if engine == "mpi":
        return _run_on_mpi_pool(fn, args, world_size, timeout)
    port = free_port()
    pipes: dict[int, Connection] = {}
    processes = []
    for rank in range(world_size):
        parent_end, child_end = _CONTEXT.Pipe(duplex=False)
        process = _CONTEXT.Process(
            target=_worker,
            args=(rank, world_size, port, engine, fn, args, child_end),
            name=f"worker-{rank}",
        )
        process.start()
        child_end.close()
        pipes[rank] = parent_end
        processes.append(process)

    def died(rank: int) -> str:
        processes[rank].join(5)
        return f"died without reporting (exit code {processes[rank].exitcode})"

    results, failures = gather_reports(pipes, timeout, died)
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    if failures:
        raise WorkerFailure(failures, results)
    return [results[rank] for rank in range(world_size)]


def _launcher(engine: str, world_size: int) -> list[str]:
    """The real launcher that starts ``world_size`` workers for ``engine``, as users run it."""
    here = Path(sys.executable).parent
    if engine == "mpi":
        # The venv's (the mpich wheel's), else the one on PATH (scripts/gpu_check.sh's).
        mpiexec = here / "mpiexec"
        if not mpiexec.exists():
            mpiexec = Path(shutil.which("mpiexec") or mpiexec)
        return [str(mpiexec), "-n", str(world_size)]
    if engine == "horovod":
        hosts = f"localhost:{world_size}"
        return [str(here / "horovodrun"), "--gloo", "-np", str(world_size), "-H", hosts]
    raise ValueError(f"no launcher for engine {engine!r}: 'mpi' or 'horovod'")


def run_under_launcher(
    engine: str,
    scenarios: list[tuple[str, Callable[..., Any], tuple[Any, ...]]],
    *,
    world_size: int = 2,
    timeout: float = 300.0,
    crash_on_error: bool = False,
    engine_timeout: float = ENGINE_TIMEOUT,
) -> dict[str, Any]:
    """Run each ``(name, fn, args)`` on every worker of one launch of ``engine``'s real
    launcher (``mpiexec -n world_size`` for ``"mpi"``, ``horovodrun --gloo`` for
    ``"horovod"``), through ``tests/support/launched_runner.py``.

    Returns, by scenario name, the workers' results by rank. A scenario that
    failed on any worker maps to a :class:`WorkerFailure` instead, which the
    test that owns it raises; every worker's traceback is in it. With
    ``crash_on_error`` a worker whose scenario raised exits at once, as a
    crashing script would; the launcher then ends the job (its peers report
    nothing), instead of leaving them to wait out the engine's time-out. The
    whole launch (the launcher and every worker, in a process group of their
    own) is killed after ``timeout``.
    """
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "scenarios.pkl"
        spec.write_bytes(
            pickle.dumps(
                [(name, f"{fn.__module__}:{fn.__name__}", args) for name, fn, args in scenarios]
            )
        )
        command = [
            *_launcher(engine, world_size),
            sys.executable, "-m", "tests.support.launched_runner", engine, str(spec), tmp,
        ]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(root), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
            ).rstrip(os.pathsep),
            "TEST_ENGINE_TIMEOUT": str(engine_timeout),
            "TEST_CRASH_ON_ERROR": "1" if crash_on_error else "",
        }
        process = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        name = Path(command[0]).name
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            log = f"{name} exit code {process.returncode}\n{stdout[-4000:]}\n{stderr[-4000:]}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            log = f"{name} did not finish within {timeout:g} s\n{stdout[-2000:]}\n{stderr[-2000:]}"
        per_rank = []
        for rank in range(world_size):
            path = Path(tmp) / f"rank{rank}.pkl"
            per_rank.append(pickle.loads(path.read_bytes()) if path.exists() else {})
    return _outcomes(scenarios, per_rank, log)


def _outcomes(
    scenarios: list[tuple[str, Callable[..., Any], tuple[Any, ...]]],
    per_rank: list[dict[str, tuple[str, Any]]],
    log: str,
) -> dict[str, Any]:
    outcome: dict[str, Any] = {}
    for name, _, _ in scenarios:
        reports = {}
        values = {}
        for rank, results in enumerate(per_rank):
            status, payload = results.get(name, ("error", f"no result; {log}"))
            if status == "ok":
                values[rank] = payload
            else:
                reports[rank] = payload
        outcome[name] = WorkerFailure(reports, values) if reports else list(values.values())
    return outcome


def one_pytest_worker(module: str) -> pytest.MarkDecorator:
    """Keep a module's tests on one pytest worker (``-n 2 --dist loadgroup``).

    For modules whose tests share launches (a module-scoped fixture,
    :class:`HorovodSuites`): every pytest worker that runs one of its tests
    would otherwise start those launches again.
    """
    return pytest.mark.xdist_group(module)


class HorovodSuites:
    """Named lists of scenarios, each run once per world size in one ``horovodrun``
    launch (starting Horovod costs seconds) and shared by the tests that read it."""

    def __init__(self, suites: dict[str, list[tuple[str, Callable[..., Any], tuple[Any, ...]]]]):
        self.suites = suites
        self.launched: dict[tuple[str, int], dict[str, Any]] = {}

    def outcome(self, name: str, world_size: int = 2, suite: str = "main") -> list[Any]:
        """Scenario ``name``'s results by rank; raises its WorkerFailure if it failed."""
        key = (suite, world_size)
        if key not in self.launched:
            self.launched[key] = run_under_launcher(
                "horovod", self.suites[suite], world_size=world_size
            )
        result = self.launched[key][name]
        if isinstance(result, WorkerFailure):
            raise result
        assert len(result) == world_size
        return result


def _run_on_mpi_pool(
    fn: Callable[..., Any], args: tuple[Any, ...], world_size: int, timeout: float
) -> list[Any]:
    """:func:`run_workers` on the mpi engine: a call on this world size's one
    ``mpiexec`` launch (``tests/support/mpi_pool.py``)."""
    results, failures = mpi_pool.run(
        fn, args, world_size, timeout, _launcher("mpi", world_size), ENGINE_TIMEOUT
    )
    if failures:
        raise WorkerFailure(failures, results)
    return [results[rank] for rank in range(world_size)]


class CountingEngine(Engine):
    """Forwards every collective to a real engine and records what it sent."""

    name = "counting"

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner.timeout)
        self.inner = inner
        self.calls: list[tuple[str, int]] = []
        #: Bytes of every tensor reduced or broadcast (objects not counted).
        self.bytes = 0

    rank = property(lambda self: self.inner.rank)  # type: ignore[assignment]
    local_rank = property(lambda self: self.inner.local_rank)  # type: ignore[assignment]
    world_size = property(lambda self: self.inner.world_size)  # type: ignore[assignment]

    def allreduce_(
        self, tensors: Sequence[torch.Tensor], op: ReduceOp = "sum", names: Sequence[str] = ()
    ) -> None:
        self.calls.append((f"allreduce_{op}", len(tensors)))
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.inner.allreduce_(tensors, op, names)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        self.calls.append(("broadcast", len(tensors)))
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.inner.broadcast_(tensors, src)

    def allgather_object(self, obj: Any) -> list[Any]:
        self.calls.append(("allgather_object", 1))
        return self.inner.allgather_object(obj)

    def barrier(self) -> None:
        self.inner.barrier()

    def shutdown(self) -> None:
        pass
