"""Fused averaging of many gradients: the buckets of a list of tensors, all at once.

:meth:`GradientAverager.plan` cuts the tensors into buckets (:mod:`.bucket`,
which owns each bucket's layout, buffer and trip), and
:meth:`GradientAverager.average_` sends them all in one call to the engine,
so a step costs O(1) collectives however many parameters there are. After
averaging, each parameter's ``.grad`` is a view into the averaged buffer: no
copy back.

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..digest import digest
from ..engines import Engine
from .bucket import Bucket
from .hooks import AverageHook, CommHook, Compressor
from .layout import plan_layouts


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
    :param hook: how each bucket travels (:mod:`.hooks`), in place of the
        average that ``op``, ``predivide`` and ``compression`` describe.
    """

    op: Literal["mean", "sum"] = "mean"
    predivide: float = 1.0
    compression: Compressor | None = None
    groups: int | Sequence[Sequence[Tensor]] | None = field(default=None)
    hook: CommHook | None = None

    def __post_init__(self) -> None:
        plain = self.op == "mean" and self.predivide == 1.0 and self.compression is None
        if self.hook is not None and not plain:
            raise ValueError(
                f"a comm_hook decides how gradients travel: pass it without op, "
                f"predivide or compression (got op={self.op!r}, predivide={self.predivide}, "
                f"compression={self.compression!r})"
            )

    def comm_hook(self) -> CommHook:
        """The hook every bucket travels with."""
        if self.hook is not None:
            return self.hook
        return AverageHook(self.op, self.predivide, self.compression)


@dataclass(eq=False)
class BucketPlan:
    """The buckets of one list of parameters (each keeps its buffer from step to step).

    Made by :meth:`GradientAverager.plan` and kept by its caller (the step's
    plan, :class:`~.sync.ExchangePlan`) for as long as the parameters are the
    same; a new list of parameters gets a new one.
    """

    #: The parameters' names and the parameters, in the order planned.
    names: tuple[str, ...]
    params: tuple[Tensor, ...]
    buckets: list[Bucket]


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
    """

    def __init__(
        self, engine: Engine, cap_bytes: int, reduction: Reduction, measure_norms: bool = False
    ) -> None:
        self._engine = engine
        self._cap_bytes = cap_bytes
        self._reduction = reduction
        self._hook = reduction.comm_hook()
        #: Whether to measure squared norms for :meth:`squared_norms`.
        self.measure_norms = measure_norms

    def plan(self, names: Sequence[str], params: Sequence[Tensor]) -> BucketPlan:
        """The buckets for these parameters, in this order (a new plan; the
        caller keeps it for as long as the parameters stay the same)."""
        params = tuple(params)
        group_of = _group_of(params, self._reduction.groups)
        # A norm needs a wide type to be summed in: float32 buckets sum their tail so.
        norm_slot = self.measure_norms and self._hook.tail_dtype(torch.float32) == torch.float32
        layouts = plan_layouts(params, self._cap_bytes, group_of, norm_slot)
        buckets = [
            Bucket(
                layout,
                params,
                bucket_name([names[member] for member in layout.members]),
                self._hook,
                self._engine.world_size,
                self.measure_norms,
                index,
            )
            for index, layout in enumerate(layouts)
        ]
        return BucketPlan(tuple(names), params, buckets)

    def average_(self, plan: BucketPlan, step: int = 0) -> bool:
        """Average the gradients of ``plan``'s parameters in place, all buckets at
        once (of the optimizer's ``step``); return whether every average is finite.

        A NaN or Inf on any worker reaches the average, so every worker
        returns the same answer.
        """
        if not plan.params:
            return True
        buckets, hook, engine = plan.buckets, self._hook, self._engine
        last = len(buckets) - 1
        packed = [
            bucket.packed(step=step, is_last=index == last) for index, bucket in enumerate(buckets)
        ]
        if type(hook) is AverageHook:  # keeps no state: nothing to commit
            # One call for every bucket: the engine may fuse or group the sums.
            world = engine.world_size
            encoded = [hook.encode(one.buffer, one.size, world) for one in packed]
            engine.allreduce_(
                [wire for wire, _ in encoded], op="sum", names=[b.name for b in buckets]
            )
            results = [
                hook.decode(wire, context, one.size, world)
                for (wire, context), one in zip(encoded, packed, strict=True)
            ]
        else:
            for bucket, one in zip(buckets, packed, strict=True):
                bucket.sent(hook(one, engine))
            return all([bucket.receive() for bucket in buckets])
        return all(
            [bucket.received(result) for bucket, result in zip(buckets, results, strict=True)]
        )

    def average_alone_(self, tensor: Tensor) -> Tensor:
        """``tensor``, in place, as averaging it with W-1 zero contributions
        leaves it (:meth:`.hooks.CommHook.alone_`); no communication."""
        return self._hook.alone_(tensor, self._engine.world_size)

    def squared_norms(self, plan: BucketPlan) -> tuple[float, float]:
        """``(mean_i |g_i|^2, |mean_i g_i|^2)`` over every worker's gradient g_i of the
        step just averaged in ``plan`` (with ``measure_norms``).

        A collective when a bucket could not carry its norm (then on every worker
        alike, since compression and dtypes are the same everywhere).
        """
        buckets, world = plan.buckets, self._engine.world_size
        to_mean = self._hook.to_mean(world)
        # A norm slot holds the sum over workers (the tail is summed exactly);
        # a reduced gradient is a mean over workers, or a sum with op="sum".
        carried = _measured(b.summed_sq for b in buckets if b.layout.norm_slot)
        small = sum(carried, 0.0) / world
        kept = _measured(b.local_sq for b in buckets if not b.layout.norm_slot)
        if kept:
            local = torch.stack(kept).sum().reshape(1)
            self._engine.allreduce_([local], op="sum")
            small = small + local[0] / world
        average = sum(_measured(b.average_sq for b in buckets), 0.0)
        return float(small), float(average) / to_mean**2


def bucket_name(members: Sequence[str]) -> str:
    """A bucket's name, from its members' names: the same on every worker and in
    every process of the run, and different for different members (Horovod
    pairs collectives by it, and a stateful hook keys its state by it)."""
    first, more = members[0], len(members) - 1
    if not more:
        return f"pyro_distributed.grad.{first}+0"
    return f"pyro_distributed.grad.{first}+{more}.{digest(tuple(members))[:8]}"


def _measured(norms: Iterable[Tensor | None]) -> list[Tensor]:
    """Norms the buckets measured at the last step (``measure_norms``)."""
    measured = list(norms)
    assert all(norm is not None for norm in measured), "norms are measured with measure_norms"
    return measured  # type: ignore[return-value]
