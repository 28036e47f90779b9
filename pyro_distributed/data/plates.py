"""Data plates that know where their rows sit in the whole data set.

A plate over a shard must say how large the whole data set is and which rows
the worker holds, or it fits the posterior of the shard alone
(``pyro.plate("data", len(x_mine))`` on half the data: widths about sqrt(2)
too wide). This module records, for every tensor :func:`~pyro_distributed.shard`
(or the evaluation helpers) hand out, the global size and its rows' global
indices, and :class:`data_plate` turns that into the right plate. The record
is keyed by the tensor's identity and dropped when it is freed; a slice or
copy of a shard has none, so a plate over it is an ordinary plate.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyro
from torch import Tensor

from ..checks import check_int


@dataclass(frozen=True)
class RowOrigin:
    """Where a tensor's rows come from.

    :param size: how many rows the whole data set has.
    :param indices: the global index of each of this tensor's rows.
    :param scale: a factor on top of Pyro's ``size / len(indices)``. Shards of
        unequal length need it: averaging W workers' gradients weighs every
        worker alike, so each worker's sum over its rows must be scaled by W,
        not by ``size / len(indices)``.
    """

    size: int
    indices: Tensor
    scale: float = 1.0


_origins: dict[int, tuple[weakref.ref[Tensor], RowOrigin]] = {}


def record_origin(tensor: Tensor, origin: RowOrigin) -> Tensor:
    """Remember where ``tensor``'s rows come from (until it is freed); return it."""
    if len(origin.indices) != len(tensor):
        raise ValueError(f"{len(origin.indices)} global indices for a tensor of {len(tensor)} rows")
    key = id(tensor)
    _origins[key] = (weakref.ref(tensor, lambda _ref: _origins.pop(key, None)), origin)
    return tensor


def origin_of(tensor: Any) -> RowOrigin | None:
    """The recorded origin of ``tensor``'s rows, or ``None`` for any other tensor."""
    entry = _origins.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1]


def _live_origins() -> Iterator[tuple[int, RowOrigin]]:
    for ref, origin in list(_origins.values()):
        tensor = ref()
        if tensor is not None:
            yield len(tensor), origin


def shard_lengths() -> dict[int, int]:
    """Row counts of the live shards that are not the whole data set, mapped to
    the whole data set's size (for spotting plates sized by a shard)."""
    return {rows: origin.size for rows, origin in _live_origins() if rows != origin.size}


class data_plate(pyro.plate):
    """A ``pyro.plate`` over the rows of ``data``, sized by the whole data set.

    For a shard from :func:`pyro_distributed.shard`, this is
    ``pyro.plate(name, N, subsample=global_indices)``, with N the size of the
    whole data set, so that every worker's loss is an estimate of the whole
    data set's and the averaged gradient is the full-data gradient: the
    posterior is that of all N rows, exactly as in one process. Inside
    :func:`pyro_distributed.evaluate_loss` and :class:`pyro_distributed.Predictive`
    the batches they pass to the model are recorded the same way. For any
    other tensor it is simply ``pyro.plate(name, len(data))``, so the same
    model runs unchanged in one process on the whole data.

    Entering it returns the global indices of ``data``'s rows.

    :param name: the plate's name, as for ``pyro.plate``.
    :param data: the tensor whose rows the plate ranges over (along dim 0).
    :param dim: the plate's dimension, as for ``pyro.plate``.

    Example::

        x_mine = pd.shard(x)  # this worker's rows of all of x

        def model(x):
            loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
            with pd.data_plate("data", x):  # size len(x_full), not len(x_mine)
                pyro.sample("obs", dist.Normal(loc, 1.0), obs=x)

        svi.step(x_mine)

    .. warning::
        Pass the very tensor that ``pd.shard`` returned (in model and guide
        alike). A slice, copy or ``.to(...)`` of it is a new tensor with no
        record of where its rows came from, and gets a plate of its own length.
    """

    def __init__(self, name: str, data: Tensor, dim: int | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"data_plate: name must be a string, got {name!r}")
        check_int("data_plate: dim", dim, optional=True)
        if dim is not None and dim >= 0:
            # Pyro counts plate dimensions from the right.
            raise ValueError(f"data_plate: dim must be a negative int or None, got {dim!r}")
        if not isinstance(data, Tensor):
            raise TypeError(
                f"data_plate {name!r}: data must be a tensor, got {type(data).__name__}"
            )
        origin = origin_of(data)
        if origin is None:
            super().__init__(name, len(data), dim=dim)
            self._extra_scale = 1.0
        else:
            indices = origin.indices.to(data.device)
            super().__init__(name, origin.size, subsample=indices, dim=dim)
            self._extra_scale = origin.scale

    def _process_message(self, msg: Any) -> None:
        super()._process_message(msg)
        if self._extra_scale != 1.0:
            msg["scale"] = msg["scale"] * self._extra_scale
