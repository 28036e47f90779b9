"""Workers on separate hosts: torchrun across network-namespace hosts
(``tests/support/cluster.py``).

Each host resolves its own name to loopback, as stock Debian and Ubuntu nodes
do; nothing is set by hand (no ``GLOO_SOCKET_IFNAME``), as a new user would
run the README's line on two nodes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyro_distributed.checkpoint.files import load_file

from ..support.cluster import Host, NamespaceCluster
from ..support.harness import free_port
from ..support.lightning_reference import (
    FIT_EPOCHS,
    assert_each_epoch_shares_the_rows,
    assert_in_sync,
    fit_on_lightnings_own_launcher,
    fit_regression_options,
)
from ..support.multihost import ENGINE_TIMEOUT, ROOT, SCRIPT, environment, finish, wait_for_steps

pytestmark = pytest.mark.cluster


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
        env_here = {**environment(), **(env or {}).get(host, {})}
        processes.append(cluster.start(host, command, env=env_here, cwd=ROOT))
    return processes


def test_torchrun_across_two_hosts_trains_one_model_with_nothing_set_by_hand(
    tmp_path: Path,
) -> None:
    with NamespaceCluster(2, rate="1gbit") as cluster:
        outcomes = finish(_torchrun(cluster, tmp_path, steps=1000), within=180)
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
        env={**environment(), "OMP_NUM_THREADS": "1"}, cwd=ROOT, check=True, timeout=120,
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
        outcomes = finish(_torchrun(cluster, out, steps=0, script=script), within=240)
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
        outcomes = finish(_torchrun(cluster, tmp_path, steps=5, env=on_loopback), within=60)
    for code, output, _ in outcomes:
        assert code != 0
        assert "GLOO_SOCKET_IFNAME" in output, output[-4000:]
        assert "worker 1: 127.0.0.1 (interface lo) on host host1" in output, output[-4000:]
    # At once: no host waited for the engine's time-out after the other stopped.
    # (From the start, a loaded machine's start-up alone can take that long.)
    ended = [seconds for _, _, seconds in outcomes]
    assert max(ended) - min(ended) < ENGINE_TIMEOUT / 2, ended


def test_lightning_with_workers_on_loopback_stops_every_host_naming_them(tmp_path: Path) -> None:
    """The same under Lightning, which makes the process group itself: the
    check runs first, through torchrun's store. Without it, with both hosts on
    loopback, one host failed to connect and the other was still waiting 90 s
    later (for Lightning's process-group time-out, 30 minutes). (With one host
    on loopback, two hosts happen to connect: gloo dials in one direction.)"""
    out = tmp_path / "hosts"
    script = [*fit_regression_options(out, devices=1), "--num-nodes", "2"]
    with NamespaceCluster(2) as cluster:
        on_loopback = {host: {"GLOO_SOCKET_IFNAME": "lo"} for host in cluster.hosts}
        started = _torchrun(cluster, out, steps=0, script=script, env=on_loopback)
        outcomes = finish(started, within=180)
    for code, output, seconds in outcomes:
        assert code != 0
        for host in ("host0", "host1"):
            assert f"127.0.0.1 (interface lo) on host {host}" in output, output[-4000:]
        # Start-up (Lightning's imports on a busy machine) takes most of this.
        assert seconds < 120, (seconds, output[-4000:])


@pytest.mark.parametrize("hosts", [2, 3])
@pytest.mark.parametrize("fault", ["killed", "link cut"])
def test_a_lost_host_stops_every_survivor_within_the_time_out(
    tmp_path: Path, hosts: int, fault: str
) -> None:
    with NamespaceCluster(hosts) as cluster:
        processes = _torchrun(cluster, tmp_path, steps=100_000)
        wait_for_steps(tmp_path, hosts, processes)
        lost = cluster.hosts[-1]
        if fault == "killed":
            cluster.kill_host(lost)
        else:
            cluster.cut_link(lost)
        survivors = finish(processes[:-1], within=ENGINE_TIMEOUT + 30)
    for code, output, _ in survivors:
        assert code != 0
        assert "PyroDistributedError" in output, output[-4000:]
        assert f"worker {hosts - 1} on host {lost.name}" in output, output[-4000:]


LATE_CHANNEL = ROOT / "tests" / "scripts" / "multihost_train_late_channel.py"


def test_a_link_cut_while_the_channel_is_made_stops_every_survivor_within_the_time_out(
    tmp_path: Path,
) -> None:
    """The other fault window: the exchange making its overlap channel (a new
    process group, whose set-up waits for every worker). The last worker is
    late to it (``multihost_train_late_channel.py``); its link goes down while
    worker 0 waits inside the set-up."""
    with NamespaceCluster(2) as cluster:
        script = [str(LATE_CHANNEL), str(tmp_path), "100000", str(ENGINE_TIMEOUT)]
        processes = _torchrun(cluster, tmp_path, steps=0, script=script)
        deadline = time.monotonic() + 120
        while not (tmp_path / "channel1").exists():
            if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
                outputs = [p.communicate(timeout=30)[0][-3000:] for p in processes]
                pytest.fail("the run ended or stalled before its channel:\n" + "\n".join(outputs))
            time.sleep(0.1)
        lost = cluster.hosts[-1]
        cluster.cut_link(lost)
        [(code, output, _)] = finish(processes[:-1], within=ENGINE_TIMEOUT + 30)
    assert code != 0
    assert "PyroDistributedError: creating a process group failed" in output, output[-4000:]
    assert f"worker 1 on host {lost.name}" in output, output[-4000:]


REGRESSION = ROOT / "examples" / "bayesian_regression.py"


def _elastic_agent(
    cluster: NamespaceCluster, host: Host, port: int, checkpoint: Path
) -> subprocess.Popen[str]:
    """One host's torchrun with c10d rendezvous (host0 serves it) and one restart,
    training the regression example with a checkpoint every 50 steps. Each round
    of the rendezvous gets a store of its own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``):
    torch's shared store gives a host that joins a later round keys that only
    the first round wrote (docs/guide/clusters.md)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    serves = host is cluster.hosts[0]
    command = [
        str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.hosts[0].address}:{port}",
        "--rdzv-id", "job", "--rdzv-conf", f"is_host={int(serves)}", "--local-addr", host.address,
        str(REGRESSION), "--steps=200", "--checkpoint-every=50", f"--checkpoint={checkpoint}",
    ]  # fmt: skip
    env = {**environment(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return cluster.start(host, command, env=env, cwd=ROOT)


def _checkpointed_steps(checkpoint: Path) -> int:
    try:
        return int(load_file(checkpoint)["num_steps"])
    except (OSError, ValueError, KeyError):
        return 0  # not written yet, or being replaced


def test_a_host_restarted_by_hand_rejoins_and_the_run_resumes_bitwise(tmp_path: Path) -> None:
    """``torchrun --max-restarts 1`` with c10d rendezvous on two hosts: host1 is
    killed (every process, SIGKILL) after the checkpoint at step 100 and its
    torchrun started again by hand. Host0's worker names the lost worker, its
    agent restarts it, the restarted host joins the new round, and the run
    resumes from the checkpoint and ends bitwise equal to an uninterrupted run."""
    clean, crashed = tmp_path / "clean.pt", tmp_path / "crashed.pt"
    with NamespaceCluster(2) as cluster:
        port = free_port()
        for code, output, _ in finish(
            [_elastic_agent(cluster, host, port, clean) for host in cluster.hosts], within=180
        ):
            assert code == 0, output[-4000:]

        port = free_port()
        first, lost = (_elastic_agent(cluster, host, port, crashed) for host in cluster.hosts)
        deadline = time.monotonic() + 120
        while _checkpointed_steps(crashed) < 100:
            assert time.monotonic() < deadline, "no checkpoint at step 100 within 120 s"
            assert first.poll() is None and lost.poll() is None, "a host stopped early"
            time.sleep(0.2)
        cluster.kill_host(cluster.hosts[1])
        lost.communicate(timeout=30)
        again = _elastic_agent(cluster, cluster.hosts[1], port, crashed)
        outcomes = finish([first, again], within=180)
    for code, output, _ in outcomes:
        assert code == 0, output[-4000:]
    survivor, both = outcomes[0][1], "\n".join(output for _, output, _ in outcomes)
    # The rendezvous orders the hosts: host1 may be worker 0 or 1 in either round.
    assert re.search(r"worker \d on host host1 \(pid \d+\) has exited", survivor), survivor[-4000:]
    assert re.search(r"resumed from .* at step (100|150)", both), both[-6000:]
    a, b = (load_file(path) for path in (clean, crashed))
    assert a["num_steps"] == b["num_steps"] == 200
    for name, value in a["param_store"]["params"].items():
        assert torch.equal(b["param_store"]["params"][name], value), name
