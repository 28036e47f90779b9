"""pd.launch from a plain process: what comes back, resuming, failures, and arguments.

The launches here start from the pytest process itself, as from a kernel
(tests/spawn/test_notebooks.py launches from a real Jupyter kernel).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.engines.base import process_is_alive

from ..support.harness import run_workers
from .scripts.owned_rows import NAMES, train

STEPS = 6


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    pyro.clear_param_store()


def _store() -> dict[str, torch.Tensor]:
    return {name: pyro.param(name).detach().clone() for name in NAMES}


def _trained_directly(steps: int) -> dict[str, Any]:
    train(steps, seed=0)
    return {name: pd.gather_param(name, to="all") for name in NAMES}


def test_the_trained_store_and_owned_rows_come_back_joined_in_order() -> None:
    launched = pd.launch(train, STEPS, 0, workers=2)
    assert launched.value == STEPS and launched.local_rows_loaded
    here = _store()
    direct = run_workers(_trained_directly, STEPS)[0]
    for name in NAMES:
        assert torch.equal(here[name], direct[name]), name
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("workers", [2, 3])
def test_two_launches_end_bitwise_where_one_launch_of_both_does(workers: int) -> None:
    pd.launch(train, 2 * STEPS, 0, workers=workers)
    straight = _store()
    pyro.clear_param_store()
    first = pd.launch(train, STEPS, 0, workers=workers)
    second = pd.launch(train, STEPS, workers=workers, resume=first)
    assert second.value == 2 * STEPS  # the optimizer's step count went on
    for name, value in _store().items():
        assert torch.equal(value, straight[name]), name


def test_rows_past_the_limit_stay_on_disk_and_read_back_joined() -> None:
    in_memory = pd.launch(train, STEPS, 0, workers=2)
    wanted = {name: pyro.param(name).unconstrained().detach().clone() for name in ("z_loc",)}
    pyro.clear_param_store()
    on_disk = pd.launch(train, STEPS, 0, workers=2, rows_in_memory=0)
    assert in_memory.local_rows_loaded and not on_disk.local_rows_loaded
    assert "z_loc" not in pyro.get_param_store()
    assert torch.equal(on_disk.local_rows("z_loc"), wanted["z_loc"])
    with pytest.raises(KeyError, match="'mu_loc' is not an owned local parameter"):
        on_disk.local_rows("mu_loc")


def _raise_on_one_worker(pids: str) -> None:
    Path(pids, str(os.getpid())).touch()
    pd.barrier()
    if pd.rank() == 1:
        raise ValueError("a bad value on worker 1")
    pd.barrier()  # worker 0 waits here until it is stopped


def test_a_workers_exception_is_raised_with_its_traceback_and_stops_every_worker(
    tmp_path: Path,
) -> None:
    began = time.monotonic()
    with pytest.raises(pd.PyroDistributedError) as info:
        pd.launch(_raise_on_one_worker, str(tmp_path), workers=2)
    message = str(info.value)
    assert "worker 1 of 2 raised; every worker was stopped" in message
    assert "ValueError: a bad value on worker 1" in message
    assert "_raise_on_one_worker" in message  # the traceback
    assert time.monotonic() - began < 20  # not the engine's time-out
    pids = [int(path.name) for path in tmp_path.iterdir()]
    assert len(pids) == 2 and not any(process_is_alive(pid) for pid in pids)


def _hang_on_one_worker() -> None:
    if pd.rank() == 1:
        time.sleep(3600)
    pd.barrier()


def test_a_hung_worker_ends_at_the_engines_time_out() -> None:
    began = time.monotonic()
    with pytest.raises(pd.PyroDistributedError, match=r"worker 0 of 2 raised") as info:
        pd.launch(_hang_on_one_worker, workers=2, timeout=3)
    assert "time-out 3 s" in str(info.value)
    assert time.monotonic() - began < 30
    assert multiprocessing.active_children() == []


def test_spawn_runs_an_importable_function() -> None:
    launched = pd.launch(train, 2, 0, workers=2, start_method="spawn")
    assert launched.value == 2 and set(NAMES) <= set(pyro.get_param_store().keys())


def test_what_cannot_work_is_refused_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="workers must be an int of at least 1, got 0"):
        pd.launch(train, workers=0)
    with pytest.raises(ValueError, match=r"engine must be one of .*horovodrun and mpiexec"):
        pd.launch(train, workers=2, engine="mpi")
    with pytest.raises(TypeError, match="resume must be what an earlier launch returned"):
        pd.launch(train, workers=2, resume="run.pt")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"timeout must be seconds .* got True"):
        pd.launch(train, workers=2, timeout=True)
    with pytest.raises(ValueError, match="timeout must be a positive, finite duration"):
        pd.launch(train, workers=2, timeout=-1)
    with pytest.raises(ValueError, match="start_method must be None, 'fork', 'spawn'"):
        pd.launch(train, workers=2, start_method="thread")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(pd.PyroDistributedError, match="CUDA is already initialised"):
        pd.launch(train, workers=2, start_method="fork")
    assert multiprocessing.active_children() == []
