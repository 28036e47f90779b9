"""``write_owned_obsm``: every worker's rows written into one ``.h5ad`` by worker 0,
a block at a time, real workers (the cell2location run that uses it is in
test_cell2location_owned.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

import pyro_distributed as pd
from pyro_distributed import runtime
from pyro_distributed.lightning.obsm_writer import write_owned_obsm

from ..harness import CountingEngine, run_workers

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


def write(path: str, n_obs: int) -> list[tuple[str, int]]:
    engine = CountingEngine(pd.current_engine())
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
