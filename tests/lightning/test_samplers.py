"""Each worker's share of a loader, whatever sampler it came with (lightning/data.py).

Run on two real workers (gloo): :func:`shard_loader` reads the engine's rank
and world size, and a ``DistributedSampler`` its process group's.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import pyro_distributed as pd
from pyro_distributed.integrations.lightning.data import shard_loader

from ..support.harness import run_workers

ROWS = 50


def batches_as_sampler(shuffle: bool) -> DataLoader[Any]:
    """scvi-tools' default loader: a BatchSampler as the sampler, batch_size=None."""
    dataset = TensorDataset(torch.arange(ROWS))
    inner = RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
    return DataLoader(dataset, sampler=BatchSampler(inner, 8, False), batch_size=None)


def epochs_of_rows(stage: RunningStage) -> list[list[int]]:
    loader = shard_loader(
        batches_as_sampler(True), pd.current_engine(), stage, shuffle=True, seed=0, by_block=False
    )
    assert isinstance(loader, DataLoader)
    rows = []
    for epoch in range(2):
        if stage == RunningStage.TRAINING:  # as Lightning calls it; evaluation has no epochs
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        batches = [batch[0].tolist() for batch in loader]
        assert all(len(batch) <= 8 for batch in batches)
        rows.append([row for batch in batches for row in batch])
    return rows


def test_a_batch_sampler_as_the_sampler_is_split_into_disjoint_shares() -> None:
    shares = run_workers(epochs_of_rows, RunningStage.TRAINING, timeout=600)
    for epoch in range(2):
        first, second = (share[epoch] for share in shares)
        assert len(first) == len(second) == ROWS // 2
        assert not set(first) & set(second)
    assert shares[0][0] != shares[0][1]  # set_epoch reaches the share: a new order


def orders_by_default() -> dict[str, list[list[int]]]:
    """With ``shuffle=None`` (the strategy's default), each loader's rows over
    two epochs: a loader that shuffles and one that does not, plain and with a
    BatchSampler as its sampler."""
    dataset = TensorDataset(torch.arange(ROWS))
    loaders = {
        "plain, shuffled": DataLoader(dataset, batch_size=8, shuffle=True),
        "plain, in order": DataLoader(dataset, batch_size=8, shuffle=False),
        "batches, shuffled": batches_as_sampler(True),
        "batches, in order": batches_as_sampler(False),
    }
    orders = {}
    for name, loader in loaders.items():
        engine, stage = pd.current_engine(), RunningStage.TRAINING
        prepared = shard_loader(loader, engine, stage, shuffle=None, seed=0, by_block=False)
        assert isinstance(prepared, DataLoader)
        orders[name] = []
        for epoch in range(2):
            prepared.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            orders[name].append([row for batch in prepared for row in batch[0].tolist()])
    return orders


def test_the_loaders_own_choice_to_shuffle_is_kept_by_default() -> None:
    shares = run_workers(orders_by_default, timeout=600)
    for name in shares[0]:
        first, second = (share[name] for share in shares)
        assert sorted(first[0] + second[0]) == list(range(ROWS)), name  # disjoint, complete
        if "shuffled" in name:
            assert first[0] != first[1], name  # a new order each epoch
            assert first[0] != sorted(first[0]), name
        else:
            assert first[0] == first[1] == sorted(first[0]), name  # the data's order


def test_an_evaluation_loader_of_batches_gets_contiguous_blocks() -> None:
    shares = run_workers(epochs_of_rows, RunningStage.VALIDATING, timeout=600)
    assert [share[0] for share in shares] == [list(range(25)), list(range(25, 50))]


def unshardable(kind: str) -> str:
    dataset = TensorDataset(torch.arange(ROWS))
    engine = pd.current_engine()
    if kind == "weighted":
        loader = DataLoader(dataset, sampler=WeightedRandomSampler(torch.ones(ROWS), ROWS))
    else:
        loader = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=3, rank=1))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shard_loader(
                loader, engine, RunningStage.TRAINING, shuffle=True, seed=0, by_block=False
            )
    except pd.PyroDistributedError as error:
        return f"error: {error}"
    return " | ".join(f"{w.category.__name__}: {w.message}" for w in caught)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("weighted", "UnshardedLoaderWarning: PyroDistributedStrategy leaves the train loader's "
         "sampler WeightedRandomSampler alone"),
        ("foreign", "error: a loader's DistributedSampler splits the data for worker 1 of 3"),
    ],
)  # fmt: skip
def test_a_sampler_the_strategy_cannot_split_is_named(kind: str, expected: str) -> None:
    for outcome in run_workers(unshardable, kind, timeout=600):
        assert outcome.startswith(expected), outcome
