"""Nothing outlives the process that launched the workers: a parent ended by any
signal (a kernel restart, ``timeout``, a scheduler's SIGKILL) takes its workers
with it within seconds, and the next launch removes the folder it left.
Also: a launch from a process that holds a torch.distributed group."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

import pyro_distributed as pd
from pyro_distributed.atomic_write import host_id
from pyro_distributed.engines.base import process_is_alive
from pyro_distributed.spawn import folders

from ..support.notebooks import ROOT
from .scripts import accidents

PARENT = ROOT / "tests" / "spawn" / "scripts" / "parent.py"


@pytest.fixture(autouse=True)
def _own_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Launch folders of their own, here and in the launching processes started
    here: a launch in another test removes a dead launcher's folder too."""
    folder = tmp_path_factory.mktemp("launch-folders")
    before = tempfile.tempdir
    tempfile.tempdir = str(folder)
    os.environ["TMPDIR"] = str(folder)
    yield folder
    tempfile.tempdir = before
    del os.environ["TMPDIR"]


def _start_parent(where: Path, method: str, *extra: str) -> subprocess.Popen[str]:
    """The launching process; its output is read only where the test asks (``dist``)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment.pop("OMP_NUM_THREADS", None)  # the machine's default threads
    output = subprocess.PIPE if "dist" in extra else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, str(PARENT), str(where), method, *extra],
        cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _recorded(where: Path, count: int, within: float = 60) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pids = [int(path.name) for path in where.iterdir()]
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"only {list(where.iterdir())} recorded within {within} s")


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(process_is_alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if process_is_alive(pid)]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]


def _folders_of(pid: int) -> list[Path]:
    return [
        folder
        for folder in Path(tempfile.gettempdir()).glob(f"{folders.PREFIX}*")
        if (folder / folders.OWNER).is_file()
        and (folder / folders.OWNER).read_text().startswith(f"{pid} ")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "method", "work"),
    [
        (signal.SIGKILL, "forkserver", "sleep"),
        (signal.SIGTERM, "forkserver", "sleep"),
        (signal.SIGHUP, "forkserver", "sleep"),
        (signal.SIGKILL, "forkserver", "gil"),
        (signal.SIGKILL, "spawn", "sleep"),
        (signal.SIGKILL, "fork", "sleep"),
        (signal.SIGKILL, "fork", "gil"),
    ],
)
def test_workers_die_with_their_parent_and_the_next_launch_removes_its_folder(
    signum: int, method: str, work: str, tmp_path: Path
) -> None:
    where = tmp_path / "pids"
    where.mkdir()
    parent = _start_parent(where, method, *(["gil"] if work == "gil" else []))
    try:
        workers = _recorded(where, 2)
        helpers = [pid for pid in _children(parent.pid) if pid not in workers]  # forkserver
        assert len(_folders_of(parent.pid)) == 1
        os.kill(parent.pid, signum)
        parent.wait(10)
        # The workers within seconds; the forkserver when it next runs, which on
        # a machine whose every core is busy has taken more than five.
        still = _gone_within(workers, 5) + _gone_within(helpers, 30)
        assert still == [], subprocess.run(
            ["ps", "-o", "pid,ppid,pgid,stat,cmd", "-p", ",".join(map(str, workers + helpers))],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
    finally:
        parent.kill()
        parent.wait()
    left = _folders_of(parent.pid)
    assert len(left) == 1  # nobody ran the dead parent's clean-up
    (tmp_path / "next").mkdir()
    pd.launch(accidents.returns, str(tmp_path / "next"), 1, workers=1)
    assert not left[0].exists()


def test_a_folder_whose_owner_runs_or_cannot_be_read_is_kept() -> None:
    alive = folders.new_folder()
    unreadable = Path(tempfile.mkdtemp(prefix=folders.PREFIX))
    (unreadable / folders.OWNER).write_text("not a pid")
    elsewhere = Path(tempfile.mkdtemp(prefix=folders.PREFIX))  # another host's, or container's
    (elsewhere / folders.OWNER).write_text("4194303 17 0123abcd")
    dead = Path(tempfile.mkdtemp(prefix=folders.PREFIX))
    (dead / folders.OWNER).write_text(f"4194303 17 {host_id()}")
    kept = (alive, unreadable, elsewhere)
    try:
        assert folders.remove_orphans() == [dead]
        assert all(folder.exists() for folder in kept) and not dead.exists()
    finally:
        for folder in kept:
            shutil.rmtree(folder)


@pytest.mark.slow
def test_a_kernel_restart_ends_the_workers_it_launched(tmp_path: Path) -> None:
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        client.execute(
            "import os, sys, time\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "os.environ.pop('OMP_NUM_THREADS', None)\n"
            "import torch\n"
            "torch.ones(2**22).mul_(2)\n"
            "import pyro_distributed as pd\n"
            "from tests.spawn.scripts.parent import sleep_forever\n"
            f"pd.launch(sleep_forever, {str(tmp_path)!r}, workers=2)\n"
        )
        workers = _recorded(tmp_path, 2)
        kernel_pid = manager.provisioner.pid  # type: ignore[union-attr]
        manager.restart_kernel(now=True)  # Jupyter's "restart kernel": the old one is killed
        assert not process_is_alive(kernel_pid)
        assert _gone_within(workers, 5) == []
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


@pytest.mark.slow
def test_a_launch_from_a_process_with_a_process_group_runs_or_is_refused_by_name(
    tmp_path: Path,
) -> None:
    parent = _start_parent(tmp_path, "forkserver", "dist")
    output, _ = parent.communicate(timeout=120)
    assert parent.returncode == 0 and "launched (0, 2," in output, output
    parent = _start_parent(tmp_path, "fork", "dist")
    output, _ = parent.communicate(timeout=120)
    assert parent.returncode == 0, output
    assert "refused this process holds a torch.distributed process group" in output, output
