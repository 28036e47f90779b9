"""Workers on separate hosts: torchrun across network-namespace hosts (``tests/cluster.py``).

Each host resolves its own name to loopback, as stock Debian and Ubuntu nodes
do; nothing is set by hand (no ``GLOO_SOCKET_IFNAME``), as a new user would
run the README's line on two nodes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ..cluster import Host, NamespaceCluster
from ..harness import free_port
from ..lightning.reference import (
    FIT_EPOCHS,
    fit_on_lightnings_own_launcher,
    fit_regression_options,
)
from ..lightning.test_strategy import assert_each_epoch_shares_the_rows, assert_in_sync

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "multihost_train.py"
#: The engine's time-out inside these runs: every failure must end a host within it.
ENGINE_TIMEOUT = 20.0


def _environment() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _torchrun(
    cluster: NamespaceCluster,
    out: Path,
    steps: int,
    env: dict[Host, dict[str, str]] | None = None,
    script: list[str] | None = None,
) -> list[subprocess.Popen[str]]:
    """One torchrun agent per host, one worker each, the README's multi-node line,
    running ``tests/scripts/multihost_train.py`` (or ``script``: a path and its arguments)."""
    master, port = cluster.hosts[0].address, free_port()
    torchrun = Path(sys.executable).parent / "torchrun"
    script = script or [str(SCRIPT), str(out), str(steps), str(ENGINE_TIMEOUT)]
    processes = []
    for rank, host in enumerate(cluster.hosts):
        command = [
            str(torchrun), "--nnodes", str(len(cluster.hosts)), "--node-rank", str(rank),
            "--nproc-per-node", "1", "--master-addr", master, "--master-port", str(port),
            *script,
        ]  # fmt: skip
        env_here = {**_environment(), **(env or {}).get(host, {})}
        processes.append(cluster.start(host, command, env=env_here, cwd=ROOT))
    return processes


def _finish(processes: list[subprocess.Popen[str]], within: float) -> list[tuple[int, str, float]]:
    """Each process's exit code, output and when it ended (seconds from now); a
    process still running after ``within`` seconds fails the test."""
    start, ended = time.monotonic(), []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=max(0.1, start + within - time.monotonic()))
        except subprocess.TimeoutExpired:
            # The whole process group: a worker left alive would hold the pipe open.
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"a host was still running {within:g} s later:\n{output[-4000:]}")
        ended.append((process.returncode, output, time.monotonic() - start))
    return ended


def test_torchrun_across_two_hosts_trains_one_model_with_nothing_set_by_hand(
    tmp_path: Path,
) -> None:
    with NamespaceCluster(2, rate="1gbit") as cluster:
        outcomes = _finish(_torchrun(cluster, tmp_path, steps=1000), within=180)
    for code, output, _ in outcomes:
        assert code == 0, output[-4000:]
    workers = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [w["host"] for w in workers] == ["host0", "host1"]
    assert [w["world_size"] for w in workers] == [2, 2]
    # The host name resolves to loopback: the engine chose each host's own link.
    assert [w["interface"] for w in workers] == ["eth0", "eth1"]
    for name, value in workers[0]["params"].items():
        assert torch.equal(value, workers[1]["params"][name]), name

    # The same script as one process: the same posterior, up to the workers' own noise.
    alone = tmp_path / "alone"
    alone.mkdir()
    subprocess.run(
        [sys.executable, str(SCRIPT), str(alone), "1000"],
        env={**_environment(), "OMP_NUM_THREADS": "1"}, cwd=ROOT, check=True, timeout=120,
    )  # fmt: skip
    single = torch.load(alone / "rank0.pt")["params"]
    together = workers[0]["params"]
    assert torch.allclose(together["AutoNormal.locs.w"], single["AutoNormal.locs.w"], atol=0.02)


def test_lightning_across_two_hosts_trains_what_its_own_launcher_trains_on_one(
    tmp_path: Path,
) -> None:
    """``Trainer(num_nodes=2, devices=1, strategy=PyroDistributedStrategy())`` under
    torchrun on two hosts, nothing set by hand: one model, bitwise the one that
    Lightning's own launcher trains with ``devices=2`` on one host."""
    out = tmp_path / "hosts"
    options = fit_regression_options(out, devices=1)
    with NamespaceCluster(2, rate="1gbit") as cluster:
        script = [*options, "--num-nodes", "2"]
        outcomes = _finish(_torchrun(cluster, out, steps=0, script=script), within=240)
    for code, output, _ in outcomes:
        assert code == 0, output[-4000:]
    records = [torch.load(out / f"rank{rank}.pt") for rank in range(2)]
    assert [r["host"] for r in records] == ["host0", "host1"]
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world_size"] == 2 and r["engine_world_size"] == 2 for r in records)
    assert_in_sync(records)
    assert_each_epoch_shares_the_rows(records, epochs=FIT_EPOCHS)
    for rank, own in enumerate(fit_on_lightnings_own_launcher()):
        assert records[rank]["seen"] == own["seen"], rank
        for name, value in records[rank]["posterior"].items():
            assert torch.equal(value, own["posterior"][name]), (rank, name)


def test_a_worker_that_would_listen_on_loopback_stops_every_host_at_once(tmp_path: Path) -> None:
    with NamespaceCluster(2) as cluster:
        on_loopback = {cluster.hosts[1]: {"GLOO_SOCKET_IFNAME": "lo"}}
        outcomes = _finish(_torchrun(cluster, tmp_path, steps=5, env=on_loopback), within=60)
    for code, output, seconds in outcomes:
        assert code != 0
        assert "GLOO_SOCKET_IFNAME" in output, output[-4000:]
        assert "worker 1: 127.0.0.1 (interface lo) on host host1" in output, output[-4000:]
        assert seconds < ENGINE_TIMEOUT


def _wait_for_steps(out: Path, ranks: int, processes: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 120
    while not all((out / f"step{r}").exists() for r in range(ranks)):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            outputs = [p.communicate(timeout=30)[0][-3000:] for p in processes]
            pytest.fail("the run ended or stalled before its first steps:\n" + "\n".join(outputs))
        time.sleep(0.2)


@pytest.mark.parametrize("hosts", [2, 3])
@pytest.mark.parametrize("fault", ["killed", "link cut"])
def test_a_lost_host_stops_every_survivor_within_the_time_out(
    tmp_path: Path, hosts: int, fault: str
) -> None:
    with NamespaceCluster(hosts) as cluster:
        processes = _torchrun(cluster, tmp_path, steps=100_000)
        _wait_for_steps(tmp_path, hosts, processes)
        lost = cluster.hosts[-1]
        if fault == "killed":
            cluster.kill_host(lost)
        else:
            cluster.cut_link(lost)
        survivors = _finish(processes[:-1], within=ENGINE_TIMEOUT + 30)
    for code, output, _ in survivors:
        assert code != 0
        assert "PyroDistributedError" in output, output[-4000:]
        assert f"worker {hosts - 1} on host {lost.name}" in output, output[-4000:]
