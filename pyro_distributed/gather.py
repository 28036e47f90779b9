"""Assembling per-worker pieces of named tensors into whole tensors, streamed.

:func:`gather_pieces` puts each worker's piece of every result (its share of
the samples, or of the data points) together in rank order, on worker 0 or
on every worker. It streams: the shapes travel first, in one small object
all-gather, so receivers allocate the result once; then each worker
broadcasts its piece in turn and receivers copy it into place, holding the
result plus one piece, never every piece. (Engines offer broadcasts, not
sends, so every piece reaches every worker: bandwidth, not memory.)
:func:`stream_pieces` leaves the joining to a :class:`PieceSink`, so a writer
can put each piece in a file and never hold the whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, Protocol

import torch
from torch import Tensor

from .consensus import ABSENT, describe_split, first_disagreement
from .digest import digest
from .engines import Engine
from .errors import PyroDistributedError

Destination = Literal["main", "all"]
#: What each worker says of a piece before it travels: shape, dtype, and a
#: digest of the values for results that must be identical everywhere.
_Spec = tuple[tuple[int, ...], torch.dtype, str | None]


def _spec(piece: Tensor, shared: bool) -> _Spec:
    return tuple(piece.shape), piece.dtype, digest(piece) if shared else None


def gather_pieces(
    engine: Engine,
    pieces: Mapping[str, Tensor],
    axes: Mapping[str, int | None],
    to: Destination = "main",
) -> dict[str, Tensor] | None:
    """Join every worker's ``pieces`` by name, in rank order.

    :param pieces: this worker's piece of each named result.
    :param axes: for each name, the axis along which pieces join, or ``None``
        for a result that every worker holds whole and identical (checked by
        digest; each worker keeps its own copy).
    :param to: ``"main"``: worker 0 returns the results, others ``None``;
        ``"all"``: every worker returns them.
    :raises PyroDistributedError: on every worker, if workers hold different
        names, shapes that do not fit together, or differing shared results.
    """
    keep = to == "all" or engine.rank == 0
    joined = _Joined(pieces) if keep else None
    stream_pieces(engine, pieces, axes, joined)
    return joined.results if joined is not None else None


class PieceSink(Protocol):
    """Where :func:`stream_pieces` puts the pieces it receives."""

    def start(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, axis: int) -> None:
        """A joined result of this whole ``shape`` is about to arrive, piece by piece."""

    def put(self, name: str, offset: int, piece: Tensor) -> None:
        """``piece`` belongs at ``offset`` along the result's axis. It is
        reused for the next piece: copy what you keep."""

    def shared(self, name: str, value: Tensor) -> None:
        """A result every worker holds whole and identical (this worker's copy)."""


def stream_pieces(
    engine: Engine,
    pieces: Mapping[str, Tensor],
    axes: Mapping[str, int | None],
    sink: PieceSink | None,
) -> None:
    """Hand every worker's piece of each named result to ``sink``, in rank
    order, one piece at a time (:func:`gather_pieces` without the joining).

    A collective: every worker calls it with the same names; workers that
    keep nothing pass ``sink=None`` and only send their own pieces. Raises
    as :func:`gather_pieces` does, on every worker, before any piece travels.
    """
    names = sorted(pieces)
    specs: list[dict[str, _Spec]] = engine.allgather_object(
        {name: _spec(pieces[name], axes[name] is None) for name in names}
    )
    _check_same_names(specs)
    for name in names:
        shapes = [spec[name][0] for spec in specs]
        axis = axes[name]
        if axis is None:
            # Every worker holds it, and the digests prove the copies equal:
            # nothing needs to travel.
            _check_shared(name, [spec[name][2] for spec in specs])
            if sink is not None:
                sink.shared(name, pieces[name])
            continue
        _check_fit(name, shapes, axis)
    for name in names:
        axis = axes[name]
        if axis is None:
            continue
        shapes = [spec[name][0] for spec in specs]
        dtype = specs[0][name][1]
        if sink is not None:
            sink.start(name, _joined_shape(shapes, axis), dtype, axis)
        device = pieces[name].device  # every worker's piece lives where its own does
        offset = 0
        for src, shape in enumerate(shapes):
            length = shape[axis]
            if math.prod(shape):
                piece = (
                    pieces[name].detach().contiguous()
                    if src == engine.rank
                    else torch.empty(shape, dtype=dtype, device=device)
                )
                _broadcast(engine, piece, src)
                if sink is not None:
                    sink.put(name, offset, piece)
            offset += length


class _Joined:
    """A sink that joins the pieces into whole tensors in memory."""

    def __init__(self, pieces: Mapping[str, Tensor]) -> None:
        self._pieces = pieces
        self._axes: dict[str, int] = {}
        self.results: dict[str, Tensor] = {}

    def start(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, axis: int) -> None:
        device = self._pieces[name].device
        self.results[name] = torch.empty(shape, dtype=dtype, device=device)
        self._axes[name] = axis

    def put(self, name: str, offset: int, piece: Tensor) -> None:
        axis = self._axes[name]
        self.results[name].narrow(axis, offset, piece.shape[axis]).copy_(piece)

    def shared(self, name: str, value: Tensor) -> None:
        self.results[name] = value.detach().clone()


def _broadcast(engine: Engine, tensor: Tensor, src: int) -> None:
    # gloo has no bool; a byte per element travels the same values.
    wire = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
    engine.broadcast_([wire], src=src)


def _check_same_names(specs: list[dict[str, _Spec]]) -> None:
    found = first_disagreement(
        [{name: str(spec[1]) for name, spec in view.items()} for view in specs]
    )
    if found is not None:
        name, dtypes = found
        raise PyroDistributedError(
            f"workers disagree on the result {name!r} to gather ("
            + describe_split(dtypes, lambda d: "no such result" if d is ABSENT else d)
            + ")"
        )


def _check_shared(name: str, digests: list[str | None]) -> None:
    if len(set(digests)) > 1:
        raise PyroDistributedError(
            f"{name!r} should be identical on every worker but differs ("
            + describe_split(digests, lambda d: f"digest {d}")
            + ")"
        )


def _check_fit(name: str, shapes: list[tuple[int, ...]], axis: int) -> None:
    first = shapes[0]
    if not first:
        raise PyroDistributedError(f"{name!r} is a scalar on worker 0; it cannot be joined")
    position = axis % len(first)
    for rank, shape in enumerate(shapes):
        if len(shape) != len(first) or any(
            a != b for dim, (a, b) in enumerate(zip(shape, first, strict=True)) if dim != position
        ):
            raise PyroDistributedError(
                f"the pieces of {name!r} do not fit together along axis {axis}: "
                f"shape {first} on worker 0, {shape} on worker {rank}"
            )


def _joined_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    position = axis % len(shapes[0])
    return tuple(
        sum(shape[position] for shape in shapes) if dim == position else size
        for dim, size in enumerate(shapes[0])
    )
