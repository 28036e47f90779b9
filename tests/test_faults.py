"""Faults and bad input: no hangs, no silent divergence, no lost state.

Faults are real: workers kill themselves with SIGKILL, raise, or stop
answering; every test is bounded by the harness time-out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.checkpoint.files import load_file

from .support.faults import die_at_step_five, nan_on_worker_one, uneven_epoch
from .support.harness import ENGINES, WorkerFailure, free_port, run_workers

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "bayesian_regression.py"


# --- a worker dies, raises or hangs ----------------------------------------------------------


@pytest.mark.parametrize("how", ["sigkill", "raise"])
def test_survivor_names_the_dead_worker_within_seconds(how: str, tmp_path: Path) -> None:
    checkpoint = tmp_path / "run.pt"
    with pytest.raises(WorkerFailure) as info:
        run_workers(die_at_step_five, how, str(checkpoint), timeout=60)
    assert set(info.value.reports) == {1}, "only the faulty worker failed"
    survivor = info.value.results[0]
    assert "worker 1 (pid" in survivor["message"] and "has exited" in survivor["message"]
    assert survivor["elapsed"] < 10, survivor
    # The last complete checkpoint is intact, and nothing half-written lies beside it.
    assert load_file(checkpoint)["num_steps"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt"]


def hang_with_short_timeout(checkpoint: str) -> dict[str, Any]:
    # The 3 s time-out covers joining too: leave the harness's group together,
    # so that a busy machine's start-up skew is not mistaken for the hang, and
    # meet again on a new port: on the old one, the worker that shuts down
    # first can reach worker 0's old store just before it closes.
    port = torch.tensor([free_port() if pd.rank() == 0 else 0])
    pd.current_engine().broadcast_([port])
    pd.shutdown()
    os.environ["MASTER_PORT"] = str(int(port))
    pd.init("torch", timeout=3)
    return die_at_step_five("hang", checkpoint)


def test_a_hung_worker_is_detected_after_the_configured_timeout(tmp_path: Path) -> None:
    # Worker 1 wakes up after 10 s to find worker 0 gone, and raises too.
    survivor, _ = run_workers(hang_with_short_timeout, str(tmp_path / "run.pt"), timeout=40)
    assert "failed on worker 0 of 2" in survivor["message"]
    assert "time-out 3 s" in survivor["message"]
    assert 2.5 < survivor["elapsed"] < 15, survivor


def run_command(command: list[str], timeout: float, cwd: Path = ROOT, **env: str) -> Any:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(
        command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )


def torchrun(*args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]


CRASH_ONCE = ROOT / "tests" / "scripts" / "crash_once.py"


def test_torchrun_stops_the_job_and_names_the_killed_worker(tmp_path: Path) -> None:
    start = time.monotonic()
    done = run_command(
        torchrun("--nproc-per-node=2", str(CRASH_ONCE), str(EXAMPLE), "--steps=400"),
        timeout=120,
        CRASH_AT_STEP="50",
    )
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    # torchrun names the first failure (it may stop the survivor before the
    # survivor's own message, tested above without torchrun, is printed)
    root_cause = r"Root Cause \(first observed failure\):\s*\[0\]:(?:\n.*){0,4}rank\s*: 1 "
    assert re.search(root_cause, done.stderr), done.stderr
    assert "Signal 9 (SIGKILL)" in done.stderr
    assert elapsed < 60


def test_torchrun_restart_resumes_from_the_checkpoint_and_matches_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    steps = ["--steps=300", "--checkpoint-every=50"]
    clean = run_command(
        torchrun("--nproc-per-node=2", str(EXAMPLE), *steps, f"--checkpoint={tmp_path / 'a.pt'}"),
        timeout=180,
    )
    assert clean.returncode == 0, clean.stderr
    crashed = run_command(
        torchrun(
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(CRASH_ONCE),
            str(EXAMPLE),
            *steps,
            f"--checkpoint={tmp_path / 'b.pt'}",
        ),
        timeout=180,
        CRASH_AT_STEP="120",
    )
    assert crashed.returncode == 0, crashed.stderr
    assert "resumed from" in crashed.stdout and "at step 100" in crashed.stdout
    a = load_file(tmp_path / "a.pt")
    b = load_file(tmp_path / "b.pt")
    assert a["num_steps"] == b["num_steps"] == 300
    for name, value in a["param_store"]["params"].items():
        assert torch.equal(b["param_store"]["params"][name], value), name


def test_two_torchrun_nodes_train_together_and_only_global_rank_zero_writes(
    tmp_path: Path,
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    processes = []
    for node_rank, cwd in enumerate(node_dirs):
        cwd.mkdir()
        command = [
            str(BIN / "torchrun"),
            "--nnodes=2",
            f"--node-rank={node_rank}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=multinode-test",
            str(EXAMPLE),
            "--steps=300",
            "--checkpoint=run.pt",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        processes.append(
            subprocess.Popen(
                command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [process.communicate(timeout=180) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr
    writers = [cwd for cwd in node_dirs if (cwd / "run.pt").exists()]
    assert len(writers) == 1, "exactly one node holds global rank 0"
    main_node = node_dirs.index(writers[0])
    main_out, other_out = outputs[main_node][0], outputs[1 - main_node][0]
    assert "ranks (global, local): [(0, 0), (1, 0)]" in main_out
    assert "training on 2 worker(s)" in main_out and "weights:" in main_out
    assert other_out == "", "only global rank 0 prints"


# --- non-finite gradients --------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_nan_on_one_worker_makes_every_worker_skip_the_step(engine: str) -> None:
    first, second = run_workers(nan_on_worker_one, "skip", engine=engine)
    for mine, theirs in zip(first["values"], second["values"], strict=True):
        assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    before, skipped, after = first["values"]
    assert torch.equal(before["p"], skipped["p"]) and torch.equal(before["q"], skipped["q"])
    assert not torch.equal(skipped["p"], after["p"]), "training goes on after the skip"
    for result in (first, second):
        (message,) = result["warnings"]
        assert "'p'" in message and "'q'" not in message and "every worker skips" in message


def test_nan_with_raise_policy_raises_on_every_worker() -> None:
    for result in run_workers(nan_on_worker_one, "raise"):
        assert "averaged gradient of 'p' is not finite" in result["raised"]


# --- uneven data -----------------------------------------------------------------------------


def test_uneven_shards_end_the_epoch_together() -> None:
    first, second = run_workers(uneven_epoch, timeout=60)
    assert first["used"] == second["used"] == 6, "3 steps per epoch on both workers"
    assert torch.equal(first["params"]["p"], second["params"]["p"])


# --- bad input table -------------------------------------------------------------------------


def test_engine_requested_but_not_installed_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['horovod'] = None\n"  # as if Horovod were not installed
        "import pyro_distributed as pd\n"
        "try:\n    pd.init('horovod')\nexcept ImportError as err:\n    print(err)\n"
    )
    done = run_command([sys.executable, "-c", code], timeout=60)
    assert "Horovod is not installed" in done.stdout
    assert "scripts/install_horovod.sh" in done.stdout
