"""Fused averaging of many gradients: scaling, compressing, writing back.

The buckets (:mod:`.layout`) go out in one call to the engine, so a step costs
O(1) collectives however many parameters there are.

After averaging, each parameter's ``.grad`` becomes a view into the averaged
buffer: no copy back. Without compression the buffer and its views are kept
from step to step (:mod:`.resident`); a compressed sum comes back as a new
tensor, and the gradients take views of it.

For the gradient noise scale (:mod:`pyro_distributed.optim.noise_scale`) the
averager can also measure squared norms: each bucket then carries this
worker's squared norm of its gradients in its norm slot, so their sum over
workers arrives with the gradients and costs no collective. That needs a wide
float on the wire: a compressed bucket (whose narrow type could overflow or
round the norm away) or one of half-precision parameters keeps its norm at
home, and those norms travel together in one extra float64 all-reduce per step
instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from ..engines import Engine
from .agreement import digest_bits
from .layout import Bucket, plan_buckets
from .resident import ResidentBuffer


class Compressor(Protocol):
    """Turns a buffer into what goes on the wire and back.

    Horovod's ``hvd.Compression.none`` and ``hvd.Compression.fp16`` have this shape.
    """

    def compress(self, tensor: Tensor) -> tuple[Tensor, Any]: ...

    def decompress(self, tensor: Tensor, ctx: Any) -> Tensor: ...


@dataclass(frozen=True)
class Reduction:
    """How gradients are combined across workers, and how they are grouped on the way.

    :param op: ``"mean"`` (the average) or ``"sum"``.
    :param predivide: with ``"mean"``, divide by this before summing and by
        ``world_size / predivide`` after (Horovod's ``gradient_predivide_factor``).
    :param compression: applied to each fused buffer before it travels. When
        it narrows the dtype, the whole division by the world size happens
        before summation, so that the sum cannot overflow the narrow type.
    :param groups: ``None``; a number of contiguous groups to split the sorted
        parameters into; or lists of parameters to fuse together (every other
        parameter is a group of its own). Buffers never cross groups.
    """

    op: Literal["mean", "sum"] = "mean"
    predivide: float = 1.0
    compression: Compressor | None = None
    groups: int | Sequence[Sequence[Tensor]] | None = field(default=None)


@dataclass(eq=False)
class BucketPlan:
    """The buckets of one list of parameters, and what each keeps from step to step.

    Made by :meth:`GradientAverager.plan` and kept by its caller (the step's
    plan, :class:`~.sync.ExchangePlan`) for as long as the parameters are the
    same; a new list of parameters gets a new one.
    """

    #: The parameters' names and the parameters, in the order planned.
    names: tuple[str, ...]
    params: tuple[Tensor, ...]
    buckets: list[Bucket]
    #: One collective name per bucket (Horovod pairs collectives by name).
    bucket_names: list[str]
    #: Per bucket, its buffer kept from step to step (made at its first pack).
    resident: list[ResidentBuffer | None]


def _group_of(
    params: Sequence[Tensor], groups: int | Sequence[Sequence[Tensor]] | None
) -> list[int]:
    if groups is None or isinstance(groups, int):
        count = groups or 1
        return [index * count // len(params) for index in range(len(params))]
    listed = {id(param): number for number, group in enumerate(groups) for param in group}
    return [listed.get(id(param), len(groups) + index) for index, param in enumerate(params)]


class GradientAverager:
    """Combines the ``.grad`` of a list of parameters across workers, in place.

    A parameter whose ``.grad`` is ``None`` on this worker contributes zeros.
    One that has no gradient on any worker keeps ``.grad = None``, so the
    optimizer skips it as it would in one process. To know that without an
    extra collective, each bucket carries a presence flag per member.

    Buckets can also travel one at a time (:meth:`pack`, :meth:`encode`,
    :meth:`decode`, :meth:`unpack`), which is how
    :mod:`pyro_distributed.exchange.overlap` sends them during backward; the bytes on
    the wire are the same either way, so the results are bitwise equal.
    """

    def __init__(
        self, engine: Engine, cap_bytes: int, reduction: Reduction, measure_norms: bool = False
    ) -> None:
        self._engine = engine
        self._cap_bytes = cap_bytes
        self._reduction = reduction
        # Factors before and after summation, without and with a narrowing
        # compression: fixed for the engine's world size, so worked out once.
        self._plain_scales = self._scales_for(narrowed=False)
        self._narrowed_scales = self._scales_for(narrowed=True)
        #: Whether to measure squared norms for :meth:`squared_norms`.
        self.measure_norms = measure_norms
        # Per bucket, this step: this worker's squared norm (kept where the bucket
        # cannot carry it) or the decoded sum of all workers' (where it can), and
        # the squared norm of the averaged gradient.
        self._local_sq: dict[int, Tensor] = {}
        self._summed_sq: dict[int, Tensor] = {}
        self._average_sq: dict[int, Tensor] = {}
        # The buckets the norms above were measured in (the last ones packed).
        self._measured: BucketPlan | None = None

    def plan(self, names: Sequence[str], params: Sequence[Tensor]) -> BucketPlan:
        """The buckets for these parameters, in this order (a new plan; the
        caller keeps it for as long as the parameters stay the same)."""
        params = tuple(params)
        group_of = _group_of(params, self._reduction.groups)
        norm_slot = self.measure_norms and self._reduction.compression is None
        buckets = plan_buckets(params, self._cap_bytes, group_of, norm_slot)
        # Collective names (Horovod matches on them) come from the tensors' names.
        bucket_names = [
            f"pyro_distributed.grad.{names[b.members[0]]}+{len(b.members) - 1}" for b in buckets
        ]
        return BucketPlan(tuple(names), params, buckets, bucket_names, [None] * len(buckets))

    def pack(self, plan: BucketPlan, index: int, riders: Sequence[float] = ()) -> Tensor:
        """Bucket ``index`` of ``plan`` as one flat tensor (:class:`~.layout.Bucket`),
        with ``riders`` riding along (see :meth:`carrier_digest_bits`)."""
        bucket = plan.buckets[index]
        flat = self._pack_resident(plan, index, riders)
        if flat is None:
            flat = bucket.pack(plan.params, riders)
        if self.measure_norms:
            self._measured = plan
            body = bucket.gradients(flat)
            if bucket.norm_slot:
                bucket.set_norm(flat, torch.dot(body, body))
            else:
                self._local_sq[index] = torch.dot(body, body).double()
        return flat

    def _pack_resident(
        self, plan: BucketPlan, index: int, riders: Sequence[float]
    ) -> Tensor | None:
        """Bucket ``index`` packed into its resident buffer (:mod:`.resident`), or
        ``None``. Only without compression: a compressed sum comes back as a new
        tensor, whose own views the gradients must take."""
        if self._reduction.compression is not None:
            return None
        bucket, resident = plan.buckets[index], plan.resident[index]
        if resident is None or resident.riders != len(riders):
            members = [plan.params[i] for i in bucket.members]
            resident = plan.resident[index] = ResidentBuffer(bucket, members, len(riders))
        return resident.pack(bucket.flags, bucket.riders_tensor(riders) if riders else None)

    def carrier_digest_bits(self, bucket: Bucket) -> int | None:
        """The pieces (in bits, :func:`~.agreement.digest_bits`) in which the
        agreement header can ride in ``bucket``'s sum and still sum exactly,
        or ``None`` where it cannot.

        The riders are left out of any scaling (:meth:`encode`), cast with the
        bucket, and read from the summed wire before it is decoded, so only the
        wire's type and the number of workers decide:
        8-bit pieces in float32, 4-bit ones in float16 up to 9 workers, for
        example. A compressor that changes the shape of what it sends carries
        no riders.
        """
        probe = torch.zeros(2, dtype=bucket.dtype, device=bucket.device)
        compression = self._reduction.compression
        wire = probe if compression is None else compression.compress(probe)[0]
        if wire.shape != probe.shape:
            return None
        return digest_bits(wire.dtype, self._engine.world_size)

    def encode(self, flat: Tensor, riders: Sequence[float] = ()) -> tuple[Tensor, Any]:
        """Scale (and compress) a packed bucket for the wire, where it is summed.

        ``riders``, the last values of ``flat`` (:meth:`pack`), are left out of
        the scaling: small integers, which a cast to the wire's type keeps
        exact, so that their sum stays exact (:meth:`carrier_digest_bits`).
        """
        compression = self._reduction.compression
        narrowed = compression is not None and compression.compress(flat[:1])[0].dtype != flat.dtype
        pre, _ = self._scales(narrowed)
        _scaled(flat[: flat.numel() - len(riders)] if riders else flat, pre)
        if compression is None:
            return flat, None
        return compression.compress(flat)

    def decode(self, wire: Tensor, context: Any) -> Tensor:
        """The summed wire tensor back as an averaged flat bucket."""
        compression = self._reduction.compression
        if compression is None:
            return _scaled(wire, self._scales(narrowed=False)[1])
        restored = compression.decompress(wire, context)
        narrowed = wire.dtype != restored.dtype
        return _scaled(restored, self._scales(narrowed)[1])

    def average_alone_(self, tensor: Tensor) -> Tensor:
        """``tensor``, in place, as averaging it with W-1 zero contributions leaves it.

        The same scaling and compression as a bucket's (:meth:`encode`, then
        :meth:`decode`), since a sum that adds exact zeros changes nothing: a
        gradient that never travels (a local parameter's) comes out bitwise
        as the exchange would have averaged it, for every ``op``,
        ``predivide`` and compression.
        """
        wire, context = self.encode(tensor)
        averaged = self.decode(wire, context)
        return averaged if averaged is tensor else tensor.copy_(averaged)

    def unpack(
        self, plan: BucketPlan, index: int, flat: Tensor, tail: Sequence[float] | None = None
    ) -> bool:
        """Point each member's ``.grad`` into the averaged ``flat``; return whether it is finite.

        :param tail: the bucket's :meth:`~.layout.Bucket.tail`, when the caller
            has already read it (the flags only need to be positive, so the
            tail of the summed wire, before decoding, serves as well).
        """
        bucket = plan.buckets[index]
        body = bucket.gradients(flat)
        if self.measure_norms:
            self._average_sq[index] = torch.dot(body, body).double()
            if bucket.norm_slot:
                self._summed_sq[index] = bucket.norm(flat).double()
        present = bucket.present(bucket.tail(flat) if tail is None else tail)
        resident = plan.resident[index]
        views: Sequence[Tensor]
        if resident is not None and flat is resident.buffer:
            views = resident.views
        else:
            views = bucket.views(flat, plan.params)
        params = plan.params
        if all(present):
            for member, view in zip(bucket.members, views, strict=True):
                params[member].grad = view
        else:
            for slot, (member, view) in enumerate(zip(bucket.members, views, strict=True)):
                params[member].grad = view if present[slot] else None
        # The gradients only: flags and riders are finite by construction, and
        # a squared norm that overflows must not make the step look non-finite.
        return _all_finite(body)

    def squared_norms(self) -> tuple[float, float]:
        """``(mean_i |g_i|^2, |mean_i g_i|^2)`` over every worker's gradient g_i of the
        step just averaged (with ``measure_norms``; after :meth:`unpack` of every bucket).

        A collective when a bucket could not carry its norm (then on every worker
        alike, since compression and dtypes are the same everywhere).
        """
        buckets = self._measured.buckets if self._measured is not None else []
        indices = range(len(buckets))
        # Decoded bucket sums are means over workers, or sums with op="sum".
        carried = sum((self._summed_sq[i] for i in indices if buckets[i].norm_slot), 0.0)
        small = carried / self._to_mean()
        kept = [self._local_sq[i] for i in indices if not buckets[i].norm_slot]
        if kept:
            local = torch.stack(kept).sum().reshape(1)
            self._engine.allreduce_([local], op="sum")
            small = small + local[0] / self._engine.world_size
        average = sum((self._average_sq[i] for i in indices), 0.0)
        return float(small), float(average) / self._to_mean() ** 2

    def _to_mean(self) -> float:
        """What turns a decoded value into a mean over workers: the divisor."""
        return float(self._engine.world_size) if self._reduction.op == "sum" else 1.0

    def _scales(self, narrowed: bool) -> tuple[float, float]:
        """Factors applied before and after summation."""
        return self._narrowed_scales if narrowed else self._plain_scales

    def _scales_for(self, narrowed: bool) -> tuple[float, float]:
        if self._reduction.op == "sum":
            return 1.0, 1.0
        world_size = self._engine.world_size
        predivide = world_size if narrowed else self._reduction.predivide
        return 1.0 / predivide, predivide / world_size

    def average_(self, plan: BucketPlan) -> bool:
        """Average the gradients of ``plan``'s parameters in place, all buckets at
        once; return whether every average is finite.

        A NaN or Inf on any worker reaches the average, so every worker
        returns the same answer.
        """
        if not plan.params:
            return True
        indices = range(len(plan.buckets))
        wires, contexts = zip(*(self.encode(self.pack(plan, i)) for i in indices), strict=True)
        self._engine.allreduce_(list(wires), op="sum", names=plan.bucket_names)
        flats = [self.decode(w, c) for w, c in zip(wires, contexts, strict=True)]
        return all([self.unpack(plan, i, flat) for i, flat in zip(indices, flats, strict=True)])


def _all_finite(flat: Tensor) -> bool:
    """Whether every value is finite, in one pass over ``flat`` in the common case.

    A NaN or Inf anywhere makes the sum NaN or Inf, so a finite sum proves
    every value finite. A sum that is not finite may only have overflowed:
    then each value is checked.
    """
    return math.isfinite(flat.sum().item()) or bool(torch.isfinite(flat).all())


def _scaled(tensor: Tensor, factor: float) -> Tensor:
    return tensor.mul_(factor) if factor != 1.0 else tensor
