"""Each worker's share of a data set: indices, tensors, and a DataLoader sampler.

Shards are strided (worker r takes positions r, r + W, ...) over one order
shared by all workers. The ``n % W`` items left over are ``"split"`` (the
first workers get one more: the default of :func:`shard`, whose shard is
used whole and whose plate :func:`~pyro_distributed.data_plate` scales),
``"drop"``-ped (different ones each epoch when shuffled) or ``"pad"``-ded
(the first few of the order repeated). Mini-batch loops need every worker to
take the same number of steps an epoch, so :class:`ShardSampler` and
:func:`shard_indices` default to ``"drop"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Literal, TypeVar

import torch
from torch import Tensor
from torch.utils.data import Sampler, TensorDataset

from .. import runtime
from ..checks import check_bool, check_choice, check_int
from ..partition import block_range
from ..seeding import derived_seed
from .plates import RowOrigin, record_origin

Uneven = Literal["split", "drop", "pad"]
T = TypeVar("T")
#: A data set whose rows are split across workers: a tensor, a tuple of
#: tensors of equal length, or a ``TensorDataset``.
Data = Tensor | tuple[Tensor, ...] | list[Tensor] | TensorDataset


def shard_indices(
    n: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0, uneven: Uneven = "drop"
) -> Tensor:
    """This worker's indices into ``range(n)``.

    :param shuffle: take the order from a permutation of ``range(n)`` seeded
        by ``(seed, epoch)`` (ints), the same on every worker.
    :param uneven: ``"drop"`` (default: leave out the ``n % W`` items left
        over), ``"pad"`` (repeat a few, so that every item is used) or
        ``"split"`` (the first ``n % W`` workers get one more).

    Example::

        indices = pd.shard_indices(len(x), shuffle=True, seed=0, epoch=epoch)
        for batch in indices.split(64):
            # the model's plate: pyro.plate("data", len(x), subsample=batch)
            svi.step(batch, x[batch], y[batch])
    """
    check_int("n", n, minimum=0)
    check_bool("shuffle", shuffle)
    check_int("seed", seed)
    check_int("epoch", epoch)
    check_choice("uneven", uneven, ("split", "drop", "pad"))
    workers, rank = runtime.world_size(), runtime.rank()
    if shuffle:
        # torch takes a seed of 64 bits, and reads a negative one modulo
        # 2**64: wrapping the mix the same way keeps every order that fitted,
        # and gives large seeds and epochs one too.
        mixed = (seed * 1_000_003 + epoch) % 2**64
        generator = torch.Generator().manual_seed(mixed)
        # cpu: the CPU generator's order
        order = torch.randperm(n, generator=generator, device="cpu")
    else:
        # cpu: indices, moved to the data's device where they index it
        order = torch.arange(n, device="cpu")
    if uneven == "drop":
        order = order[: n - n % workers]
    elif uneven == "pad":
        if n == 0 and workers > 1:
            raise ValueError("cannot pad an empty data set")
        padding = -n % workers
        order = torch.cat([order, order.repeat(padding // max(n, 1) + 1)[:padding]])
    return order[rank::workers]


def shard(data: Tensor, *, uneven: Uneven = "split") -> Tensor:
    """This worker's rows of ``data`` (a strided share along dim 0).

    The shard remembers the size of ``data`` and where its rows sit in it, so
    that :func:`~pyro_distributed.data_plate` gives the posterior of all of
    ``data``. By default (``uneven="split"``) every row lands on exactly one
    worker, even when ``len(data)`` does not divide by the number of workers.

    Example::

        x_mine, y_mine = pd.shard(x), pd.shard(y)

        def model(x, y):
            w = pyro.sample("w", dist.Normal(0.0, 1.0))
            with pd.data_plate("data", x):  # the size of x, not of x_mine
                pyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

        svi.step(x_mine, y_mine)

    .. warning::
        ``pyro.plate("data", len(x_mine))`` is the posterior of this worker's
        rows only: its widths come out about sqrt(W) too wide. Use
        :func:`~pyro_distributed.data_plate`, or ``pyro.plate("data", len(x),
        subsample=pd.shard_indices(len(x)))``.
    """
    if not isinstance(data, Tensor):
        raise TypeError(f"shard: data must be a tensor, got {type(data).__name__}")
    if data.dim() == 0:
        raise ValueError(
            f"shard: data must have at least one dimension to shard along (its rows "
            f"are split along dim 0), got a 0-d tensor: {data!r:.60}"
        )
    indices = shard_indices(len(data), uneven=uneven)
    # With shards of unequal length, Pyro's len(data) / len(shard) scaling
    # would weigh the workers' rows unequally once gradients are averaged;
    # W makes each worker's sum count once.
    split = uneven == "split" and len(data) > 0
    scale = runtime.world_size() * len(indices) / len(data) if split else 1.0
    return record_origin(data[indices.to(data.device)], RowOrigin(len(data), indices, scale))


def data_columns(data: Data, what: str) -> tuple[Tensor, ...]:
    """``data`` as a tuple of tensors of equal length along dim 0 (``what`` names
    the caller in errors)."""
    if isinstance(data, TensorDataset):
        columns = tuple(data.tensors)
    elif isinstance(data, Tensor):
        columns = (data,)
    elif isinstance(data, (tuple, list)):
        columns = tuple(data)
    else:
        raise TypeError(
            f"{what}: data must be a tensor, a tuple of tensors or a TensorDataset, "
            f"got {type(data).__name__}"
        )
    if not columns:
        raise ValueError(f"{what}: data holds no tensors")
    for position, column in enumerate(columns):
        if not isinstance(column, Tensor) or column.dim() == 0:
            raise TypeError(
                f"{what}: data[{position}] must be a tensor with at least one dimension, "
                f"got {column!r:.60}"
            )
    lengths = [len(column) for column in columns]
    if len(set(lengths)) > 1:
        raise ValueError(f"{what}: the tensors of data have different lengths {lengths}")
    return columns


def block_batches(
    columns: tuple[Tensor, ...], batch_size: int | None
) -> Iterator[tuple[tuple[Tensor, ...], range]]:
    """This worker's :func:`block_range` of the rows, in batches of ``batch_size``
    (``None``: one batch). Each batch remembers its global size and indices, for
    :func:`~pyro_distributed.data_plate`; yields the batch and its global rows."""
    size = len(columns[0])
    block = block_range(size)
    step = batch_size or max(len(block), 1)
    for start in range(block.start, block.stop, step):
        rows = range(start, min(start + step, block.stop))
        # cpu: data_plate moves a RowOrigin's indices to the data's device.
        origin = RowOrigin(size, torch.arange(rows.start, rows.stop, device="cpu"))
        yield tuple(record_origin(c[rows.start : rows.stop], origin) for c in columns), rows


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

    With ``by_block=True`` each worker keeps the same contiguous block of the
    data set for the whole run (:func:`block_range`, the rows whose local
    parameters it owns under ``shard_subsamples(own_local_params=True)``) and
    only the order inside the block changes each epoch. Blocks may differ by
    one item; ``uneven`` then drops the last item of the longer blocks, or
    pads the shorter ones with their first, so all have the same length.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        shuffle: bool = True,
        seed: int = 0,
        uneven: Uneven = "drop",
        by_block: bool = False,
    ) -> None:
        if uneven == "split":
            raise ValueError(
                "ShardSampler needs shards of equal length (every worker takes the same "
                "number of steps per epoch): use uneven='drop' or 'pad', not 'split'"
            )
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                f"ShardSampler: dataset must have a length (a map-style dataset), "
                f"got {type(dataset).__name__}"
            )
        check_bool("shuffle", shuffle)
        check_bool("by_block", by_block)
        # A block's order is seeded by a derived seed, which takes no negatives.
        if by_block:
            check_int("ShardSampler(by_block=True): seed", seed, minimum=0)
        else:
            check_int("seed", seed)
        self._length = len(dataset)
        self.shuffle, self.seed, self.uneven, self.epoch = shuffle, seed, uneven, 0
        self.by_block = by_block
        shard_indices(self._length, uneven=uneven)  # check the arguments now

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shared order; call it with the same epoch on every worker."""
        if self.by_block:
            check_int("ShardSampler(by_block=True): epoch", epoch, minimum=0)
        else:
            check_int("epoch", epoch)
        self.epoch = epoch

    def _indices(self) -> Tensor:
        if self.by_block:
            return self._block_indices()
        return shard_indices(
            self._length, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch, uneven=self.uneven
        )

    def _block_indices(self) -> Tensor:
        block = block_range(self._length)
        order = torch.arange(block.start, block.stop, device="cpu")  # cpu: a sampler's indices
        if self.shuffle:
            stream = derived_seed(self.seed, self.epoch, runtime.rank())
            generator = torch.Generator().manual_seed(stream)
            # cpu: as order
            order = order[torch.randperm(len(order), generator=generator, device="cpu")]
        length = len(self)
        if len(order) >= length:
            return order[:length]
        return torch.cat([order, order[: length - len(order)]])

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
    if not isinstance(batches, Iterable):
        raise TypeError(f"even_batches: batches must be iterable, got {type(batches).__name__}")
    engine = runtime.current_engine()
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
            missing = 0
        except StopIteration:
            missing = 1
        # cpu: a Python flag, read back
        flag = torch.tensor([missing], dtype=torch.int64, device="cpu")
        engine.allreduce_([flag], op="max")
        if flag.item():
            return
        yield batch
