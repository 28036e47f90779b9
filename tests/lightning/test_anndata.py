"""OwnedBatchSampler: this worker's rows, every one once an epoch, in an agreed number of batches.

The loaders of scvi-tools that it replaces are exercised with real
scvi-tools and cell2location in tests/integrations/test_cell2location_owned.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from pyro_distributed.integrations.scvi.anndata import OwnedBatchSampler, is_batch_sampler_loader


def test_every_position_once_an_epoch_in_the_agreed_number_of_batches() -> None:
    positions = list(range(10, 161))  # 151 rows of a block
    sampler = OwnedBatchSampler(positions, steps=4, shuffle=True, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 4
    assert sorted(row for batch in batches for row in batch) == positions
    assert {len(batch) for batch in batches} <= {37, 38}


def test_the_order_changes_with_the_epoch_and_repeats_for_the_same_epoch() -> None:
    sampler = OwnedBatchSampler(list(range(50)), steps=2, shuffle=True, seed=0)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_in_order_without_shuffling() -> None:
    sampler = OwnedBatchSampler([0, 1, 2, 3, 4], steps=2, shuffle=False)
    assert list(sampler) == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("steps", [0, 6])
def test_more_batches_than_rows_or_none_is_refused(steps: int) -> None:
    with pytest.raises(ValueError, match=f"steps={steps} for 5 positions"):
        OwnedBatchSampler([0, 1, 2, 3, 4], steps=steps)


def test_scvi_tools_kind_of_loader_is_recognised() -> None:
    dataset = TensorDataset(torch.arange(10.0))
    batches = BatchSampler(RandomSampler(dataset), batch_size=4, drop_last=False)
    assert is_batch_sampler_loader(DataLoader(dataset, sampler=batches, batch_size=None))
    assert not is_batch_sampler_loader(DataLoader(dataset, batch_size=4))
