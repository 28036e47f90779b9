"""Checkpoints of local parameters: bitwise resume, elastic re-partition, all or nothing.

Each worker writes its own block beside worker 0's file. Resuming at the
same number of workers must continue bitwise; resuming at another number
must hand every worker exactly its new rows, with their optimizer state,
and keep the global parameters and their state intact.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch

import pyro_distributed as pd
import pyro_distributed.local.blocks
import pyro_distributed.local.registry

from ..support.blocks import owned_svi, train_owned
from ..support.compare import assert_same_state
from ..support.harness import ENGINES, run_workers, with_engines
from ..support.ownership import D, N

LOCAL = ("z_loc", "z_scale")


def _snapshot(optim: pd.DistributedOptimizer) -> dict[str, Any]:
    store = pyro.get_param_store()
    return {
        "values": {name: value.detach().clone() for name, value in store.named_parameters()},
        "optim": optim.get_state(),
        "rows": {name: pd.local_rows(name)[0] for name in LOCAL},
    }


def straight(steps: int, save_at: int, path: str) -> dict[str, Any]:
    svi, optim, x = owned_svi()
    train_owned(svi, x, save_at)
    pd.save_checkpoint(path, optim)
    train_owned(svi, x, steps - save_at)
    return _snapshot(optim)


def resumed(steps: int, path: str) -> dict[str, Any]:
    svi, optim, x = owned_svi()
    start = pd.load_checkpoint(path, optim)
    train_owned(svi, x, steps - start)
    return _snapshot(optim)


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_at_the_same_world_size_is_bitwise(engine: str, tmp_path: Path) -> None:
    path = str(tmp_path / "run.pt")
    uninterrupted = run_workers(straight, 10, 4, path, engine=engine)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 3 and files[0] == "run.pt", files
    assert all(".block" in name for name in files[1:]), "one block file per worker"
    again = run_workers(resumed, 10, path, engine=engine)
    for rank in range(2):
        assert_same_state(again[rank], uninterrupted[rank], f"worker {rank}")


def saved_then_state(path: str) -> dict[str, Any]:
    svi, optim, x = owned_svi()
    train_owned(svi, x, 6)
    pd.save_checkpoint(path, optim)
    return _snapshot(optim)


def loaded_state(path: str, steps_after: int) -> dict[str, Any]:
    svi, optim, x = owned_svi()
    # Loaded optimizer state is handed to optim.set_state, and waits in Pyro's
    # optimizer until each parameter's next step; record what was handed over
    # (a copy: Adam then updates those tensors in place).
    handed: dict[str, Any] = {}
    set_state = optim.set_state

    def recording_set_state(state: dict[str, Any]) -> None:
        handed.update(copy.deepcopy(state))
        set_state(state)

    optim.set_state = recording_set_state  # type: ignore[method-assign]
    pd.load_checkpoint(path, optim)
    snapshot = _snapshot(optim)
    snapshot["optim"] = handed
    train_owned(svi, x, steps_after)  # and training goes on from there
    return snapshot


def _whole(per_worker: list[dict[str, Any]], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A local parameter's N rows and its Adam exp_avg, joined from every worker's block."""
    values = torch.cat([worker["values"][name] for worker in per_worker])
    moments = torch.cat([worker["optim"][name]["state"][0]["exp_avg"] for worker in per_worker])
    return values, moments


@pytest.mark.parametrize(
    ("engine", "saved_at", "loaded_at"), with_engines([(2, 3), (3, 1)], on_mpi=[(2, 3)])
)
@pytest.mark.slow
def test_elastic_resume_repartitions_the_blocks(
    engine: str, tmp_path: Path, saved_at: int, loaded_at: int
) -> None:
    path = str(tmp_path / "run.pt")
    saved = run_workers(saved_then_state, path, world_size=saved_at, engine=engine)
    loaded = run_workers(loaded_state, path, 2, world_size=loaded_at, engine=engine)
    for name in LOCAL:
        values, moments = _whole(saved, name)
        assert values.shape == (N, D)
        for rank, worker in enumerate(loaded):
            rows = range(rank * N // loaded_at, (rank + 1) * N // loaded_at)
            assert worker["rows"][name].tolist() == list(rows)
            assert torch.equal(worker["values"][name], values[rows.start : rows.stop])
            state = worker["optim"][name]["state"][0]
            assert torch.equal(state["exp_avg"], moments[rows.start : rows.stop])
            assert int(state["step"]) == 6
    for worker in loaded:
        assert torch.equal(worker["values"]["mu_loc"], saved[0]["values"]["mu_loc"])
        assert_same_state(worker["optim"]["mu_loc"], saved[0]["optim"]["mu_loc"], "global state")


def failing_second_save(path: str) -> dict[str, Any]:
    svi, optim, x = owned_svi()
    train_owned(svi, x, 3)
    pd.save_checkpoint(path, optim)
    before = _snapshot(optim)
    train_owned(svi, x, 3)
    if pd.rank() == 1:

        def refuse(target: Path, token: str, rank: int, workers: int, state: Any) -> None:
            raise OSError("disk full (injected)")

        pyro_distributed.local.blocks.write_block = refuse  # type: ignore[assignment]
    with pytest.raises(pd.PyroDistributedError) as error:
        pd.save_checkpoint(path, optim)
    return {"before": before, "error": str(error.value)}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_save_leaves_the_previous_checkpoint_intact_and_complete(
    engine: str,
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "run.pt")
    first, second = run_workers(failing_second_save, path, engine=engine)
    for worker in (first, second):
        assert "worker 1: OSError: disk full (injected)" in worker["error"]
        assert "the previous checkpoint is intact" in worker["error"]
    assert len(list(tmp_path.iterdir())) == 3, "no file of the failed save is left"
    loaded = run_workers(loaded_state, path, 0, engine=engine)
    for rank, worker in enumerate((first, second)):
        assert_same_state(loaded[rank]["values"], worker["before"]["values"], f"worker {rank}")


def test_removing_blocks_touches_exactly_that_checkpoints_files(tmp_path: Path) -> None:
    # A name that starts with another checkpoint's name and a dot ("last.ckpt.ckpt")
    # must not be taken for one of its blocks, nor must any file that is not a block.
    blocks = pyro_distributed.local.blocks
    names = {
        "last.ckpt.0a1b2c.block0of2": "stale",
        "last.ckpt.0a1b2c.block1of2": "stale",
        "last.ckpt.ffff00.block0of2": "kept",
        "last.ckpt.ffff00.block1of2": "kept",
        "last.ckpt": "kept",
        "last.ckpt.ckpt": "kept",
        "last.ckpt.ckpt.0a1b2c.block0of2": "kept",
        "last.ckpt.0a1b2c.block0of2.bak": "kept",
        "last.ckpt.notes": "kept",
    }
    for name in names:
        (tmp_path / name).write_text(name)
    blocks.remove_blocks(tmp_path / "last.ckpt", keep="ffff00")
    left = {path.name for path in tmp_path.iterdir()}
    assert left == {name for name, fate in names.items() if fate == "kept"}
    blocks.remove_blocks(tmp_path / "last.ckpt", keep="ffff00", only_rank=1)
    assert "last.ckpt.ffff00.block1of2" not in {path.name for path in tmp_path.iterdir()}
    blocks.remove_blocks(tmp_path / "last.ckpt")
    assert {path.name for path in tmp_path.iterdir()} == left - {
        "last.ckpt.ffff00.block0of2",
        "last.ckpt.ffff00.block1of2",
    }


class _Mkdir:
    """A pickle that makes a directory when it is loaded."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.where),))


@pytest.mark.parametrize("trusted", [False, True])
def test_a_block_file_is_data_unless_trusted_by_name(tmp_path: Path, trusted: bool) -> None:
    pd.init("local")
    blocks = pyro_distributed.local.blocks
    made = tmp_path / "made-by-the-file"
    path = tmp_path / "run.pt"
    param = pyro_distributed.local.registry.LocalParam("z", "data", 4, -1)
    hostile = {
        "rows": {"z": [0, 4]},
        "params": {"z": torch.zeros(4)},
        "optim": {},
        "x": _Mkdir(made),
    }
    blocks.write_block(path, "0a1b2c", 0, 1, hostile)
    meta = {"token": "0a1b2c", "world_size": 1}
    if trusted:  # asked for by name (Lightning's weights_only=False): the code runs
        blocks.load_blocks(path, meta, {"z": param}, pd.current_engine(), trusted=True)
        assert made.is_dir()
        return
    with pytest.raises(pd.PyroDistributedError, match=r"worker 0: .*needs (posix|os)\.mkdir"):
        blocks.load_blocks(path, meta, {"z": param}, pd.current_engine())
    assert not made.exists()
