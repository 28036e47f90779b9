"""Fused averaging of many tensors: bucketing, flattening, writing back.

Per-parameter collectives cost one round trip each, and a Pyro guide easily
has hundreds of small parameters. Here tensors are grouped by (device, dtype),
packed into flat buffers of at most ``cap_bytes`` each, and every buffer goes
out in one call to the engine, so a step costs O(1) collectives. Buckets are
planned from the order the tensors are given in, which the caller keeps the
same on every worker (sorted by param-store name).

After averaging, each parameter's ``.grad`` becomes a view into the averaged
buffer: no copy back. Pyro's ``zero_grads`` replaces ``.grad`` with fresh
zeros, so the buffer is released after the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .engines import Engine

__all__ = ["Bucket", "GradientAverager", "broadcast_values_", "plan_buckets"]


@dataclass(frozen=True)
class Bucket:
    """Tensors, by index into the planned sequence, that travel in one flat buffer."""

    device: torch.device
    dtype: torch.dtype
    members: tuple[int, ...]
    numels: list[int]


def plan_buckets(tensors: Sequence[Tensor], cap_bytes: int) -> list[Bucket]:
    """Group tensors by (device, dtype) and split each group at ``cap_bytes``.

    A tensor larger than the cap gets a bucket of its own; order within a
    bucket follows the input order, and groups come in order of first appearance.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    buckets = []
    for (device, dtype), indices in groups.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        current: list[int] = []
        current_bytes = 0
        for index in indices:
            size = tensors[index].numel() * itemsize
            if current and current_bytes + size > cap_bytes:
                buckets.append(_bucket(device, dtype, current, tensors))
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += size
        buckets.append(_bucket(device, dtype, current, tensors))
    return buckets


def _bucket(
    device: torch.device, dtype: torch.dtype, members: list[int], tensors: Sequence[Tensor]
) -> Bucket:
    return Bucket(device, dtype, tuple(members), [tensors[i].numel() for i in members])


def _flatten(bucket: Bucket, tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([tensors[i].reshape(-1) for i in bucket.members])


def broadcast_values_(engine: Engine, tensors: Sequence[Tensor], cap_bytes: int) -> None:
    """Overwrite each tensor's values, in place, with worker 0's."""
    buckets = plan_buckets(tensors, cap_bytes)
    with torch.no_grad():
        flats = [_flatten(bucket, [t.detach() for t in tensors]) for bucket in buckets]
        engine.broadcast_(flats, src=0)
        for bucket, flat in zip(buckets, flats, strict=True):
            for index, chunk in zip(bucket.members, torch.split(flat, bucket.numels), strict=True):
                tensors[index].copy_(chunk.view_as(tensors[index]))


class GradientAverager:
    """Averages the ``.grad`` of a list of parameters across workers.

    A parameter whose ``.grad`` is ``None`` on this worker contributes zeros.
    One that has no gradient on any worker keeps ``.grad = None``, so the
    optimizer skips it as it would in one process. To know that without an
    extra collective, a presence flag per parameter rides in the first buffer.
    """

    def __init__(self, engine: Engine, cap_bytes: int) -> None:
        self._engine = engine
        self._cap_bytes = cap_bytes
        self._plan_key: tuple[int, ...] = ()
        self._plan: list[Bucket] = []

    def _buckets(self, params: Sequence[Tensor]) -> list[Bucket]:
        key = tuple(id(p) for p in params)
        if key != self._plan_key:
            self._plan = plan_buckets(params, self._cap_bytes)
            self._plan_key = key
        return self._plan

    def average_(self, params: Sequence[Tensor]) -> None:
        if not params:
            return
        buckets = self._buckets(params)
        grads = [_dense_grad(p) for p in params]
        pieces = [[grads[i].reshape(-1) for i in bucket.members] for bucket in buckets]
        flag_dtype, flag_device = buckets[0].dtype, buckets[0].device
        pieces[0].append(
            torch.tensor([p.grad is not None for p in params], dtype=flag_dtype, device=flag_device)
        )
        flats = [torch.cat(bucket_pieces) for bucket_pieces in pieces]
        self._engine.allreduce_(flats, op="mean")
        flags_start = sum(buckets[0].numels)
        present = (flats[0][flags_start:] > 0).tolist()
        for bucket, flat in zip(buckets, flats, strict=True):
            chunks = torch.split(flat[: sum(bucket.numels)], bucket.numels)
            for index, chunk in zip(bucket.members, chunks, strict=True):
                param = params[index]
                param.grad = chunk.view_as(param) if present[index] else None


def _dense_grad(param: Tensor) -> Tensor:
    grad = param.grad
    if grad is None:
        return torch.zeros_like(param)
    return grad.to_dense() if grad.is_sparse else grad
