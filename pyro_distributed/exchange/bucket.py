"""Buckets: gradients that travel together, and everything about their trip.

A :class:`Bucket` owns one layout's trip (:mod:`.layout` says where each
value sits): its members, its buffer kept from step to step
(:class:`ResidentBuffer`), packing, handing the packed bucket to its
communication hook (:mod:`.hooks`, shared by a plan's buckets), receiving,
keeping the result (the hook commits its state) or dropping it, and
pointing each member's ``.grad`` at its average. The averager reduces all of
a plan's buckets at once (:meth:`Bucket.packed`, then :meth:`Bucket.received`
or :meth:`Bucket.receive`); the overlap sends them one at a time during
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
(:meth:`.layout.Layout.pack`), when a member has no gradient or a sparse one, when
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

import torch
from torch import Tensor

from ..engines import Engine
from ..torch_internals import (
    GradStamp,
    copy_all_,
    grad_changed_since,
    grad_stamp,
    unflatten_dense,
)
from .hooks import CommHook, GradBucket, Reducing
from .layout import Layout


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
        #: The reduction received this step, whose state the hook commits if the step is kept.
        self._received: Reducing | None = None
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
        """Wait for the reduction and point each member's ``.grad`` at its
        average; return whether every average is finite. The hook commits its
        state at :meth:`settle`, once the step is known to be kept."""
        in_flight = self._in_flight
        assert in_flight is not None, "the bucket was not sent"
        flat = in_flight.done(self.layout)
        self._received = in_flight.reducing
        self._in_flight = None
        return self._unpack(flat, in_flight.tail)

    def riders_dtype(self) -> torch.dtype | None:
        """The type riders travel in here, or ``None`` (:meth:`.hooks.CommHook.tail_dtype`)."""
        return self._hook.tail_dtype(self.layout.dtype)

    def settle(self, kept: bool) -> None:
        """End the step: the hook commits the state of the result received
        (:meth:`receive`) if the step is ``kept`` (every gradient finite on
        every worker), and keeps nothing of it otherwise."""
        received, self._received = self._received, None
        if kept and received is not None:
            received.commit()

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
