"""Training runs on hosts made of network namespaces (``cluster.py``): the
script they run, the environment a host's processes start with, and how a
test waits for them. Shared by the torchrun and the mpiexec tests across hosts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "multihost_train.py"
#: The engine's time-out inside these runs: every failure must end a host within it.
ENGINE_TIMEOUT = 20.0


def environment() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def finish(processes: list[subprocess.Popen[str]], within: float) -> list[tuple[int, str, float]]:
    """Each process's exit code, output and when it ended (seconds from now,
    each process's own: they are awaited side by side); a process still
    running after ``within`` seconds fails the test."""
    start = time.monotonic()
    ended: dict[int, tuple[int, str, float]] = {}

    def await_one(index: int, process: subprocess.Popen[str]) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            output, _ = process.communicate(timeout=within)
            ended[index] = (process.returncode, output, time.monotonic() - start)

    waiters = [
        threading.Thread(target=await_one, args=(index, process), daemon=True)
        for index, process in enumerate(processes)
    ]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join()
    for index, process in enumerate(processes):
        if index not in ended:
            # The whole process group: a worker left alive would hold the pipe open.
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"a host was still running {within:g} s later:\n{output[-4000:]}")
    return [ended[index] for index in range(len(processes))]


#: The faults strike after this step: by then the exchange has opened its
#: channel for the overlapped buckets (a process group of its own, made early
#: in training), so a fault hits training; the next test cuts a link during
#: that set-up.
FAULT_AFTER_STEP = 5


def step(out: Path, rank: int) -> int:
    try:
        return int((out / f"step{rank}").read_text() or -1)
    except (OSError, ValueError):
        return -1


def wait_for_steps(out: Path, ranks: int, processes: list[subprocess.Popen[str]]) -> None:
    """Until every worker is past :data:`FAULT_AFTER_STEP`."""
    deadline = time.monotonic() + 120
    while not all(step(out, r) >= FAULT_AFTER_STEP for r in range(ranks)):
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            outputs = [p.communicate(timeout=30)[0][-3000:] for p in processes]
            pytest.fail("the run ended or stalled before its first steps:\n" + "\n".join(outputs))
        time.sleep(0.2)
