"""Buckets: gradients that travel together, and everything about their trip.

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

:class:`Layout` is the only code that knows these positions. A
:class:`Bucket` owns one layout's trip: its members, its buffer kept from
step to step (:class:`ResidentBuffer`), packing, handing the packed bucket
to its communication hook (:mod:`.hooks`, shared by a plan's buckets),
receiving, and pointing each member's ``.grad`` at its average. The
averager reduces all of a plan's buckets at once (:meth:`Bucket.packed`,
then :meth:`Bucket.received`); the overlap sends them one at a time during
backward (:meth:`Bucket.send`). The bytes on the wire are the same either
way.

**Resident buffers.** A bucket packed into a new tensor each step needs a
new view per member each step as well, to point the member's ``.grad`` at
its average; on hundreds of small parameters those views cost more than the
copy itself. A :class:`ResidentBuffer` is made once per bucket, with
one view per member: a step copies the gradients in (one call into C++),
the engine sums in place, and each ``.grad`` is pointed at the view it had
last step, as DDP's ``gradient_as_bucket_view`` does. The values are the
same as a new tensor's would be, so the averages are bitwise equal. It
declines, and the bucket is packed into a new tensor instead
(:meth:`Layout.pack`), when a member has no gradient or a sparse one, when
the gradients do not fill the bucket (a parameter resized in place: the new
tensor's pack names it), when a member's ``.grad`` *is* its view in this
buffer (``zero_grad(set_to_none=False)`` keeps last step's views, so
backward adds into the buffer, and a buffer still on the wire while another
backward pass adds into it would mix the two), and under a hook that is not
``in_place`` (its result is a new tensor, whose own views the gradients
take). The buffer is what the front end's ``.grad`` holds until its loop
replaces or zeroes it: a reference to a ``.grad`` kept past the next step
sees the next step's values, as under ``gradient_as_bucket_view=True``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..engines import Engine
from ..errors import PyroDistributedError
from ..torch_internals import (
    GradStamp,
    copy_all_,
    flatten_dense,
    grad_changed_since,
    grad_stamp,
    unflatten_dense,
)
from .hooks import CommHook, GradBucket, Reducing


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


class ResidentBuffer:
    """One bucket's flat buffer, kept from step to step, and its members' views
    (see the module docstring).

    :param layout: the bucket's layout.
    :param members: the bucket's tensors, in its order.
    :param riders: how many riders it carries (the buffer's length depends on it).
    """

    def __init__(self, layout: Layout, members: Sequence[Tensor], riders: int) -> None:
        self.riders = riders
        self._members = tuple(members)
        self._size = layout.size
        flags = len(members) + layout.norm_slot
        self.buffer = torch.zeros(
            layout.size + flags + riders, dtype=layout.dtype, device=layout.device
        )
        #: Per member, its gradient's place in the buffer, shaped like the member.
        self.views = unflatten_dense(self.buffer, list(members))
        tail = self.buffer[layout.size :]
        self._targets = [*self.views, tail[:flags], tail[flags:]]

    def pack(self, flags: Tensor, riders: Tensor | None) -> Tensor | None:
        """The gradients, then ``flags`` (presence and norm slot) and ``riders``,
        copied into the buffer; ``None`` where it cannot be used (module docstring)."""
        grads = [member.grad for member in self._members]
        if any(map(operator.is_, grads, self.views)):
            return None
        sources = [*grads, flags]
        targets = self._targets if riders is not None else self._targets[:-1]
        if riders is not None:
            sources.append(riders)
        try:
            # A copy broadcasts: a gradient smaller than its view (a parameter
            # shrunk in place) would fill it silently. The total says so, and
            # the new tensor's pack raises naming it.
            if sum(map(Tensor.numel, grads)) != self._size:  # type: ignore[arg-type]
                return None
            # Without a graph: a gradient made with create_graph=True carries one.
            with torch.no_grad():
                copy_all_(targets, sources)  # type: ignore[arg-type]
        except (TypeError, RuntimeError):  # a gradient is None, or sparse
            return None
        return self.buffer


@dataclass
class _InFlight:
    """A bucket's reduction this step: under way, or done."""

    reducing: Reducing | None  # None until sent
    #: The members' gradients when it left (to tell if one changed since).
    grads: list[GradStamp]
    #: The reduced bucket and its tail (flags, norm slot, riders), once done.
    result: Tensor | None = None
    tail: list[float] | None = None

    def done(self, layout: Layout) -> Tensor:
        if self.result is None:
            assert self.reducing is not None
            self.result = self.reducing.wait()
            self.tail = layout.tail(self.result)
        return self.result

    def kept(self, layout: Layout) -> Tensor:
        """The result, which the step keeps: the hook commits its state."""
        flat = self.done(layout)
        assert self.reducing is not None
        self.reducing.commit()
        return flat


class Bucket:
    """One layout's members, buffer and trip (see the module docstring).

    :param layout: where each value sits.
    :param params: the whole planned sequence (the layout's members index it).
    :param name: the collective's name (Horovod pairs collectives by name).
    :param hook: how the bucket travels, shared by the plan's buckets.
    :param world_size: the number of workers.
    :param measure_norms: measure this worker's and the average's squared norms.
    :param index: the bucket's place in its plan.
    """

    def __init__(
        self,
        layout: Layout,
        params: tuple[Tensor, ...],
        name: str,
        hook: CommHook,
        world_size: int,
        measure_norms: bool,
        index: int = 0,
    ) -> None:
        self.layout = layout
        self.name = name
        self.index = index
        self._params = params
        self._members = tuple(params[i] for i in layout.members)
        self._shapes = tuple(member.shape for member in self._members)
        self._hook = hook
        self._world_size = world_size
        self._measure = measure_norms
        self._resident: ResidentBuffer | None = None
        self._in_flight: _InFlight | None = None
        #: Squared norms of the last step (with ``measure_norms``): this
        #: worker's, kept where the bucket has no norm slot; the sum over
        #: workers, read from the slot; and the averaged gradient's.
        self.local_sq: Tensor | None = None
        self.summed_sq: Tensor | None = None
        self.average_sq: Tensor | None = None

    @property
    def members(self) -> tuple[Tensor, ...]:
        """The tensors whose gradients this bucket carries, in its order."""
        return self._members

    def pack(self, riders: Sequence[float] = ()) -> Tensor:
        """The members' gradients as one flat tensor (:class:`Layout`), with
        ``riders`` riding along; in the resident buffer where it serves."""
        layout = self.layout
        flat = self._pack_resident(riders)
        if flat is None:
            flat = layout.pack(self._params, riders)
        if self._measure:
            body = layout.gradients(flat)
            if layout.norm_slot:
                layout.set_norm(flat, torch.dot(body, body))
            else:
                self.local_sq = torch.dot(body, body).double()
        return flat

    def _pack_resident(self, riders: Sequence[float]) -> Tensor | None:
        if not self._hook.in_place:
            return None  # the result comes back as a new tensor
        layout, resident = self.layout, self._resident
        if resident is None or resident.riders != len(riders):
            resident = self._resident = ResidentBuffer(layout, self._members, len(riders))
        return resident.pack(layout.flags, layout.riders_tensor(riders) if riders else None)

    def packed(
        self,
        riders: Sequence[float] = (),
        watch: bool = False,
        *,
        step: int = 0,
        is_last: bool = True,
    ) -> GradBucket:
        """Pack this step's bucket for its hook (of the optimizer's ``step``;
        ``is_last`` in the step's order). With ``watch``, remember the
        members' gradients, for :meth:`stale`."""
        flat = self.pack(riders)
        stamps = [grad_stamp(member) for member in self._members] if watch else []
        self._in_flight = _InFlight(None, stamps)
        return GradBucket(
            self.name,
            flat,
            self.layout.size,
            self._shapes,
            self._world_size,
            self,
            self.index,
            is_last,
            step,
        )

    def sent(self, reducing: Reducing) -> None:
        """The reduction of what :meth:`packed` gave is under way."""
        assert self._in_flight is not None, "the bucket was not packed"
        self._in_flight.reducing = reducing

    def received(self, result: Tensor) -> bool:
        """The reduced bucket (from a batch of plain sums, whose hook keeps no
        state): point each member's ``.grad`` at its average; return whether
        every average is finite."""
        assert self._in_flight is not None, "the bucket was not packed"
        self._in_flight = None
        return self._unpack(result, None)

    def send(
        self,
        channel: Engine,
        riders: Sequence[float] = (),
        watch: bool = True,
        *,
        step: int = 0,
        is_last: bool = True,
    ) -> None:
        """Start this bucket's hook on ``channel`` (collectives made by every
        worker in the same order); :meth:`receive` finishes it."""
        bucket = self.packed(riders, watch, step=step, is_last=is_last)
        self.sent(self._hook(bucket, channel))

    def stale(self) -> bool:
        """Whether a member's gradient changed since the bucket left (sent with ``watch``)."""
        in_flight = self._in_flight
        assert in_flight is not None, "the bucket was not sent"
        return any(map(grad_changed_since, self._members, in_flight.grads))

    def summed_riders(self) -> list[float]:
        """Wait for the reduction; its riders, summed exactly as written."""
        in_flight = self._in_flight
        assert in_flight is not None, "the bucket was not sent"
        in_flight.done(self.layout)
        assert in_flight.tail is not None
        return self.layout.riders(in_flight.tail)

    def receive(self) -> bool:
        """Wait for the reduction, keep it (the hook commits its state) and
        point each member's ``.grad`` at its average; return whether every
        average is finite."""
        in_flight = self._in_flight
        assert in_flight is not None, "the bucket was not sent"
        flat = in_flight.kept(self.layout)
        self._in_flight = None
        return self._unpack(flat, in_flight.tail)

    def riders_dtype(self) -> torch.dtype | None:
        """The type riders travel in here, or ``None`` (:meth:`.hooks.CommHook.tail_dtype`)."""
        return self._hook.tail_dtype(self.layout.dtype)

    def discard(self) -> None:
        """Finish a reduction still under way, and drop it: the hook keeps
        nothing of it (its result, if already waited for, is not committed)."""
        in_flight = self._in_flight
        if in_flight is not None and in_flight.reducing is not None and in_flight.result is None:
            in_flight.reducing.drop()
        self._in_flight = None

    def _unpack(self, flat: Tensor, tail: Sequence[float] | None) -> bool:
        layout = self.layout
        body = layout.gradients(flat)
        if self._measure:
            self.average_sq = torch.dot(body, body).double()
            if layout.norm_slot:
                self.summed_sq = layout.norm(flat).double()
        present = layout.present(layout.tail(flat) if tail is None else tail)
        resident = self._resident
        views: Sequence[Tensor]
        if resident is not None and flat is resident.buffer:
            views = resident.views
        else:
            views = layout.views(flat, self._params)
        members = self._members
        if all(present):
            for member, view in zip(members, views, strict=True):
                member.grad = view
        else:
            for member, view, here in zip(members, views, present, strict=True):
                member.grad = view if here else None
        # The gradients only: flags and riders are finite by construction, and
        # a squared norm that overflows must not make the step look non-finite.
        return _all_finite(body)


def _all_finite(flat: Tensor) -> bool:
    """Whether every value is finite, in one pass over ``flat`` in the common case.

    A NaN or Inf anywhere makes the sum NaN or Inf, so a finite sum proves
    every value finite. A sum that is not finite may only have overflowed:
    then each value is checked.
    """
    return math.isfinite(flat.sum().item()) or bool(torch.isfinite(flat).all())


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
