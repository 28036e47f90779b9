"""Data sharding: shard, shard_indices, ShardSampler and even_batches, on real workers."""

from __future__ import annotations

import pytest
import torch

import pyro_distributed as pd

from ..harness import run_workers

SIZE = 20


# --- sharding data --------------------------------------------------------------------------


def shards(n: int, uneven: str) -> dict[str, list[int]]:
    sampler = pd.ShardSampler(range(n), shuffle=True, seed=4, uneven=uneven)  # type: ignore[arg-type]
    first_epoch = list(sampler)
    sampler.set_epoch(1)
    return {
        "indices": pd.shard_indices(n, uneven=uneven).tolist(),  # type: ignore[arg-type]
        "tensor": pd.shard(torch.arange(n) * 10, uneven=uneven).tolist(),  # type: ignore[arg-type]
        "epoch0": first_epoch,
        "epoch1": list(sampler),
        "len": [len(sampler)],
    }


@pytest.mark.parametrize(("uneven", "per_worker"), [("drop", 3), ("pad", 4)])
def test_shards_have_equal_lengths_under_both_policies(uneven: str, per_worker: int) -> None:
    first, second = run_workers(shards, 7, uneven)
    for key in ("indices", "epoch0", "epoch1"):
        assert len(first[key]) == len(second[key]) == per_worker, key
    assert first["tensor"] == [10 * i for i in first["indices"]]
    assert first["len"] == [per_worker]
    for key in ("indices", "epoch0", "epoch1"):
        together = first[key] + second[key]
        if uneven == "drop":
            assert len(set(together)) == 6, "disjoint; one item left over"
        else:
            assert set(together) == set(range(7)), "every item, one repeated"
    assert first["epoch0"] != first["epoch1"], "set_epoch reshuffles"


def split_shard(n: int) -> list[int]:
    return pd.shard(torch.arange(n)).tolist()


def test_shard_splits_by_default_every_row_once() -> None:
    shares = run_workers(split_shard, 7, world_size=3)
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]


def test_shard_sampler_refuses_unequal_shards() -> None:
    with pytest.raises(ValueError, match="ShardSampler needs shards of equal length"):
        pd.ShardSampler(range(7), uneven="split")  # type: ignore[arg-type]


def test_shard_in_one_process_is_everything() -> None:
    assert pd.shard(torch.arange(5)).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="uneven must be 'split', 'drop' or 'pad'"):
        pd.shard_indices(5, uneven="wrap")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shard takes a tensor"):
        pd.shard([1, 2, 3])  # type: ignore[arg-type]
