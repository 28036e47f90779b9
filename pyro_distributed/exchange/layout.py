"""Where each value of a packed bucket sits, and which tensors travel together.

Per-tensor collectives cost one round trip each, and a Pyro guide easily has
hundreds of small parameters. Tensors are grouped by (group, device, dtype)
and packed into flat buffers of at most ``cap_bytes`` each
(:func:`plan_layouts`), planned from the order the tensors are given in,
which the caller keeps the same on every worker. A packed bucket is laid
out as::

    [ gradients of every member | one presence flag per member | norm slot? | riders ]

* the gradients, flattened, in member order;
* a presence flag per member: 1.0 where this worker has a gradient, so that
  after summation a flag > 0 says that some worker had one;
* with a norm slot, this worker's squared gradient norm, whose sum over
  workers feeds the gradient noise scale;
* riders: small values (the agreement header) that ride along in the sum
  instead of costing a collective of their own.

:class:`Layout` is the only code that knows these positions; a bucket's trip
is :mod:`.bucket`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..errors import PyroDistributedError
from ..torch_internals import flatten_dense


@dataclass(frozen=True)
class Layout:
    """Tensors, by index into the planned sequence, that travel in one flat buffer."""

    device: torch.device
    dtype: torch.dtype
    members: tuple[int, ...]
    numels: list[int]
    #: Whether the bucket carries this worker's squared norm in its sum.
    norm_slot: bool = False

    @cached_property
    def size(self) -> int:
        """How many gradient values the bucket holds."""
        return sum(self.numels)

    def pack(self, tensors: Sequence[Tensor], riders: Sequence[float] = ()) -> Tensor:
        """This bucket's gradients, presence flags, norm slot and ``riders``, as one
        new flat tensor. ``tensors`` is the whole planned sequence; a member
        without a gradient contributes zeros. The norm slot is left at zero for
        :meth:`set_norm`."""
        grads = [tensors[i].grad for i in self.members]
        tail = [self.flags]
        if riders:
            tail.append(self.riders_tensor(riders))
        try:
            # The common case, every member with a dense gradient: one copy in C++.
            flat = flatten_dense([*grads, *tail])  # type: ignore[list-item]
        except (TypeError, RuntimeError):  # a gradient is None, or sparse
            members = [tensors[i] for i in self.members]
            tail[0] = torch.tensor(
                [float(t.grad is not None) for t in members] + [0.0] * self.norm_slot,
                dtype=self.dtype,
                device=self.device,
            )
            flat = torch.cat([*(_dense_grad(t).reshape(-1) for t in members), *tail])
        if flat.size(0) != self.size + len(self.members) + self.norm_slot + len(riders):
            raise PyroDistributedError(_changed_in_place(self, tensors))
        # Detached: multi-optimizers leave graph-carrying gradients (create_graph=True).
        return flat.detach() if flat.requires_grad else flat

    @cached_property
    def flags(self) -> Tensor:
        """Every member present, and the norm slot at zero (made once, copied by pack)."""
        tail = torch.ones(len(self.members) + self.norm_slot, dtype=self.dtype, device=self.device)
        if self.norm_slot:
            tail[-1] = 0.0
        return tail

    def riders_tensor(self, riders: Sequence[float]) -> Tensor:
        """``riders`` as a tensor; the last step's when they are the same values, as
        they are in the steady state (the digest unchanged, nothing stale)."""
        values = tuple(riders)
        last = self.__dict__.get("_last_riders")
        if last is None or last[0] != values:
            last = (values, torch.tensor(values, dtype=self.dtype, device=self.device))
            self.__dict__["_last_riders"] = last  # frozen: a cache, as cached_property's
        return last[1]

    def gradients(self, flat: Tensor) -> Tensor:
        """The gradient values of a packed (or summed) bucket."""
        return flat[: self.size]

    def split_gradients(self, flat: Tensor) -> tuple[Tensor, ...]:
        """The gradient values, one flat piece per member."""
        return torch.split(self.gradients(flat), self.numels)

    def views(self, flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Per member, its gradient values in ``flat`` as a view shaped like the
        member. (A split and a ``view_as`` each measured faster here, per
        step, than ``unflatten_dense``, which :class:`ResidentBuffer` calls once.)"""
        pieces = self.split_gradients(flat)
        return [piece.view_as(tensors[i]) for i, piece in zip(self.members, pieces, strict=True)]

    def tail(self, flat: Tensor) -> list[float]:
        """Everything after the gradients, as Python floats, in one read: the
        presence flags, the norm slot if any, the riders."""
        values: list[float] = flat[self.size :].tolist()
        return values

    def present(self, tail: Sequence[float]) -> list[bool]:
        """Per member, whether any worker contributed a gradient, from a summed
        bucket's :meth:`tail`."""
        return [flag > 0 for flag in tail[: len(self.members)]]

    def set_norm(self, flat: Tensor, value: Tensor) -> None:
        """Write this worker's squared norm into the norm slot."""
        assert self.norm_slot, "this bucket has no norm slot"
        flat[self.size + len(self.members)] = value

    def norm(self, flat: Tensor) -> Tensor:
        """The value in the norm slot (after the sum: the sum over workers)."""
        assert self.norm_slot, "this bucket has no norm slot"
        return flat[self.size + len(self.members)]

    def riders(self, tail: Sequence[float]) -> list[float]:
        """The riders, from a packed (or summed) bucket's :meth:`tail`."""
        return list(tail[len(self.members) + self.norm_slot :])


def plan_layouts(
    tensors: Sequence[Tensor],
    cap_bytes: int,
    group_of: Sequence[int] | None = None,
    norm_slot: bool = False,
) -> list[Layout]:
    """Group tensors by (group, device, dtype) and split each group at ``cap_bytes``.

    A tensor larger than the cap gets a bucket of its own; order within a
    bucket follows the input order, and groups come in order of first
    appearance. With ``norm_slot``, buckets of float32 and float64 carry a
    norm slot (a narrower type could overflow or round the norm away).
    """
    groups: dict[tuple[int, torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        group = 0 if group_of is None else group_of[index]
        groups.setdefault((group, tensor.device, tensor.dtype), []).append(index)
    layouts = []
    for (_, device, dtype), indices in groups.items():
        itemsize = dtype.itemsize
        wide = norm_slot and dtype in (torch.float32, torch.float64)
        current: list[int] = []
        current_bytes = 0
        for index in indices:
            size = tensors[index].numel() * itemsize
            if current and current_bytes + size > cap_bytes:
                layouts.append(_layout(device, dtype, current, tensors, wide))
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += size
        layouts.append(_layout(device, dtype, current, tensors, wide))
    return layouts


def _layout(
    device: torch.device,
    dtype: torch.dtype,
    members: list[int],
    tensors: Sequence[Tensor],
    norm_slot: bool,
) -> Layout:
    numels = [tensors[i].numel() for i in members]
    return Layout(device, dtype, tuple(members), numels, norm_slot)


def _changed_in_place(layout: Layout, tensors: Sequence[Tensor]) -> str:
    """Why a bucket's gradients no longer fit it: a member changed size in place."""
    changed = [
        f"{list(tensors[i].shape)} ({tensors[i].numel()} values, planned {numel})"
        for i, numel in zip(layout.members, layout.numels, strict=True)
        if tensors[i].numel() != numel
    ]
    return (
        f"a parameter changed its size in place since its gradient was first averaged "
        f"(now {', '.join(changed) or 'unknown'}): replace a parameter by a new tensor, "
        f"which every worker then agrees on, instead of assigning to its .data"
    )


def _dense_grad(tensor: Tensor) -> Tensor:
    grad = tensor.grad
    if grad is None:
        return torch.zeros_like(tensor, requires_grad=False)
    # Detached: multi-optimizers leave graph-carrying gradients (create_graph=True).
    return (grad.to_dense() if grad.is_sparse else grad).detach()
