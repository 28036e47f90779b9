"""Data sharding: shard, shard_indices, ShardSampler and even_batches, on real workers."""

from __future__ import annotations

import pytest
import torch

import pyro_distributed as pd

from ..support.harness import run_workers

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
    with pytest.raises(TypeError, match="shard: data must be a tensor"):
        pd.shard([1, 2, 3])  # type: ignore[arg-type]


def test_a_tensor_without_a_first_dimension_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="data must have at least one dimension to shard along"):
        pd.shard(torch.tensor(1.0))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"seed": 1.5}, "seed must be an int"),
        ({"seed": True}, "seed must be an int"),
        ({"epoch": "1"}, "epoch must be an int"),
        ({"shuffle": 1}, "shuffle must be True or False"),
    ],
)
def test_shard_indices_names_arguments_of_the_wrong_type(
    arguments: dict[str, object], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        pd.shard_indices(5, **arguments)  # type: ignore[arg-type]


def test_shuffled_order_takes_seeds_past_64_bits_and_keeps_the_orders_that_fitted() -> None:
    large = pd.shard_indices(6, shuffle=True, seed=2**70, epoch=2**64)
    assert sorted(large.tolist()) == list(range(6))
    # torch reads a seed modulo 2**64: seeds that fitted give the order they gave.
    fitted = torch.randperm(6, generator=torch.Generator().manual_seed(-5 * 1_000_003 + 3))
    assert pd.shard_indices(6, shuffle=True, seed=-5, epoch=3).tolist() == fitted.tolist()


def test_shard_sampler_names_bad_seeds_and_epochs() -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        pd.ShardSampler(range(5), seed=0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shuffle must be True or False"):
        pd.ShardSampler(range(5), shuffle="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"by_block=True\): seed must be a non-negative int"):
        pd.ShardSampler(range(5), seed=-1, by_block=True)
    sampler = pd.ShardSampler(range(5), by_block=True)
    with pytest.raises(ValueError, match=r"by_block=True\): epoch must be a non-negative int"):
        sampler.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch must be an int"):
        pd.ShardSampler(range(5)).set_epoch(1.0)  # type: ignore[arg-type]
