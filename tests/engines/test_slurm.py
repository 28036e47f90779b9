"""The scripts users launch with ``srun``, under a real one-node Slurm (``tests/support/slurm.py``).

Each scenario is one ``srun`` step, shared by the tests that read it:
``examples/quickstart.py`` on 2 tasks with ``--mpi=pmi2`` (the MPI engine)
and with ``--mpi=none`` (torch.distributed from Slurm's variables), and on 3
tasks of 2 cores (``--overcommit``) with ``--mpi=pmi2``; the torch engine's
rendezvous at W=3 runs ``tests/scripts/join_and_report.py`` alone (three gloo
workers train on two cores twice as slowly as MPI's); and the Lightning
strategy's test script on ``-N 1 --ntasks-per-node 2`` (Lightning's
SLURMEnvironment). The torch engine's store port is checked with and without
ports that ``srun`` reserved for the step, and an interactive ``srun --pty
bash`` is typed into as a user would, in a terminal of its own.

The example runs unchanged through ``runpy``; after it, every task prints the
engine it joined and a digest of its final parameters, so that a test can tell
which engine trained, on how many workers, and whether the workers agree.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pyro_distributed.engines.launchers import slurm_step_port

from ..support import slurm
from ..support.examples import (
    REPORT,
    assert_one_model,
    tasks,
)
from ..support.lightning_reference import (
    FIT_EPOCHS,
    assert_each_epoch_shares_the_rows,
    assert_in_sync,
    fit_on_lightnings_own_launcher,
    fit_regression_options,
)

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "examples/quickstart.py"
JOIN_AND_REPORT = "tests/scripts/join_and_report.py"


@functools.cache
def quickstart(*options: str) -> str:
    """``srun OPTIONS python -c REPORT examples/quickstart.py``'s output (it must succeed)."""
    code, output = slurm.srun(options, ["python", "-c", REPORT, QUICKSTART])
    assert code == 0, f"srun {' '.join(options)}: exit {code}\n{output[-6000:]}"
    return output


def posterior_line(output: str) -> str:
    match = re.search(r"^w: mean \[[^]]*\] sd \[[^]]*\]", output, re.MULTILINE)
    assert match, output
    return match.group(0)


def test_srun_with_pmi2_trains_one_model_on_the_mpi_engine() -> None:
    assert_one_model(quickstart("-n", "2", "--mpi=pmi2"), "mpi", 2)


def test_srun_without_a_pmi_trains_the_same_model_through_torch() -> None:
    through_torch = quickstart("-n", "2", "--mpi=none")
    reports = assert_one_model(through_torch, "torch", 2)
    # Two workers' sums are the same whatever the engine: the very same model,
    # bitwise (also the torchrun W=2 run's, which sums on the same engine).
    on_mpi = quickstart("-n", "2", "--mpi=pmi2")
    assert posterior_line(through_torch) == posterior_line(on_mpi)
    assert reports[0]["params"] == tasks(on_mpi)[0]["params"]


def test_srun_trains_one_model_on_three_tasks_of_two_cores() -> None:
    # Uneven shards (3334, 3333, 3333 rows): the plate still counts all 10,000.
    # On MPI: three gloo workers on two cores take twice as long to train.
    assert_one_model(quickstart("-n", "3", "--overcommit", "--mpi=pmi2"), "mpi", 3)


def test_three_tasks_without_a_pmi_join_one_torch_world() -> None:
    options = ["-n", "3", "--overcommit", "--mpi=none"]
    code, output = slurm.srun(options, ["python", JOIN_AND_REPORT, "auto"])
    assert code == 0, f"exit {code}\n{output[-6000:]}"
    joined = sorted(line for line in output.splitlines() if line.startswith("joined "))
    assert joined == [f"joined torch {rank} 3 3" for rank in range(3)], output


#: Says which port this task's rendezvous takes, then runs join_and_report.py.
PORT_REPORT = f"""
import runpy, sys
from pyro_distributed.engines.launchers import torch_rendezvous_from_slurm
rendezvous = torch_rendezvous_from_slurm()
print(f"task {{rendezvous.rank}} port {{rendezvous.port}} {{rendezvous.port_source}}", flush=True)
sys.argv = ["{JOIN_AND_REPORT}", "auto"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def ports_taken(options: list[str]) -> tuple[list[str], str]:
    """Each task's ``port P SOURCE`` line of a 2-task step without a PMI, by rank,
    once both joined one torch world; and the output."""
    code, output = slurm.srun(["-n", "2", "--mpi=none", *options], ["python", "-c", PORT_REPORT])
    assert code == 0, f"exit {code}\n{output[-6000:]}"
    joined = sorted(line for line in output.splitlines() if line.startswith("joined "))
    assert joined == [f"joined torch {rank} 2 2" for rank in range(2)], output
    said = dict(re.findall(r"^task (\d) (port .*)$", output, re.MULTILINE))
    return [said[str(rank)] for rank in range(2)], output


def test_the_store_takes_the_port_that_srun_reserved_for_the_step() -> None:
    said, output = ports_taken(["--resv-ports=1"])
    assert said[0] == said[1], output
    found = re.fullmatch(r"port (\d+) SLURM_STEP_RESV_PORTS=(\d+)", said[0])
    assert found and found.group(1) == found.group(2), output
    assert 12000 <= int(found.group(1)) <= 12999  # start_slurm.sh's MpiParams=ports


def test_without_reserved_ports_every_task_derives_the_same_port_from_the_ids() -> None:
    said, output = ports_taken(["--resv-ports=0"])
    assert said[0] == said[1], output
    found = re.fullmatch(r"port (\d+) derived from SLURM_JOB_ID=(\d+) and SLURM_STEP_ID=0", said[0])
    assert found, output
    assert int(found.group(1)) == slurm_step_port(found.group(2), "0")


def test_a_script_typed_into_an_interactive_step_trains_alone_and_says_why() -> None:
    # srun -n 2 --pty bash: task 0 is the shell in this terminal; task 1, a
    # shell without one, ends at once. From the shell, a script runs alone with
    # a warning instead of waiting for a task 1; a step it starts (its stdin
    # kept from the terminal's, which types "exit" next) forks the script from
    # each task's `bash -c` and joins one world, with SLURM_PTY_PORT inherited.
    script = f"{sys.executable} {JOIN_AND_REPORT} auto"
    typed = f"{script}\nsrun --overlap -n 2 bash -c 'cd . && {script}' </dev/null\nexit\n"
    code, output = slurm.srun(["-n", "2", "--pty"], ["bash"], typed=typed)
    assert code == 0, f"exit {code}\n{output[-6000:]}"
    assert "InteractiveStepWarning: this process was started from the shell" in output, output
    assert "`srun -n 2 python train.py`" in output
    joined = sorted(line.strip() for line in output.splitlines() if line.startswith("joined "))
    assert joined == ["joined local 0 1 1", "joined torch 0 2 2", "joined torch 1 2 2"], output


@pytest.fixture(scope="module")
def lightning_under_srun(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    out = tmp_path_factory.mktemp("srun") / "out"
    options = ["-N", "1", "--ntasks-per-node", "2", "--mpi=none"]
    code, output = slurm.srun(options, ["python", *fit_regression_options(out)])
    assert code == 0, f"exit {code}\n{output[-6000:]}"
    return output, [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_lightning_under_srun_trains_one_model_on_two_workers(
    lightning_under_srun: tuple[str, list[Any]],
) -> None:
    output, records = lightning_under_srun
    # Lightning took srun's tasks as its workers (its SLURMEnvironment), and the
    # strategy's engine joined the process group Lightning made from them.
    assert "SLURM auto-requeueing enabled" in output, output[-6000:]
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["engine_world_size"] == 2 for r in records)
    assert all(r["engine"] == "torch" for r in records)
    assert_in_sync(records)
    assert_each_epoch_shares_the_rows(records, epochs=FIT_EPOCHS)
    assert [r["global_step"] for r in records] == [20, 20]
    assert [r["reduce_sum"] for r in records] == [3.0, 3.0]
    assert [r["broadcast"] for r in records] == ["from 1", "from 1"]


def test_lightning_under_srun_trains_what_lightnings_own_launcher_trains(
    lightning_under_srun: tuple[str, list[Any]],
) -> None:
    _, under_srun = lightning_under_srun
    for record, own in zip(under_srun, fit_on_lightnings_own_launcher(), strict=True):
        rank = record["rank"]
        assert record["seen"] == own["seen"], rank
        for name, value in record["posterior"].items():
            assert torch.equal(value, own["posterior"][name]), (rank, name)
