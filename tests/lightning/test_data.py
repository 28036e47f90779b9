"""IndexedDataset: each item's global index in front, at a cost that follows the batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pyro_distributed.integrations.lightning import IndexedDataset


def test_every_kind_of_index_gives_the_rows_it_selects() -> None:
    dataset = IndexedDataset(TensorDataset(torch.arange(10.0) * 2))
    index, value = dataset[3]
    assert index.item() == 3 and value.item() == 6.0
    index, value = dataset[-1]
    assert index.item() == 9 and value.item() == 18.0
    index, value = dataset[2:8:3]
    assert index.tolist() == [2, 5] and value.tolist() == [4.0, 10.0]
    index, value = dataset[torch.tensor([1, -2])]
    assert index.tolist() == [1, 8] and value.tolist() == [2.0, 16.0]
    mask = torch.arange(10) % 4 == 0
    index, value = dataset[mask]
    assert index.tolist() == [0, 4, 8] and value.tolist() == [0.0, 8.0, 16.0]


def test_an_index_out_of_range_is_refused() -> None:
    dataset = IndexedDataset(TensorDataset(torch.zeros(5)))
    with pytest.raises(IndexError):
        dataset[5]
    with pytest.raises(IndexError):
        dataset._global_indices(torch.tensor([0, 7]))


def test_a_loader_batch_carries_its_indices() -> None:
    dataset = IndexedDataset(TensorDataset(torch.arange(6.0)))
    (index, value), *_ = DataLoader(dataset, batch_size=4, sampler=[5, 0, 3, 3])
    assert index.tolist() == [5, 0, 3, 3] and value.tolist() == [5.0, 0.0, 3.0, 3.0]


def test_a_row_of_a_large_data_set_does_not_build_its_whole_index() -> None:
    # The loader asks for one row at a time: an index built over all N rows
    # per item made each batch of 256 rows cost O(256 N) (7 ms a row at
    # N = 10^6). At N = 2^62 such an index cannot even be allocated.
    size = 2**62
    dataset = IndexedDataset(TensorDataset(torch.zeros(size, 0)))
    index, _ = dataset[size - 1]
    assert index.item() == size - 1
    index, _ = dataset[torch.tensor([0, -1])]
    assert index.tolist() == [0, size - 1]
