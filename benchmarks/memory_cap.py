"""A memory cap for one process: a memory cgroup of its own, as a cluster's scheduler gives a job.

:func:`cap_this_process` makes a cgroup under the machine's memory controller
(cgroup v1, ``/sys/fs/cgroup/memory``, where ``memory.limit_in_bytes`` is the
cap; or v2, ``memory.max``), sets the cap, turns swap off for it, and moves
the calling process into it. The kernel's OOM killer then ends the process
if it outgrows the cap (exit by ``SIGKILL``), as on a node with that much
memory. Needs root. :func:`peak_megabytes` reads the most the kernel charged
to it (what the cap limits). :func:`remove_caps` removes the cgroups this benchmark
made once their processes have ended.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["PREFIX", "cap_this_process", "peak_megabytes", "remove_caps"]

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
PREFIX = "pd-bench-cap-"


def _root() -> tuple[Path, str]:
    if (V1 / "memory.limit_in_bytes").exists():
        return V1, "memory.limit_in_bytes"
    if (V2 / "cgroup.controllers").exists():
        return V2, "memory.max"
    raise RuntimeError("no memory cgroup controller at /sys/fs/cgroup (v1 memory/ or v2)")


def cap_this_process(megabytes: int, name: str) -> Path:
    """Put this process (and what it starts later) under a cap of ``megabytes``."""
    root, limit = _root()
    group = root / f"{PREFIX}{name}"
    group.mkdir(exist_ok=True)
    (group / limit).write_text(str(megabytes * 1024 * 1024))
    swap = "memory.memsw.limit_in_bytes" if limit == "memory.limit_in_bytes" else "memory.swap.max"
    if (group / swap).exists():  # no swapping past the cap: the node has this much
        (group / swap).write_text(str(megabytes * 1024 * 1024) if "memsw" in swap else "0")
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def peak_megabytes(group: Path) -> float:
    """The most memory the kernel charged to ``group`` at once. This, not the
    resident set, is what the cap limits: pages of shared libraries already in
    the page cache are charged to the cgroup that first read them."""
    for name in ("memory.max_usage_in_bytes", "memory.peak"):  # v1, v2
        if (group / name).exists():
            return int((group / name).read_text()) / 2**20
    return float("nan")


def remove_caps() -> None:
    """Remove the (empty) cgroups that :func:`cap_this_process` made."""
    try:
        root, _ = _root()
    except RuntimeError:
        return
    for group in root.glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError):  # a process still in it: left for the next call
            group.rmdir()
