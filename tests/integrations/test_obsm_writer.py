"""``write_owned_obsm``: every worker's rows written into one ``.h5ad`` by worker 0,
a block at a time, real workers (the cell2location run that uses it is in
test_cell2location_owned.py)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed import runtime
from pyro_distributed.integrations.scvi import obsm_writer, write_owned_obsm

from ..support.harness import CountingEngine, WorkerFailure, run_workers

pytestmark = [
    pytest.mark.integrations,
    pytest.mark.skipif(
        importlib.util.find_spec("anndata") is None, reason="needs the integrations extra"
    ),
]


def block_of(rank: int) -> tuple[int, int]:
    """Uneven blocks: worker r holds r + 2 rows, after the rows of the workers before it."""
    start = sum(r + 2 for r in range(rank))
    return start, start + rank + 2


def write(path: str, n_obs: int, engine: CountingEngine | None = None) -> list[tuple[str, int]]:
    engine = engine or CountingEngine(pd.current_engine())
    start, stop = block_of(engine.rank)
    rows = np.arange(start, stop)
    blocks = {
        "means": np.stack([rows * 1.5, -rows], axis=1).astype(np.float32),
        "labels": rows.astype(np.int64),
    }
    names = [f"spot{i}" for i in range(n_obs)]
    # The counting engine sees the collectives that the writer's trip makes.
    with mock.patch.object(runtime, "_engine", engine):
        write_owned_obsm(path, blocks, obs_names=names)
    return engine.calls


def test_every_workers_rows_land_in_order_one_block_at_a_time(tmp_path: Path) -> None:
    import anndata

    path = tmp_path / "results.h5ad"
    n_obs = block_of(3)[0]  # 2 + 3 + 4 rows at W=3
    calls = run_workers(write, str(path), n_obs, world_size=3)
    written = anndata.read_h5ad(path)
    assert list(written.obs_names) == [f"spot{i}" for i in range(n_obs)]
    rows = np.arange(n_obs)
    assert written.obsm["means"].dtype == np.float32
    assert np.array_equal(written.obsm["means"], np.stack([rows * 1.5, -rows], axis=1))
    assert np.array_equal(np.ravel(written.obsm["labels"]), rows)  # anndata reads (n, 1)
    for worker_calls in calls:
        # The check's one object all-gather, the shapes', then one broadcast
        # per worker's block of each key: never a gather of every block.
        assert worker_calls == [("allgather_object", 1)] * 2 + [("broadcast", 1)] * 6


def test_an_existing_file_keeps_what_it_holds_and_gains_the_keys(tmp_path: Path) -> None:
    import anndata
    import pandas

    path = tmp_path / "spots.h5ad"
    n_obs = block_of(2)[0]
    index = [f"spot{i}" for i in range(n_obs)]
    existing = anndata.AnnData(
        X=np.ones((n_obs, 3), dtype=np.float32), obs=pandas.DataFrame(index=index)
    )
    existing.obsm["means"] = np.zeros((n_obs, 2), dtype=np.float32)  # replaced
    existing.obsm["spatial"] = np.full((n_obs, 2), 7.0)  # kept
    existing.write_h5ad(path)
    run_workers(write, str(path), n_obs, world_size=2)
    written = anndata.read_h5ad(path)
    assert np.array_equal(written.X, existing.X)
    assert np.array_equal(written.obsm["spatial"], existing.obsm["spatial"])
    rows = np.arange(n_obs)
    assert np.array_equal(written.obsm["means"], np.stack([rows * 1.5, -rows], axis=1))


def refused(path: str, n_obs: int) -> str:
    with pytest.raises((ValueError, pd.PyroDistributedError)) as info:
        write(path, n_obs)
    return f"{info.type.__name__}: {info.value}"


def test_rows_that_do_not_add_up_are_refused_on_every_worker(tmp_path: Path) -> None:
    path = tmp_path / "results.h5ad"
    for message in run_workers(refused, str(path), 99, world_size=2):
        assert message.startswith("ValueError"), message
        assert "'means' ([2, 3] by worker" in message and "99 observations" in message
    assert not _holds_key(path, "means")


def test_a_file_of_another_size_is_refused_on_every_worker(tmp_path: Path) -> None:
    import anndata
    import pandas

    path = tmp_path / "other.h5ad"
    anndata.AnnData(obs=pandas.DataFrame(index=["a", "b"])).write_h5ad(path)
    for message in run_workers(refused, str(path), 5, world_size=2):
        assert message.startswith("PyroDistributedError"), message
        assert f"worker 0 cannot write results into {path}" in message
        assert "it holds 2 observations, obs_names has 5" in message


def _holds_key(path: Path, key: str) -> Any:
    import h5py

    if not path.exists():
        return False
    with h5py.File(path, "r") as handle:
        return key in handle["obsm"]


# --- a write cut short leaves the previous results ------------------------------------------


class LostMidStream(CountingEngine):
    """Forwards collectives until this worker's ``broadcasts``-th broadcast, which
    fails (``exit=False``) or ends the process there (``exit=True``)."""

    def __init__(self, broadcasts: int, *, exit: bool = False) -> None:
        super().__init__(pd.current_engine())
        self.left, self.exit = broadcasts, exit

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        self.left -= 1
        if self.left == 0:
            if self.exit:
                os._exit(1)  # a worker lost mid-stream, as if killed
            raise RuntimeError("connection lost mid-stream")
        super().broadcast_(tensors, src)


def previous_results(path: Path, n_obs: int) -> dict[str, np.ndarray]:
    """An .h5ad holding earlier results under both keys that ``write`` writes, and another."""
    import anndata
    import pandas

    generator = np.random.default_rng(0)
    existing = anndata.AnnData(obs=pandas.DataFrame(index=[f"spot{i}" for i in range(n_obs)]))
    existing.obsm["means"] = generator.normal(size=(n_obs, 2)).astype(np.float32)
    existing.obsm["labels"] = generator.integers(100, 200, size=(n_obs, 1))
    existing.obsm["spatial"] = generator.normal(size=(n_obs, 2))
    existing.write_h5ad(path)
    return dict(existing.obsm)


def stored_obsm(path: Path) -> dict[str, np.ndarray]:
    """``obsm`` as the file holds it, every key, read with h5py."""
    import h5py

    with h5py.File(path, "r") as handle:
        return {key: value[()] for key, value in handle["obsm"].items()}


def assert_bitwise_equal(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        assert found[key].dtype == value.dtype, key
        assert found[key].tobytes() == value.tobytes(), key


def test_a_write_that_fails_mid_stream_leaves_the_previous_results(tmp_path: Path) -> None:
    import anndata

    path = tmp_path / "spots.h5ad"
    n_obs = block_of(1)[0]  # worker 0's rows alone: one process
    previous = previous_results(path, n_obs)
    # The keys travel in sorted order: "labels" is all in, "means" is under way.
    with pytest.raises(RuntimeError, match="connection lost mid-stream"):
        write(str(path), n_obs, LostMidStream(broadcasts=2))
    assert_bitwise_equal(stored_obsm(path), previous)
    assert_bitwise_equal(dict(anndata.read_h5ad(path).obsm), previous)
    # The next write that succeeds replaces them.
    write(str(path), n_obs)
    written = anndata.read_h5ad(path).obsm
    rows = np.arange(n_obs)
    assert np.array_equal(written["means"], np.stack([rows * 1.5, -rows], axis=1))
    assert np.array_equal(np.ravel(written["labels"]), rows)
    assert np.array_equal(written["spatial"], previous["spatial"])
    assert set(stored_obsm(path)) == {"means", "labels", "spatial"}


def lost_worker(path: str, n_obs: int) -> None:
    # Worker 2 ends at its first broadcast: its block of "labels", the first key.
    write(path, n_obs, LostMidStream(broadcasts=1, exit=True) if pd.rank() == 2 else None)


def test_a_worker_lost_mid_stream_leaves_the_previous_results(tmp_path: Path) -> None:
    path = tmp_path / "spots.h5ad"
    n_obs = block_of(3)[0]
    previous = previous_results(path, n_obs)
    with pytest.raises(WorkerFailure) as failure:
        run_workers(lost_worker, str(path), n_obs, world_size=3)
    assert "died without reporting" in failure.value.reports[2]
    assert 0 in failure.value.reports, "worker 0 saw the loss"
    assert_bitwise_equal(stored_obsm(path), previous)


def swap_cut_short(path: Path, key_linked: bool) -> dict[str, np.ndarray]:
    """The file as a write killed inside its swap of ``means`` leaves it: the
    previous dataset renamed to its backup name, the new one linked or not."""
    import h5py

    with h5py.File(path, "r+") as handle:
        obsm = handle["obsm"]
        obsm.move("means", "means" + obsm_writer._BACKUP_SUFFIX)
        if key_linked:
            obsm.create_dataset("means", data=obsm["labels"][()])
    return stored_obsm(path)


def write_other_key(path: str, n_obs: int) -> None:
    write_owned_obsm(path, {"other": np.zeros(n_obs)}, obs_names=[f"spot{i}" for i in range(n_obs)])


def test_the_next_write_puts_back_a_result_whose_swap_was_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "spots.h5ad"
    previous = previous_results(path, 4)
    swap_cut_short(path, key_linked=False)
    write_other_key(str(path), 4)
    found = stored_obsm(path)
    assert found.pop("other").tolist() == [0.0] * 4
    assert_bitwise_equal(found, previous)


def test_the_next_write_deletes_the_backup_of_a_swap_that_linked_its_key(tmp_path: Path) -> None:
    path = tmp_path / "spots.h5ad"
    previous_results(path, 4)
    linked = swap_cut_short(path, key_linked=True)
    del linked["means" + obsm_writer._BACKUP_SUFFIX]
    write_other_key(str(path), 4)
    found = stored_obsm(path)
    del found["other"]
    assert_bitwise_equal(found, linked)


def test_a_key_named_like_a_backup_is_refused(tmp_path: Path) -> None:
    key = "means" + obsm_writer._BACKUP_SUFFIX
    with pytest.raises(ValueError, match="the name under which a key's previous values wait"):
        write_owned_obsm(tmp_path / "spots.h5ad", {key: np.zeros(2)}, obs_names=["a", "b"])
