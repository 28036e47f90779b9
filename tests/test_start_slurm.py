"""scripts/start_slurm.sh's daemons stop with the test run that started them.

Each test starts a second one-node Slurm beside the tests' own, in a directory
and on ports of its own, through the calls that ``tests/support/slurm.py`` makes for
every pytest process (``--for PID``, then ``release PID``), with real
processes standing for the pytest processes that hold it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support import slurm
from .support.harness import free_port

pytestmark = pytest.mark.slurm

DAEMONS = ("munged", "slurmctld", "slurmd")


def _two_free_ports() -> int:
    """A port P such that P and P + 1 both bind now (slurmctld's and slurmd's)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port + 1))
            return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture
def second_slurm() -> Iterator[dict[str, str]]:
    """The environment of a second Slurm: its directory and its ports. Whatever
    a test leaves running is stopped after it."""
    # Short: munged's socket path must fit in a Unix socket address.
    directory = tempfile.mkdtemp(prefix="pd-slurm-", dir="/tmp")
    env = {
        **os.environ,
        "PYRO_DISTRIBUTED_SLURM_DIR": directory,
        "PYRO_DISTRIBUTED_SLURM_PORT": str(_two_free_ports()),
    }
    env.pop("PYRO_DISTRIBUTED_KEEP_SLURM", None)
    try:
        yield env
    finally:
        subprocess.run(
            ["bash", str(slurm.START), "stop"], env=env, capture_output=True, timeout=120
        )
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def holders(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` live processes, each standing for one pytest process."""
    processes = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def daemons(env: dict[str, str]) -> dict[str, int]:
    """The daemons of the Slurm in ``env``'s directory, by name, that are alive."""
    directory = Path(env["PYRO_DISTRIBUTED_SLURM_DIR"])
    alive = {}
    for name in DAEMONS:
        with contextlib.suppress(OSError, ValueError):
            pid = int((directory / f"{name}.pid").read_text())
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                alive[name] = pid
    return alive


def gone(pids: dict[str, int]) -> bool:
    """Whether none of ``pids`` is a live process (a zombie counts as gone)."""
    for pid in pids.values():
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X"):
                return False
    return True


def start(holder: int, env: dict[str, str]) -> None:
    conf, why = slurm.start_for(holder, env)
    assert conf == f"{env['PYRO_DISTRIBUTED_SLURM_DIR']}/slurm.conf", why


def test_a_test_runs_daemons_stop_when_its_last_process_releases_them(
    second_slurm: dict[str, str],
) -> None:
    env = second_slurm
    with holders(3) as (first, second, crashed):
        start(first.pid, env)  # as pytest-xdist's first worker: starts them
        started = daemons(env)
        assert sorted(started) == sorted(DAEMONS)
        start(second.pid, env)  # the second worker: finds them
        start(crashed.pid, env)
        assert daemons(env) == started
        crashed.send_signal(signal.SIGKILL)  # a process that dies holds nothing
        crashed.wait()
        said = slurm.release(first.pid, env)
        assert said == "slurm: left running (1 other process(es) hold them)"
        assert daemons(env) == started
        assert slurm.release(second.pid, env) == "slurm: stopped"
    assert gone(started)


def test_daemons_running_before_the_run_or_kept_are_left_running(
    second_slurm: dict[str, str],
) -> None:
    env = second_slurm
    with holders(2) as (run, next_run):
        # Asked to keep them: left for the next run, which leaves them too.
        start(run.pid, {**env, "PYRO_DISTRIBUTED_KEEP_SLURM": "1"})
        kept = daemons(env)
        assert sorted(kept) == sorted(DAEMONS)
        said = slurm.release(run.pid, env)
        assert said == "slurm: left running (they were running before the test run, or kept)"
        start(next_run.pid, env)
        assert slurm.release(next_run.pid, env) == said
        assert daemons(env) == kept
    subprocess.run(["bash", str(slurm.START), "stop"], env=env, check=True, timeout=120)
    assert gone(kept)
    # Started by hand (no --for): running until stopped by hand.
    by_hand = subprocess.run(
        ["bash", str(slurm.START)], env=env, capture_output=True, text=True, timeout=240
    )
    assert by_hand.returncode == 0, by_hand.stdout + by_hand.stderr
    before = daemons(env)
    assert sorted(before) == sorted(DAEMONS)
    with holders(1) as (run,):
        start(run.pid, env)
        assert slurm.release(run.pid, env) == said
    assert daemons(env) == before
