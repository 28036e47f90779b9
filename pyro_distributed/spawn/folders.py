"""A launch's folder in the temporary directory, and the folders of launchers that died.

Each launch writes its workers' checkpoints into a folder of its own, removed
once nothing refers to what they trained. A launching process that is killed
(a kernel restart, SIGKILL) runs no clean-up, so each folder names its owner:
a file holding the launching process's pid and the time the system booted
that process. A folder whose owner no longer runs is an orphan, and every
launch removes the orphans it finds before it starts: what a killed launch
left on disk is gone at the next launch at the latest. A folder whose owner
runs, or whose owner cannot be read, is left alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..atomic_write import host_id
from ..engines.base import process_is_alive

#: The prefix of a launch's folder in the temporary directory.
PREFIX = "pyro-distributed-launch-"
#: The file in a launch's folder that names its owner.
OWNER = "owner"


def new_folder() -> Path:
    """A fresh launch folder, owned by this process, after removing orphans."""
    remove_orphans()
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    (folder / OWNER).write_text(_identity(os.getpid()))
    return folder


def remove_orphans() -> list[Path]:
    """Remove the launch folders whose owner no longer runs; the ones removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            pid_text, started, host = (folder / OWNER).read_text().split(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours to judge: being made now, or written by someone else
        if host != host_id():
            continue  # its pid names a process elsewhere
        if not process_is_alive(pid) or _identity(pid) != f"{pid} {started} {host}":
            with contextlib.suppress(OSError):
                shutil.rmtree(folder)
                removed.append(folder)
    return removed


def _identity(pid: int) -> str:
    """``pid``, when it started (in clock ticks since boot, from /proc where
    there is one), so that a reused pid is not taken for the owner, and where."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            started = stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{pid} {started} {host_id()}"
