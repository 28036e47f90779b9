"""scvi-tools' data loading with owned spots: each worker loads and steps its block only.

With ``own_local_params=True`` worker r owns rows ``block_range(N)`` of every
per-observation parameter (:mod:`pyro_distributed.local`), so it must see
only those observations, and should load only them. scvi-tools builds its
loaders itself, inside ``model.train()``:

* a data splitter (``DataSplitter``, or ``DeviceBackedDataSplitter`` for
  ``batch_size=None``, cell2location's default full-batch training), a
  LightningDataModule whose ``setup()`` picks the train/validation/test
  indices and, device-backed, copies those rows of the AnnData into tensors;
* loaders that pass a ``BatchSampler`` as the DataLoader's *sampler* (with
  ``batch_size=None``), so that one ``__getitem__`` reads a whole batch.

:func:`split_by_the_strategy` turns scvi-tools' own ``distributed_sampler``
off where it would split a worker's share again, and
:func:`take_over_splitter` makes the splitter keep this worker's block of
each of its sets: the split is computed as scvi-tools computes it (the same
indices on every worker), then cut to the block and handed back through the
splitter's own ``external_indexing``, so a device-backed splitter copies
N/W rows, not N. :func:`owned_loader` then gives each such loader an
:class:`OwnedBatchSampler`: this worker's rows (those of its block that the
loader holds, found from the loader's global indices), in as many batches
as every other worker has, so that every worker takes the same number of
steps. A full batch stays one batch of all the worker's rows.

The splitter's and loaders' global indices come from scvi-tools' public
attributes (``external_indexing``, ``train_idx``, ``AnnDataLoader.indices``)
and from the ``"ind_x"`` field that models registering the observation index
(cell2location does) put in every batch.
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from ... import runtime
from ...engines import Engine
from ...errors import PyroDistributedError
from ...partition import block_range
from ...seeding import derived_seed
from . import internals

# The splitters already taken over, and their number of observations: kept here,
# not written onto the user's data module.
_TAKEN_OVER: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

# scvi-tools' REGISTRY_KEYS.INDICES_KEY: the observation's index, in every batch.
_INDICES_KEY = "ind_x"


def _splitter_class(name: str = "DataSplitter") -> Any:
    """scvi-tools' ``DataSplitter`` (or another of its data modules), if scvi-tools
    is already imported (never imported here)."""
    if "scvi" not in sys.modules:
        return None
    return getattr(importlib.import_module("scvi.dataloaders"), name)


def split_by_the_strategy(datamodule: Any, *, own_local_params: bool) -> None:
    """Turn scvi-tools' ``distributed_sampler=True`` off where the strategy splits
    the data itself, and it would split this worker's share a second time:

    * in a device-backed splitter (``batch_size=None``), whose one loading
      batch would hold this worker's share only, of which the strategy's
      sampler would then give it a part;
    * with ``own_local_params``, where the worker's block would be shared out
      again, leaving rows that no worker trains.

    Elsewhere (a ``DataSplitter``'s loaders, without ownership) the sampler
    already gives each worker its share, and the strategy leaves it alone.
    """
    splitter = _splitter_class()
    if splitter is None or not isinstance(datamodule, splitter):
        return
    device_backed = isinstance(datamodule, _splitter_class("DeviceBackedDataSplitter"))
    if (own_local_params or device_backed) and internals.takes_distributed_sampler(datamodule):
        internals.drop_distributed_sampler(datamodule)


def take_over_splitter(datamodule: Any) -> int | None:
    """Make an scvi-tools data splitter keep this worker's block of observations.

    Its ``setup()`` is wrapped (on this instance only): the split is made as
    scvi-tools makes it, then each of the train, validation and test sets is
    cut to ``block_range(n_obs)`` and given back as ``external_indexing``.
    Returns the number of observations (the plate's size), or ``None`` if
    ``datamodule`` is no such splitter.

    :raises PyroDistributedError: for another scvi-tools data module (a
        semi-supervised splitter, say), whose sets this cannot cut.
    """
    splitter = _splitter_class()
    if splitter is None or datamodule is None:
        return None
    if datamodule in _TAKEN_OVER:
        return _TAKEN_OVER[datamodule]
    n_obs = int(datamodule.adata_manager.adata.n_obs) if hasattr(datamodule, "adata_manager") else 0
    if not isinstance(datamodule, splitter):
        if type(datamodule).__module__.startswith("scvi."):
            raise PyroDistributedError(
                f"PyroDistributedStrategy(own_local_params=True) keeps each worker to its block "
                f"of observations by cutting scvi-tools' DataSplitter, but this model trains "
                f"with {type(datamodule).__name__}; train it without own_local_params"
            )
        return None
    own_setup = datamodule.setup

    def setup(stage: str | None = None) -> None:
        if datamodule.external_indexing is None:
            splitter.setup(datamodule, stage)  # the indices alone, as scvi-tools splits them
            split = [datamodule.train_idx, datamodule.val_idx, datamodule.test_idx]
        else:
            split = list(datamodule.external_indexing)
        block = block_range(n_obs)
        datamodule.external_indexing = [_in_block(np.asarray(part), block) for part in split]
        own_setup(stage)

    datamodule.setup = setup
    _TAKEN_OVER[datamodule] = n_obs
    return n_obs


def _in_block(indices: np.ndarray, block: range) -> np.ndarray:
    return indices[(indices >= block.start) & (indices < block.stop)]


class OwnedBatchSampler(Sampler[list[int]]):
    """Batches of this worker's positions in a loader's data set, ``steps`` per epoch.

    Each epoch the positions are shuffled (a stream of their own per worker
    and epoch: :meth:`set_epoch`) or kept in order, and split into ``steps``
    batches whose sizes differ by at most one: every position is used once per
    epoch, and every worker takes the same number of steps.

    Example::

        sampler = OwnedBatchSampler([0, 1, 2, 3, 4], steps=2, shuffle=False)
        list(sampler)  # [[0, 1, 2], [3, 4]]
    """

    def __init__(
        self, positions: list[int], *, steps: int, shuffle: bool = True, seed: int = 0
    ) -> None:
        if steps < 1 or steps > max(len(positions), 1):
            raise ValueError(f"OwnedBatchSampler: steps={steps} for {len(positions)} positions")
        # cpu: a sampler's positions are host-side indices into the data set.
        self.positions = torch.as_tensor(positions, dtype=torch.int64, device="cpu")
        self.steps, self.shuffle, self.seed, self.epoch = steps, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Reseed the order; Lightning calls it at every epoch's start."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = self.positions
        if self.shuffle:
            stream = derived_seed(self.seed, self.epoch, runtime.rank())
            generator = torch.Generator().manual_seed(stream)
            # cpu: drawn with a CPU generator, to index host-side positions.
            order = order[torch.randperm(len(order), generator=generator, device="cpu")]
        for part in torch.tensor_split(order, self.steps):
            yield part.tolist()

    def __len__(self) -> int:
        return self.steps


def is_batch_sampler_loader(loader: object) -> bool:
    """Whether ``loader`` is scvi-tools' kind: a ``BatchSampler`` passed as its
    sampler, automatic batching off."""
    return (
        isinstance(loader, DataLoader)
        and loader.batch_size is None
        and isinstance(loader.sampler, BatchSampler)
    )


def owned_loader(
    loader: DataLoader[Any], engine: Engine, *, size: int | None, seed: int
) -> DataLoader[Any]:
    """``loader`` (scvi-tools' kind) over this worker's rows only, in as many
    batches as every other worker's (a collective: every worker calls it for
    the same loader). ``size`` is the number of observations (the plate's
    size); ``None`` takes it from the loader's AnnData.

    :raises PyroDistributedError: when the loader's global indices cannot be
        found, or a worker holds none of its rows.
    """
    batches: BatchSampler = loader.sampler  # type: ignore[assignment]
    rows = _global_rows(loader)
    block = block_range(size if size is not None else _observations(loader))
    positions = np.flatnonzero((rows >= block.start) & (rows < block.stop)).tolist()
    counts = engine.allgather_object(len(positions))
    if min(counts) == 0:
        raise PyroDistributedError(
            f"PyroDistributedStrategy(own_local_params=True): worker(s) "
            f"{[rank for rank, count in enumerate(counts) if count == 0]} hold none of this "
            f"loader's observations ({counts} per worker); use fewer workers or more data"
        )
    steps = min(_steps(count, batches.batch_size, batches.drop_last) for count in counts)
    sampler = OwnedBatchSampler(
        positions, steps=steps, shuffle=isinstance(batches.sampler, RandomSampler), seed=seed
    )
    return DataLoader(
        loader.dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
    )


def _steps(count: int, batch_size: int, drop_last: bool) -> int:
    return max(count // batch_size if drop_last else -(-count // batch_size), 1)


def _observations(loader: DataLoader[Any]) -> int:
    """The number of observations of the AnnData behind an ``AnnDataLoader``."""
    manager = getattr(loader.dataset, "adata_manager", None)
    if manager is None:
        raise PyroDistributedError(
            f"PyroDistributedStrategy(own_local_params=True) cannot tell how many "
            f"observations the data behind a loader over {type(loader.dataset).__name__} has; "
            f"train through scvi-tools' DataSplitter (model.train) or an AnnDataLoader"
        )
    return int(manager.adata.n_obs)


def _global_rows(loader: DataLoader[Any]) -> np.ndarray:
    """The observation index of each position of the loader's data set."""
    indices = getattr(loader, "indices", None)  # scvi-tools' AnnDataLoader
    if indices is not None:
        return np.asarray(indices, dtype=np.int64)
    data = getattr(loader.dataset, "data", None)  # a device-backed splitter's data set
    if isinstance(data, dict) and _INDICES_KEY in data:
        indices = torch.as_tensor(data[_INDICES_KEY])  # device: its own; read on the host next
        return np.asarray(indices.cpu().flatten(), dtype=np.int64)
    raise PyroDistributedError(
        f"PyroDistributedStrategy(own_local_params=True) cannot tell which observations a "
        f"loader over {type(loader.dataset).__name__} holds; register the observation index "
        f"in the model's setup_anndata (cell2location's '_indices' field) or use an "
        f"AnnDataLoader"
    )
