"""A real one-node Slurm, started by ``scripts/start_slurm.sh``, and ``srun`` in it.

:func:`unavailable` runs the script once per process (it installs Debian's
``slurm-wlm`` and ``munge`` where they are missing, starts ``munged``,
``slurmctld`` and ``slurmd`` or finds them running, and checks that
``srun -n 2 hostname`` works) and says why Slurm cannot be used here, or
``None``; ``tests/conftest.py`` deselects the tests marked ``slurm`` with that
reason. :func:`srun` runs one step as a user would, from the checkout, with the
venv's ``python`` first on the ``PATH`` (so the tasks import its mpi4py and
MPICH), one thread per process, and a time limit after which the job is
cancelled and ``srun`` killed.

Each process that uses them holds the daemons (``--for`` its pid) and releases
them at its exit: daemons that a test run started stop when the last process
of the run (pytest-xdist's workers, or a concurrent run) is done, and daemons
that were running before are left running. ``PYRO_DISTRIBUTED_KEEP_SLURM=1``
keeps them for the next run, which then finds them up in well under a second;
``bash scripts/start_slurm.sh stop`` stops them.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .harness import is_launcher_variable

ROOT = Path(__file__).resolve().parents[2]
START = ROOT / "scripts" / "start_slurm.sh"
#: The script's own waits add up to about 3 minutes when apt-get has to install.
START_TIMEOUT = 240.0
_READY = re.compile(r"^slurm: ready \(SLURM_CONF=(.+)\)$")
_jobs = itertools.count()
#: A step whose resources are not granted within this many seconds fails at once
#: (``srun --immediate``) rather than queueing until its time-out: on a node of
#: two CPUs that is a node Slurm was told wrongly about, not a busy one.
IMMEDIATE = 60


@functools.cache
def _start() -> tuple[str | None, str | None]:
    """``(SLURM_CONF, None)`` once Slurm is usable, else ``(None, why not)``."""
    if os.geteuid() != 0:
        return None, "not root (scripts/start_slurm.sh starts the Slurm daemons as root)"
    conf, why = start_for(os.getpid(), os.environ)
    if conf is not None:
        _held.append(os.getpid())
    return conf, why


#: This process, once it holds the daemons (``_start`` succeeded).
_held: list[int] = []


def release_held() -> None:
    """Release the daemons if this process holds them (``tests/conftest.py``
    calls it as pytest ends, in each pytest-xdist worker)."""
    while _held:
        release(_held.pop(), os.environ)


def start_for(holder: int, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """Run ``scripts/start_slurm.sh --for HOLDER`` with ``environ`` (less any
    launcher's variables): ``(SLURM_CONF, None)`` once Slurm is usable, else
    ``(None, why not)``. The daemons are held for ``holder`` until :func:`release`."""
    try:
        done = subprocess.run(
            ["bash", str(START), "--for", str(holder)], capture_output=True, text=True,
            timeout=START_TIMEOUT, stdin=subprocess.DEVNULL, check=False, env=_clean(environ),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"scripts/start_slurm.sh did not finish within {START_TIMEOUT:g} s"
    said = [line for line in done.stdout.splitlines() if line.strip()]
    complained = [line for line in done.stderr.splitlines() if line.strip()]
    last = (said or complained or [""])[-1].strip()
    ready = _READY.match(last)
    if done.returncode == 0 and ready:
        return ready.group(1), None
    why = last.removeprefix("slurm: unavailable: ") or f"exit code {done.returncode}"
    return None, f"scripts/start_slurm.sh: {why}"


def release(holder: int, environ: Mapping[str, str]) -> str:
    """``scripts/start_slurm.sh release HOLDER``: what it said (``slurm:
    stopped`` where ``holder`` was the last to hold daemons a test run started)."""
    done = subprocess.run(
        ["bash", str(START), "release", str(holder)], capture_output=True, text=True,
        timeout=START_TIMEOUT, stdin=subprocess.DEVNULL, check=False, env=_clean(environ),
    )  # fmt: skip
    return (done.stdout + done.stderr).strip()


def unavailable() -> str | None:
    """Why a real Slurm cannot be used here, or ``None`` if it can (started if need be)."""
    return _start()[1]


def slurm_conf() -> str:
    """The ``SLURM_CONF`` that the clients of the started Slurm need."""
    conf, why = _start()
    if conf is None:
        raise RuntimeError(f"no Slurm: {why}")
    return conf


def _clean(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if not is_launcher_variable(name)}


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What ``srun`` and its tasks run with: this process's variables without any
    launcher's, ``SLURM_CONF``, the checkout importable, the venv first on the
    ``PATH``, one thread, unbuffered output."""
    env = _clean(os.environ)
    paths = [str(ROOT), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env.update(
        SLURM_CONF=slurm_conf(),
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def srun(
    options: Sequence[str],
    command: Sequence[str],
    *,
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
    typed: str | None = None,
) -> tuple[int, str]:
    """``srun OPTIONS COMMAND`` from the checkout's root: its exit code and its
    output (every task's stdout and stderr, and srun's own, interleaved).

    ``typed``: run ``srun`` in a terminal of its own (util-linux's ``script``),
    as from a user's shell, and type this text into it; what a ``--pty`` step
    reads, it reads from there.

    Every step is a job of its own on the one node, ended when any task fails
    (``--kill-on-bad-exit``) and, server-side, after a few minutes; one not
    allocated within :data:`IMMEDIATE` seconds fails with Slurm's reason. Past
    ``timeout`` the job is cancelled and ``srun`` killed; the exit code is then
    -9 and the output ends with a line saying so.
    """
    name = f"pyro-distributed-test-{os.getpid()}-{next(_jobs)}"
    minutes = max(1, int(timeout // 60) + 1)
    full = [
        "srun", f"--job-name={name}", f"--time={minutes}", "--kill-on-bad-exit=1",
        f"--immediate={IMMEDIATE}", *options, *command,
    ]  # fmt: skip
    run_env = environment(env)
    if typed is not None:
        # -e: script exits with srun's code; -q: nothing of its own.
        full = ["script", "-qec", shlex.join(full), "/dev/null"]
    process = subprocess.Popen(
        full, cwd=ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL if typed is None else subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(typed, timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], env=run_env, timeout=30, check=False)
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -9, f"{output}\nsrun did not finish within {timeout:g} s: job {name} cancelled"
    return process.returncode, output
