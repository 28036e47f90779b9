"""The mpi engine, under the real ``mpiexec`` (MPICH's Hydra, from the ``mpich`` wheel).

Three kinds of test:

* **The pool that runs the suite's own tests on MPI.** The multi-process tests
  of the other files that also run on MPI take ``engine`` from their
  parametrization (``with_engines`` and ``ENGINES`` in
  ``tests/support/harness.py``); their ``mpi`` runs are collected in their own
  files and marked ``mpi``, and every ``run_workers(..., engine="mpi")`` shares
  one ``mpiexec`` launch per world size (``tests/support/mpi_pool.py``). Here:
  that each call starts clean and a failure ends the pool.
* **The engine's own collectives** in one ``mpiexec`` launch per world size
  (:data:`SCENARIOS`): detection, ranks, dtypes, errors.
* **Faults and examples** as users meet them: scripts under ``mpiexec``, with
  the exit code and the time it took.

mpi4py and the MPI wheel are installed by ``scripts/test.sh`` (the ``mpi``
extra); these tests fail, not skip, without them.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.checkpoint.files import load_file
from pyro_distributed.engines import detect_engine
from pyro_distributed.engines.network import own_addresses

from ..support.examples import (
    EXAMPLE,
    QUICKSTART,
    QUICKSTART_WIDTH,
    check_outputs,
    fitted_weights,
    quickstart_posterior,
    run,
    run_example,
)
from ..support.faults import die_at_step_five
from ..support.harness import WorkerFailure, run_under_launcher, run_workers

PyroError = pd.PyroDistributedError

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")


# --- the pool that runs the MPI runs of the other files' tests ----------------------------------


def pid_and_validation(raise_on: int) -> tuple[int, bool]:
    """This worker's pid and Pyro's validation switch; switches validation off
    (a pooled worker must put it back) and raises on worker ``raise_on``."""
    from pyro.infer.util import is_validation_enabled

    clean = is_validation_enabled() and "TEST_POOL_LEFTOVER" not in os.environ
    pyro.enable_validation(False)
    os.environ["TEST_POOL_LEFTOVER"] = "1"
    if pd.rank() == raise_on:
        raise ValueError(f"worker {raise_on} fails on purpose")
    return os.getpid(), clean


def test_pooled_calls_start_clean_and_a_failure_ends_the_pool_with_every_report() -> None:
    """The calls of ``run_workers`` on MPI share one ``mpiexec`` per world size
    (``tests/support/mpi_pool.py``): each call finds what the last one switched put back,
    a failing call names the raising worker's error and ends the pool, and the
    next call gets a fresh pool."""
    first = run_workers(pid_and_validation, -1, engine="mpi")
    second = run_workers(pid_and_validation, -1, engine="mpi")
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # the same processes
    assert all(clean for _, clean in first + second)
    with pytest.raises(WorkerFailure) as info:
        run_workers(pid_and_validation, 1, engine="mpi")
    assert "worker 1 fails on purpose" in info.value.reports[1]
    assert 0 in info.value.results or "died without reporting" in info.value.reports[0]
    after = run_workers(pid_and_validation, -1, engine="mpi")
    assert not {pid for pid, _ in after} & {pid for pid, _ in first}  # a fresh launch
    assert all(clean for _, clean in after)


# --- the engine's collectives, in one launch per world size ----------------------------------


def engine_view() -> dict[str, Any]:
    engine = pd.init("auto")  # mpiexec's PMI_RANK must make "auto" the mpi engine
    rank, world = pd.rank(), pd.world_size()
    gathered = engine.allgather_object({"rank": rank, "payload": "x" * (1000 * rank)})
    pd.barrier()
    return {
        "engine": engine.name,
        "detected": detect_engine(),
        "rank": rank,
        "local_rank": pd.local_rank(),
        "world": world,
        "is_main": pd.is_main(),
        "mean_float": pd.all_mean(float(rank) * 4.0),
        "mean_tensor": pd.all_mean(torch.full((2,), float(rank), dtype=torch.float64)),
        "any": pd.any_worker(rank == world - 1),
        "all": pd.all_workers(rank == world - 1),
        "gathered": gathered,
        "same_engine": pd.init("auto") is engine,
        "own_addresses": own_addresses(),
        "probe_bound": listener.bound() if (listener := engine._probe_listener) else [],
        "published": [(peer.addresses, peer.port) for peer in engine._peers],
    }


def dtypes_and_layouts() -> dict[str, Any]:
    engine, rank = pd.current_engine(), pd.rank()
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        summed = torch.arange(5, dtype=dtype) * (rank + 1)
        engine.allreduce_([summed], op="sum")
        out[f"sum {dtype}"] = summed
    counts = torch.tensor([rank, -rank], dtype=torch.int64)
    engine.allreduce_([counts], op="max")
    out["max int64"] = counts
    # A transposed view is not contiguous: reduced in a copy, written back in place.
    matrix = (torch.arange(6.0).reshape(2, 3) * (rank + 1)).t()
    engine.allreduce_([matrix], op="mean")
    out["mean of a transposed view"] = matrix
    last = pd.world_size() - 1
    sent = [torch.full((3,), float(rank)), torch.full((2,), rank, dtype=torch.int32)]
    engine.broadcast_(sent, src=last)
    out["broadcast from the last worker"] = sent
    pending = engine.open_channel().allreduce_async_(torch.ones(4), "sum", "temporary")
    pending.wait()  # the engine keeps the temporary tensor alive while MPI writes it
    cases: list[tuple[str, Callable[[], None], type[Exception]]] = [
        ("op", lambda: engine.allreduce_([torch.ones(1)], op="min"), ValueError),  # type: ignore[arg-type]
        ("dtype", lambda: engine.allreduce_([torch.ones(1, dtype=torch.complex64)]), TypeError),
        ("device", lambda: engine.allreduce_([torch.zeros(2, device="meta")]), PyroError),
        ("src", lambda: engine.broadcast_([torch.ones(1)], src=7), ValueError),
    ]
    errors = {}
    for name, call, error in cases:
        with pytest.raises(error) as info:
            call()
        errors[name] = str(info.value)
    out["errors"] = errors
    return out


def reinit_with_another_timeout() -> float:
    pd.shutdown()
    engine = pd.init("mpi", timeout=5)
    pd.barrier()
    return engine.timeout.total_seconds()


SCENARIOS: list[tuple[str, Any, tuple[Any, ...]]] = [
    ("view", engine_view, ()),
    ("dtypes", dtypes_and_layouts, ()),
    ("reinit", reinit_with_another_timeout, ()),
]


@functools.cache
def results_at(world_size: int) -> dict[str, Any]:
    return run_under_launcher("mpi", SCENARIOS, world_size=world_size, timeout=120)


def outcome(name: str, world_size: int) -> list[Any]:
    result = results_at(world_size)[name]
    if isinstance(result, WorkerFailure):
        raise result
    assert len(result) == world_size
    return list(result)


@pytest.mark.parametrize("world_size", [1, 3])
def test_auto_picks_mpi_under_mpiexec_with_ranks_means_and_objects(world_size: int) -> None:
    for rank, view in enumerate(outcome("view", world_size)):
        assert (view["engine"], view["detected"], view["same_engine"]) == ("mpi", "mpi", True)
        # One machine: the node-local communicator holds every worker.
        assert (view["rank"], view["local_rank"], view["world"]) == (rank, rank, world_size)
        assert view["is_main"] == (rank == 0)
        assert view["mean_float"] == 2.0 * (world_size - 1)
        assert isinstance(view["mean_float"], float)
        assert torch.equal(
            view["mean_tensor"], torch.full((2,), (world_size - 1) / 2, dtype=torch.float64)
        )
        assert (view["any"], view["all"]) == (True, world_size == 1)
        assert view["gathered"] == [
            {"rank": r, "payload": "x" * (1000 * r)} for r in range(world_size)
        ]


@pytest.mark.parametrize("world_size", [1, 3])
def test_each_worker_listens_for_probes_on_the_addresses_it_published_alone(
    world_size: int,
) -> None:
    views = outcome("view", world_size)
    for rank, view in enumerate(views):
        addresses, port = view["published"][rank]
        if world_size == 1:  # no peer to probe it
            assert (view["probe_bound"], addresses, port) == ([], (), None)
            continue
        assert view["own_addresses"], "this test needs an address other than loopback"
        assert addresses == tuple(view["own_addresses"])
        # One socket on each published address, none on the wildcard address.
        assert view["probe_bound"] == [(address, port) for address in addresses]


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_dtype_reduces_in_place_and_bad_input_is_named(world_size: int) -> None:
    results = outcome("dtypes", world_size)
    factor = world_size * (world_size + 1) / 2  # sum over ranks of (rank + 1)
    for result in results:
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            got = result[f"sum {dtype}"]
            assert got.dtype == dtype and torch.equal(got, torch.arange(5, dtype=dtype) * factor)
        assert result["max int64"].tolist() == [world_size - 1, 0]
        mean = result["mean of a transposed view"]
        assert torch.equal(mean, (torch.arange(6.0).reshape(2, 3) * factor / world_size).t())
        floats, ints = result["broadcast from the last worker"]
        assert torch.equal(floats, torch.full((3,), float(world_size - 1)))
        assert torch.equal(ints, torch.full((2,), world_size - 1, dtype=torch.int32))
        errors = result["errors"]
        assert "no reduction 'min'" in errors["op"]
        assert "cannot reduce tensors of dtype torch.complex64" in errors["dtype"]
        assert "a meta tensor cannot travel on the mpi engine" in errors["device"]
        assert f"broadcast source 7 does not exist: world size is {world_size}" in errors["src"]
    for other in results[1:]:  # every worker holds the same bits
        for name in ("sum torch.float16", "sum torch.bfloat16", "mean of a transposed view"):
            assert torch.equal(other[name], results[0][name])


def test_shutdown_then_init_with_another_timeout() -> None:
    assert outcome("reinit", 3) == [5.0] * 3


def test_mpi_is_never_imported_until_asked_for() -> None:
    code = (
        "import sys, pyro_distributed as pd\n"
        "pd.init('auto'); pd.all_mean(1.0)\n"
        "print(pd.current_engine().name, 'mpi4py' in sys.modules)\n"
    )
    done = run_command([sys.executable, "-c", code], timeout=60)
    assert done.stdout.split() == ["local", "False"], done.stderr


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"PMI_RANK": "0"}, "mpi"),  # MPICH's Hydra, Intel MPI
        ({"OMPI_COMM_WORLD_RANK": "0"}, "mpi"),  # Open MPI
        ({"PMIX_RANK": "0"}, "mpi"),  # any PMIx launcher
        # srun -n 4 --mpi=pmi2: MPI; Slurm's default --mpi=none gives no PMI, so the
        # tasks join through torch.distributed from Slurm's variables instead.
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4", "PMI_RANK": "0"}, "mpi"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"}, "torch"),
        ({"SLURM_PROCID": "0"}, "local"),  # a batch script's one process
        ({"PMI_RANK": "0", **TORCHRUN}, "torch"),  # torchrun's variables win: the user chose torch
        # horovodrun running on MPI
        ({"PMI_RANK": "0", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovod"),
        ({"PMI_RANK": "0", "HOROVOD_RANK": "0"}, "mpi"),  # a stray HOROVOD_RANK launches nothing
    ],
)
def test_auto_detection_reads_the_launchers_environment(
    variables: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    launchers = ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"]
    horovodrun = ["HOROVOD_RANK", "HOROVOD_SIZE"]
    for name in [*launchers, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", *horovodrun, *TORCHRUN]:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert detect_engine() == expected


def test_engine_requested_without_mpi4py_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"  # as if mpi4py were not installed
        "import pyro_distributed as pd\n"
        "try:\n    pd.init('mpi')\nexcept ImportError as err:\n    print(err)\n"
    )
    done = run_command([sys.executable, "-c", code], timeout=60)
    assert "mpi4py is not installed" in done.stdout, done.stderr
    assert "pip install mpi4py mpich" in done.stdout
    assert "system's MPI" in done.stdout


# --- faults, under the real mpiexec ----------------------------------------------------------


def run_command(command: list[str], timeout: float, **env: str) -> Any:
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT),
        **env,
    }
    return subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout
    )


FAULTY = """\
import os, signal, sys, time, torch, pyro, pyro_distributed as pd
how = sys.argv[1]
pd.init(timeout=float(sys.argv[2]))
print(f"worker {pd.rank()} pid {os.getpid()}", flush=True)
p = pyro.param("p", torch.ones(3)).unconstrained()
optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
for step in range(1, 100):
    if step == 5 and pd.rank() == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "raise":
            raise RuntimeError("worker 1 failed on purpose")
        if how == "hang":
            time.sleep(600)  # alive, but not taking part
    (p * (pd.rank() + 1.0)).sum().backward()
    optim([p])
    p.grad = None
print(f"worker {pd.rank()} finished", flush=True)
"""


def run_faulty(how: str, tmp_path: Path, timeout: float = 30) -> tuple[Any, float]:
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    start = time.monotonic()
    done = run_command(
        [MPIEXEC, "-n", "2", sys.executable, str(script), how, str(timeout)], timeout=120
    )
    return done, time.monotonic() - start


def test_a_killed_worker_ends_the_job_at_once_and_is_named(tmp_path: Path) -> None:
    done, elapsed = run_faulty("sigkill", tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    pid = re.search(r"worker 1 pid (\d+)", output)
    assert pid, output
    # mpiexec names the process and how it died, and stops the survivor.
    assert re.search(rf"PID {pid.group(1)} RUNNING AT .*\n=\s+EXIT CODE: 9", output), output
    assert "worker 0 finished" not in output
    assert elapsed < 20, elapsed  # far less than the engine's 30 s time-out


def test_a_raising_worker_aborts_the_job_instead_of_leaving_it_waiting(tmp_path: Path) -> None:
    done, elapsed = run_faulty("raise", tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "RuntimeError: worker 1 failed on purpose" in output
    # The dying script's exit aborts the whole job: worker 0 does not wait out its time-out.
    assert "MPI_Abort" in output, output
    assert "worker 0 finished" not in output
    assert elapsed < 20, elapsed


def test_a_hung_worker_is_detected_after_the_time_out_and_the_job_aborted(tmp_path: Path) -> None:
    done, elapsed = run_faulty("hang", tmp_path, timeout=3)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    message = re.search(r"PyroDistributedError: (.*)", output)
    assert message, output
    assert "allreduce (sum) of pyro_distributed.grad.p+0 failed on worker 0 of 2" in message[1]
    assert "no answer within the time-out" in message[1] and "time-out 3 s" in message[1]
    # The survivor's abort ends the sleeper too: the job takes seconds, not the
    # sleeper's 600 (the bound leaves room for mpiexec's start on a busy machine).
    assert 3 < elapsed < 60, elapsed


def hang_with_short_timeout(checkpoint: str) -> dict[str, Any]:
    pd.shutdown()
    pd.init("mpi", timeout=3)
    return die_at_step_five("hang", checkpoint)


def test_the_survivor_of_a_hang_names_the_collective_and_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    checkpoint = tmp_path / "run.pt"
    with pytest.raises(WorkerFailure) as info:  # worker 1 is ended by worker 0's abort
        run_workers(hang_with_short_timeout, str(checkpoint), engine="mpi", timeout=60)
    assert set(info.value.reports) == {1}
    survivor = info.value.results[0]
    assert "failed on worker 0 of 2" in survivor["message"]
    assert "time-out 3 s" in survivor["message"]
    assert 2.5 < survivor["elapsed"] < 15, survivor
    assert load_file(checkpoint)["num_steps"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]


# --- the examples, as users launch them ------------------------------------------------------


def mpiexec(workers: int) -> list[str]:
    return [MPIEXEC, "-n", str(workers), sys.executable]


def test_vae_example_runs_under_mpiexec_on_two_workers(tmp_path: Path) -> None:
    output = run_example(mpiexec(2), tmp_path)
    check_outputs(output, tmp_path, workers=2)


def test_quickstart_under_mpiexec_gives_the_posterior_of_all_the_data() -> None:
    output = run([*mpiexec(2), str(QUICKSTART)])
    means, widths = quickstart_posterior(output)
    for mean, true in zip(means, [2.0, -1.0, 0.5], strict=True):
        assert abs(mean - true) < 0.02
    for width in widths:
        assert abs(width / QUICKSTART_WIDTH - 1) < 0.2, widths
    assert output.count("predictions: (1000, 1001)") == 1, "gathered on worker 0 only"


def test_regression_example_runs_under_mpiexec_and_resumes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run.pt"
    args = [str(EXAMPLE), "--steps=600", f"--checkpoint={checkpoint}"]
    output = run([*mpiexec(2), *args])
    assert output.count("training on 2 worker(s)") == 1, "only worker 0 prints"
    for fitted, true in zip(fitted_weights(output), [2.0, -1.0, 0.5], strict=True):
        assert abs(fitted - true) < 0.1
    assert load_file(checkpoint)["world_size"] == 2


def test_a_plain_process_with_the_mpi_engine_is_one_worker() -> None:
    code = (
        "import pyro_distributed as pd\n"
        "pd.init('mpi'); print(pd.rank(), pd.local_rank(), pd.world_size(), pd.all_mean(3.0))\n"
    )
    done = run_command([sys.executable, "-c", code], timeout=60)
    assert done.stdout.split() == ["0", "0", "1", "3.0"], done.stderr
