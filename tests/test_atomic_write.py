"""Replacing a file all or nothing: through symbolic links, beside other writers,
and clean-ups that remove only what dead writers left."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import re
import stat
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pyro
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed import atomic_write, safe_files
from pyro_distributed.atomic_write import STALE_AFTER, host_id, is_stale, writable_target
from pyro_distributed.checkpoint.files import load_file

SAVES_PER_WRITER = 40


def _write(path: Path, value: float) -> None:
    safe_files.write(path, "block", {}, {"x": torch.full((4,), value)})


def _read(path: Path) -> float:
    _, payload = safe_files.load(path, "block", trusted=False)
    return float(payload["x"][0])


def _dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(done.stdout)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_link_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "store"
    elsewhere.mkdir()
    target = elsewhere / "data.pt"
    _write(target, 1.0)
    link = tmp_path / "data.pt"
    link.symlink_to(target)
    chained = tmp_path / "chained.pt"
    chained.symlink_to("data.pt")  # relative, and through another link
    _write(link, 2.0)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert _read(target) == 2.0
    _write(chained, 3.0)
    assert chained.is_symlink() and link.is_symlink()
    assert _read(target) == 3.0
    # The temporary was made, and renamed, beside the target.
    assert sorted(p.name for p in elsewhere.iterdir()) == ["data.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chained.pt", "data.pt", "store"]


def test_lightnings_writer_replaces_a_last_link_and_keeps_the_best_checkpoint(
    tmp_path: Path,
) -> None:
    """Lightning's save_last="link" leaves last.ckpt linking to a top-k file,
    and may save last.ckpt again: the link goes, the best file stays."""
    from pyro_distributed.integrations.lightning import checkpoints

    best = tmp_path / "epoch=3.ckpt"
    best.write_bytes(b"BEST")
    last = tmp_path / "last.ckpt"
    last.symlink_to(best.name)
    checkpoints._write_here(last, {"epoch": 4})
    assert not last.is_symlink() and torch.load(last)["epoch"] == 4
    assert best.read_bytes() == b"BEST"
    atomic_write.write_with(last, lambda file: file.write(b"again"), through_links=False)
    assert last.read_bytes() == b"again" and best.read_bytes() == b"BEST"


def test_a_dangling_link_creates_the_file_it_names(tmp_path: Path) -> None:
    link = tmp_path / "data.pt"
    link.symlink_to(tmp_path / "not-yet.pt")
    _write(link, 4.0)
    assert link.is_symlink()
    assert _read(tmp_path / "not-yet.pt") == 4.0


def test_a_link_to_a_device_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    link = tmp_path / "null.pt"
    link.symlink_to("/dev/null")
    with pytest.raises(ValueError, match=r"null\.pt.*leads to '/dev/null'.*a character device"):
        _write(link, 1.0)
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null.pt"]


def test_what_is_not_a_regular_file_is_refused_by_name(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    directory = tmp_path / "folder"
    directory.mkdir()
    loop = tmp_path / "loop.pt"
    loop.symlink_to(tmp_path / "loop.pt")
    to_pipe = tmp_path / "to-pipe.pt"
    to_pipe.symlink_to(pipe)
    cases = {
        pipe: r"'.*pipe': it is a named pipe, not a regular file",
        to_pipe: r"to-pipe\.pt' \(which leads to '.*pipe'\): it is a named pipe",
        directory: r"folder': it is a directory",
        loop: r"loop\.pt': its links lead to no file",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            _write(path, 1.0)
    assert stat.S_ISFIFO(os.stat(pipe).st_mode) and to_pipe.is_symlink()
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_device_node_path_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'/dev/null': it is a character device"):
        writable_target(Path("/dev/null"))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_the_checkpoint_functions_refuse_a_link_to_a_device(tmp_path: Path) -> None:
    pd.init("local")
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    link = tmp_path / "run.pt"
    link.symlink_to("/dev/null")
    with pytest.raises(pd.PyroDistributedError, match=r"run\.pt.*a character device"):
        pd.save_checkpoint(link, optim)
    assert link.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def _save_repeatedly(path: str, writer: int, start: multiprocessing.synchronize.Barrier) -> str:
    try:
        torch.set_num_threads(1)
        pd.init("local")
        pyro.clear_param_store()
        optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
        param = pyro.param("w", torch.full((50_000,), float(writer))).unconstrained()
        param.sum().backward()
        optim([param])
        start.wait(60)
        for _ in range(SAVES_PER_WRITER):
            pd.save_checkpoint(path, optim)
        return ""
    except BaseException:
        return traceback.format_exc()


def _writer(path: str, writer: int, start: multiprocessing.synchronize.Barrier, out: str) -> None:
    Path(out).write_text(_save_repeatedly(path, writer, start))


def test_two_processes_save_one_path_at_once(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    context = multiprocessing.get_context("forkserver")
    start = context.Barrier(2)
    outs = [tmp_path / f"writer{n}.txt" for n in (1, 2)]
    writers = [
        context.Process(target=_writer, args=(str(path), n, start, str(out)))
        for n, out in zip((1, 2), outs, strict=True)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(300)
    failures = [out.read_text() if out.exists() else "no report" for out in outs]
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert failures == ["", ""], "\n".join(failures)
    # One writer's complete checkpoint: every value is that writer's.
    state = load_file(path)
    values = state["param_store"]["params"]["w"].detach()
    first = float(values[0])  # a writer's number, less Adam's first step of lr 0.1
    assert values.shape == (50_000,) and round(first + 0.1, 4) in (1.0, 2.0)
    assert torch.equal(values, torch.full_like(values, first))
    assert state["optim"]["w"]["state"][0]["exp_avg"].shape == (50_000,)
    assert not list(tmp_path.glob(".*.tmp"))


def test_only_stale_temporaries_are_removed(tmp_path: Path) -> None:
    here = host_id()
    other_host = "0123abcd" if here != "0123abcd" else "4567cdef"
    stale = {
        "a dead writer's of this host": f".run.pt.{here}-{_dead_pid()}-0badf00d.tmp",
        "another host's, unwritten too long": f".run.pt.{other_host}-1-0badf00d.tmp",
        "one without a writer, unwritten too long": ".run.pt.0badf00d.tmp",
    }
    live = {
        "a live writer's of this host": f".run.pt.{here}-{os.getpid()}-0badf00d.tmp",
        "another host's, written just now": f".run.pt.{other_host}-1-1badf00d.tmp",
        "one without a writer, written just now": ".run.pt.1badf00d.tmp",
        "another file's": f".other.pt.{here}-{_dead_pid()}-0badf00d.tmp",
    }
    for name in [*stale.values(), *live.values()]:
        (tmp_path / name).write_bytes(b"partial")
    _age(tmp_path / stale["another host's, unwritten too long"], STALE_AFTER.total_seconds() + 60)
    _age(
        tmp_path / stale["one without a writer, unwritten too long"],
        STALE_AFTER.total_seconds() + 60,
    )
    _age(tmp_path / live["another host's, written just now"], 60)
    assert {what for what, name in {**stale, **live}.items() if is_stale(tmp_path / name)} == {
        *stale,
        "another file's",
    }
    atomic_write.remove_temporaries(tmp_path, re.compile(r"run\.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(live.values())


def test_a_dead_savers_temporaries_are_removed_at_the_next_save(tmp_path: Path) -> None:
    pd.init("local")
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    path = tmp_path / "run.pt"
    pd.save_checkpoint(path, optim)
    dead, alive = _dead_pid(), os.getpid()
    left = [
        tmp_path / f".run.pt.{host_id()}-{dead}-0badf00d.tmp",
        tmp_path / f".run.pt.0a1b2c3d4e5f.block1of2.{host_id()}-{dead}-12345678.tmp",
    ]
    kept = [
        tmp_path / f".run.pt.{host_id()}-{alive}-0badf00d.tmp",  # a save under way
        tmp_path / f".other.pt.{host_id()}-{dead}-0badf00d.tmp",
        tmp_path / ".run.pt.notes",
    ]
    for file in left + kept:
        file.write_bytes(b"partial")
    pd.save_checkpoint(path, optim)
    assert not any(file.exists() for file in left)
    assert all(file.exists() for file in kept)
