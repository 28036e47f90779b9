"""Each worker's share of a data set: indices, tensors, and a DataLoader sampler.

Every worker must take the same number of steps per epoch, so shards always
have equal lengths. With n items on W workers, ``uneven="drop"`` (default)
gives each worker n // W items and leaves out the n % W left over (with
shuffling, different ones each epoch, so nothing is left out for good);
``uneven="pad"`` gives each worker ceil(n / W) items, repeating the first few
of the order to fill the last shards. Shards are strided (worker r takes
positions r, r + W, ...) over one order shared by all workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Literal, TypeVar

import torch
from torch import Tensor
from torch.utils.data import Sampler

from . import runtime

__all__ = ["ShardSampler", "even_batches", "shard", "shard_indices"]

Uneven = Literal["drop", "pad"]
T = TypeVar("T")


def shard_indices(
    n: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0, uneven: Uneven = "drop"
) -> Tensor:
    """This worker's indices into ``range(n)``.

    :param shuffle: take the order from a permutation of ``range(n)`` seeded
        by ``(seed, epoch)``, the same on every worker.
    :param uneven: ``"drop"`` or ``"pad"``; see the module documentation.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if uneven not in ("drop", "pad"):
        raise ValueError(f"uneven must be 'drop' or 'pad', got {uneven!r}")
    workers, rank = runtime.world_size(), runtime.rank()
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=generator)
    else:
        order = torch.arange(n)
    if uneven == "drop":
        order = order[: n - n % workers]
    else:
        if n == 0 and workers > 1:
            raise ValueError("cannot pad an empty data set")
        padding = -n % workers
        order = torch.cat([order, order.repeat(padding // max(n, 1) + 1)[:padding]])
    return order[rank::workers]


def shard(data: Tensor, *, uneven: Uneven = "drop") -> Tensor:
    """This worker's rows of ``data`` (a strided, equal-length share along dim 0).

    Example::

        x_mine, y_mine = pd.shard(x), pd.shard(y)
    """
    if not isinstance(data, Tensor):
        raise TypeError(f"shard takes a tensor, got {type(data).__name__}")
    return data[shard_indices(len(data), uneven=uneven)]


class ShardSampler(Sampler[int]):
    """A DataLoader sampler that yields this worker's share of a map-style data set.

    It replaces ``torch.utils.data.DistributedSampler`` with no set-up: rank
    and world size come from the running engine.

    Example::

        sampler = pd.ShardSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=64, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)   # a new shared order each epoch
            for batch in loader:
                svi.step(batch)
    """

    def __init__(
        self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, uneven: Uneven = "drop"
    ) -> None:
        self._length = len(dataset)
        self.shuffle, self.seed, self.uneven, self.epoch = shuffle, seed, uneven, 0
        shard_indices(self._length, uneven=uneven)  # check the arguments now

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shared order; call it with the same epoch on every worker."""
        self.epoch = epoch

    def _indices(self) -> Tensor:
        return shard_indices(
            self._length, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch, uneven=self.uneven
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices().tolist())

    def __len__(self) -> int:
        workers = runtime.world_size()
        if self.uneven == "drop":
            return self._length // workers
        return -(-self._length // workers)


def even_batches(batches: Iterable[T]) -> Iterator[T]:
    """Yield batches while every worker still has one; end the epoch together.

    Shards of unequal length would leave the workers with more batches
    waiting in their next step for workers that have finished. Wrapped in
    ``even_batches``, the loop stops on every worker as soon as any worker
    runs out, at the cost of one tiny collective per batch.

    Example::

        for batch in pd.even_batches(loader):
            svi.step(batch)

    .. warning::
        Every worker must wrap its loop the same way: the check is a collective.
    """
    engine = runtime.current_engine()
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
            missing = 0
        except StopIteration:
            missing = 1
        flag = torch.tensor([missing], dtype=torch.int64)
        engine.allreduce_([flag], op="max")
        if flag.item():
            return
        yield batch
