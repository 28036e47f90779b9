"""The mpi engine across hosts: MPICH's ``mpiexec -hosts`` on network-namespace hosts.

``mpiexec`` runs on host0 and starts its proxies on every host through a
launcher that enters the host's namespace (``NamespaceCluster.hydra_launcher``,
in place of ``ssh``). The hosts share one kernel, so MPICH would move data
between them through shared memory, as between processes of one machine; the
tests make it use the network as between machines (the OFI netmod over TCP,
``MPIR_CVAR_NOLOCAL``), so that a cut link cuts the job's data.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support.cluster import NamespaceCluster
from ..support.examples import QUICKSTART, REPORT, assert_one_model
from ..support.multihost import ENGINE_TIMEOUT, SCRIPT, environment, finish, wait_for_steps

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
#: MPICH's data between the hosts over TCP, never shared memory.
OVER_THE_NETWORK = {"FI_PROVIDER": "tcp", "MPIR_CVAR_CH4_NETMOD": "ofi", "MPIR_CVAR_NOLOCAL": "1"}


def _mpiexec(cluster: NamespaceCluster, launcher: Path, *program: str) -> subprocess.Popen[str]:
    """``mpiexec -hosts host0,host1 -n 2 -ppn 1 PROGRAM``, started on host0."""
    hosts = ",".join(host.address for host in cluster.hosts)
    command = [
        MPIEXEC, "-launcher", "ssh", "-launcher-exec", str(launcher), "-hosts", hosts,
        "-n", str(len(cluster.hosts)), "-ppn", "1", *program,
    ]  # fmt: skip
    env = {**environment(), **OVER_THE_NETWORK}
    return cluster.start(cluster.hosts[0], command, env=env, cwd=ROOT)


def test_mpiexec_across_two_hosts_trains_what_it_trains_on_one(tmp_path: Path) -> None:
    with NamespaceCluster(2, rate="1gbit") as cluster:
        launcher = cluster.hydra_launcher(tmp_path)
        process = _mpiexec(cluster, launcher, sys.executable, "-c", REPORT, str(QUICKSTART))
        [(code, across, _)] = finish([process], within=180)
    assert code == 0, across[-4000:]
    hosts = assert_one_model(across, "mpi", 2, per_node=1)

    one_host = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", REPORT, str(QUICKSTART)],
        env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert one_host.returncode == 0, one_host.stderr[-4000:]
    here = assert_one_model(one_host.stdout, "mpi", 2)
    assert [task["params"] for task in hosts.values()] == [t["params"] for t in here.values()]


@pytest.mark.parametrize("fault", ["killed", "link cut"])
def test_a_lost_host_ends_the_mpi_job_within_the_time_out(tmp_path: Path, fault: str) -> None:
    """A killed host: ``mpiexec`` loses its proxy and ends the job at once. A cut
    link: the survivor raises after the engine's time-out, aborts, and ends
    within seconds even though ``mpiexec`` cannot reach the lost host."""
    out = tmp_path / "out"
    out.mkdir()
    with NamespaceCluster(2) as cluster:
        launcher = cluster.hydra_launcher(tmp_path)
        program = [sys.executable, str(SCRIPT), str(out), "100000", str(ENGINE_TIMEOUT)]
        process = _mpiexec(cluster, launcher, *program)
        wait_for_steps(out, 2, [process])
        lost = cluster.hosts[1]
        start = time.monotonic()
        if fault == "killed":
            cluster.kill_host(lost)
        else:
            cluster.cut_link(lost)
        [(code, output, _)] = finish([process], within=ENGINE_TIMEOUT + 30)
        elapsed = time.monotonic() - start
    assert code != 0, output[-4000:]
    if fault == "killed":
        assert elapsed < 10, (elapsed, output[-4000:])
    else:
        # The survivor names the lost worker and its host, probed on the
        # addresses it published (MPI itself says nothing of them).
        named = (
            r"PyroDistributedError: .* failed on worker 0 of 2: no answer within the time-out "
            rf"\([0-9.]+ s\): worker 1 on host host1 \({re.escape(lost.address)}\) "
            "cannot be reached"
        )
        assert re.search(named, output), output[-4000:]
        assert ENGINE_TIMEOUT < elapsed < ENGINE_TIMEOUT + 15, (elapsed, output[-4000:])
