"""Each worker's share of every loader the Trainer uses, and batches that carry their rows'
global indices.

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

:func:`shard_loader` is what :meth:`PyroDistributedStrategy.process_dataloader`
does with a loader. It gives the training loader
:class:`~pyro_distributed.ShardSampler` and evaluation and prediction loaders
:class:`EvaluationSampler`, in three cases:

* a plain random or sequential sampler: the loader is rebuilt with ours, as
  Lightning rebuilds loaders (:func:`internals.with_sampler`);
* a plain ``BatchSampler`` passed as the loader's ``sampler``, with
  ``batch_size=None`` (scvi-tools' ``AnnDataLoader`` does this, so that one
  ``__getitem__`` call reads a whole mini-batch of a sparse matrix): the
  batch sampler keeps its batch size and ``drop_last`` and draws its rows
  from our sampler instead of its random or sequential one. Each worker
  then makes its own batches from its own share of the rows, the way a
  plain loader's ``batch_size`` batches our sampler's rows. (Lightning's DDP
  deals whole batches of the original order out instead; either way each
  worker's batch has ``batch_size`` rows.)
* nothing to do: one worker, or a sampler that is already distributed over
  these workers (``DistributedSampler``, scvi-tools' ``BatchDistributedSampler``,
  ours). A ``DistributedSampler`` set up for another number of workers or
  another rank raises.

Any other sampler is left alone with a :class:`UnshardedLoaderWarning` that
names it: the strategy cannot tell whether it gives each worker its own
rows, and workers that read the same rows duplicate each other's work.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from ... import runtime
from ...data.shards import ShardSampler
from ...engines import Engine
from ...errors import PyroDistributedError
from ...partition import block_range
from ...seeding import derived_seed
from ..scvi import anndata
from . import internals

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
                f"IndexedDataset: dataset must be a map-style data set with a length, "
                f"got {dataset!r}"
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


# -- each loader's share: what the strategy's process_dataloader does


class UnshardedLoaderWarning(UserWarning):
    """A loader whose sampler the strategy could not give each worker's share to."""


def prepare_loader(
    dataloader: object,
    engine: Engine,
    stage: RunningStage | None,
    *,
    shuffle: bool | None,
    seed: int,
    own_local_params: bool,
    observations: int | None,
) -> object:
    """The loader the strategy hands Lightning: with ``own_local_params``,
    scvi-tools' loaders keep this worker's block
    (:func:`~pyro_distributed.integrations.scvi.anndata.owned_loader`); any
    other loader is sharded by :func:`shard_loader`. A training loader gets a
    generator of its own (:func:`.data.with_own_generator`), so that starting
    its iterator never draws from the global RNG."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    owned = own_local_params and stage != RunningStage.PREDICTING
    if owned and engine.world_size > 1 and anndata.is_batch_sampler_loader(dataloader):
        processed: Any = anndata.owned_loader(dataloader, engine, size=observations, seed=seed)
    else:
        processed = shard_loader(
            dataloader, engine, stage, shuffle=shuffle, seed=seed, by_block=own_local_params
        )
    if stage == RunningStage.TRAINING:
        with_own_generator(processed, seed)
    return processed


def shard_loader(
    loader: object,
    engine: Engine,
    stage: RunningStage | None,
    *,
    shuffle: bool | None,
    seed: int,
    by_block: bool,
) -> object:
    """``loader`` giving this worker its share of the rows (see the module's docstring).

    ``shuffle=None`` keeps the loader's own choice, as Lightning's DDP does: a
    new order each epoch if its sampler is a ``RandomSampler``, the data's
    order otherwise."""
    if not isinstance(loader, DataLoader) or engine.world_size == 1:
        return loader
    sampler = loader.sampler
    if is_plain_sampler(sampler):
        shuffle = _shuffles(sampler) if shuffle is None else shuffle
        share = _share(loader.dataset, stage, shuffle=shuffle, seed=seed, by_block=by_block)
        return internals.with_sampler(loader, share, stage)
    if _batches_rows(loader):
        assert isinstance(sampler, BatchSampler)
        inner = sampler.sampler
        if is_plain_sampler(inner):
            rows = getattr(inner, "data_source", loader.dataset)
            shuffle = _shuffles(inner) if shuffle is None else shuffle
            # The loader is the one the Trainer just asked for; its batch sampler
            # is changed in place, which keeps the loader's class and arguments.
            share = _share(rows, stage, shuffle=shuffle, seed=seed, by_block=by_block)
            sampler.sampler = share
            if isinstance(share, ShardSampler):
                # Lightning calls set_epoch on a loader's sampler, here the batch
                # sampler, which has none: without this every epoch has one order.
                setattr(sampler, "set_epoch", share.set_epoch)  # noqa: B010
            return loader
        sampler = inner
    if not _distributed(sampler, engine):
        warnings.warn(
            f"PyroDistributedStrategy leaves the {_stage_name(stage)} loader's sampler "
            f"{type(sampler).__name__} alone: it can split only a random or sequential "
            f"sampler (or a BatchSampler over one). Unless this sampler gives each worker "
            f"its own rows, every worker reads the same rows; use a DistributedSampler, "
            f"or a plain sampler that the strategy replaces",
            UnshardedLoaderWarning,
            stacklevel=2,
        )
    return loader


def _share(
    rows: Any, stage: RunningStage | None, *, shuffle: bool, seed: int, by_block: bool
) -> Sampler[int]:
    if not isinstance(rows, Sized):
        raise TypeError(
            f"PyroDistributedStrategy: the loader's data set ({type(rows).__name__}) has no "
            f"length, so it cannot be split between workers"
        )
    if stage == RunningStage.TRAINING:
        return ShardSampler(rows, shuffle=shuffle, seed=seed, by_block=by_block)
    return EvaluationSampler(rows)


def _shuffles(sampler: object) -> bool:
    """Whether a plain sampler gives a new order each epoch."""
    return isinstance(sampler, RandomSampler)


def _batches_rows(loader: DataLoader[Any]) -> bool:
    """Whether the loader's ``sampler`` is a plain ``BatchSampler`` that makes its batches."""
    return type(loader.sampler) is BatchSampler and loader.batch_size is None


def _distributed(sampler: object, engine: Engine) -> bool:
    """Whether ``sampler`` already gives each of these workers its share."""
    if isinstance(sampler, (ShardSampler, EvaluationSampler)):
        return True
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (engine.world_size, engine.rank):
            raise PyroDistributedError(
                f"a loader's {type(sampler).__name__} splits the data for worker "
                f"{sampler.rank} of {sampler.num_replicas}, but this is worker "
                f"{engine.rank} of {engine.world_size}; build it on this process group "
                f"(or give the loader a plain sampler, which the strategy splits)"
            )
        return True
    return False


def _stage_name(stage: RunningStage | None) -> str:
    return stage.value if stage is not None else "a"
