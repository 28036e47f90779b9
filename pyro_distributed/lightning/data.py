"""Batches that carry their rows' global indices, and the samplers the strategy gives loaders.

A model whose data plate spans the whole data set needs each batch's place
in it: ``pyro.plate("data", N, subsample=indices)``. :class:`IndexedDataset`
puts the index in front of every item, so that a batch arrives as
``(indices, *tensors)``.

The training loader gets :class:`~pyro_distributed.ShardSampler` (every row
on one worker each epoch, or, with ``by_block=True``, the rows whose local
parameters this worker owns). Evaluation and prediction loaders get
:class:`EvaluationSampler`: contiguous blocks, each row exactly once, nothing
padded, in order, so that worker 0 can put predictions back in the data's
order. A loader whose sampler is already distributed is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from .. import runtime
from ..data.shards import ShardSampler
from ..partition import block_range
from ..seeding import derived_seed

__all__ = ["EvaluationSampler", "IndexedDataset", "is_plain_sampler", "with_own_generator"]

# Names the training loaders' generators among the derived seeds.
_LOADER_STREAM = 0x10AD


class IndexedDataset(Dataset[tuple[Any, ...]]):
    """``dataset`` with each item's index in front: ``(index, *item)``.

    Example::

        loader = DataLoader(IndexedDataset(TensorDataset(x, y)), batch_size=64)
        for indices, x, y in loader:
            with pyro.plate("data", len(dataset), subsample=indices): ...
    """

    def __init__(self, dataset: Dataset[Any]) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(
                f"IndexedDataset needs a map-style data set with a length, "
                f"got {type(dataset).__name__}"
            )
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> tuple[Any, ...]:
        """``(index, *item)``; a slice or a tensor of indices gives their indices."""
        item = self.dataset[index]
        rest = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        return (self._global_indices(index), *rest)

    def _global_indices(self, index: Any) -> Tensor:
        """The indices that ``index`` selects, in O(rows selected): the loader asks
        for one row at a time, so nothing here may cost O(len(dataset))."""
        # On the CPU, as the loader's own indices: it batches them with the rows.
        size = len(self)
        if isinstance(index, int):  # the loader's case; the data set checked the range
            return torch.tensor(index + size if index < 0 else index, device="cpu")  # cpu: an index
        if isinstance(index, slice):
            return torch.arange(*index.indices(size), device="cpu")  # cpu: indices
        selected = torch.as_tensor(index)  # device: the index's own, if it has one
        if selected.dtype == torch.bool:
            return selected.nonzero().flatten()
        if selected.numel() and not bool(((selected >= -size) & (selected < size)).all()):
            raise IndexError(f"IndexedDataset: index {index!r} is out of range for {size} rows")
        return torch.where(selected < 0, selected + size, selected)


class EvaluationSampler(Sampler[int]):
    """This worker's contiguous block of a data set, in order: each row once, on
    one worker. Blocks may differ by one row (nothing is padded or repeated)."""

    def __init__(self, dataset: Sized) -> None:
        self._length = len(dataset)

    def _rows(self) -> range:
        return block_range(self._length)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())


def is_plain_sampler(sampler: object) -> bool:
    """Whether ``sampler`` is one the strategy replaces: a plain random or
    sequential one. Distributed ones (``DistributedSampler``,
    :class:`~pyro_distributed.ShardSampler`, ours) and custom ones are left alone."""
    if isinstance(sampler, (DistributedSampler, ShardSampler, EvaluationSampler)):
        return False
    return type(sampler) in (RandomSampler, SequentialSampler)


def with_own_generator(loader: DataLoader[Any], seed: int) -> None:
    """Give ``loader`` a generator of its own if it has none, so that starting
    an iterator (which draws the base seed of its worker processes) never
    draws from the global RNG: a resumed run restores that RNG just before its
    first step, and the step then draws what the uninterrupted run's did."""
    if loader.generator is None:
        stream = derived_seed(seed, runtime.rank(), _LOADER_STREAM)
        loader.generator = torch.Generator().manual_seed(stream)
