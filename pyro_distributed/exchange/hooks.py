"""Communication hooks: what a bucket's trip does between packing and unpacking.

A hook is given one packed bucket (:class:`GradBucket`) and the engine, starts
the collectives it needs, and returns a :class:`Reducing` whose ``wait()``
gives the bucket back with its gradients averaged and its tail (presence
flags, norm slot, riders) summed exactly. Everything else about the trip
(packing, overlap with backward, the agreement header, pointing ``.grad`` at
the result) is the bucket's, so a new compression is one hook in one file.

:class:`AverageHook` is the exact average every optimizer uses by default;
with a narrowing compressor (``compression="fp16"`` or ``"bf16"``, or a
Horovod ``Compression``) it divides by the world size before the sum, which
then cannot overflow the narrow type. A plain function ``(bucket, engine) ->
Reducing`` becomes a hook with :func:`as_hook`. ``compression=`` together
with ``comm_hook=`` runs the hook on the bucket cast to the narrow type
(:class:`NarrowedHook`).

**A hook that keeps state across steps** (:class:`~.low_rank.LowRankHook`
keeps its error feedback) follows five rules, which make a resumed or
rolled-back run continue exactly:

* keep state by ``GradBucket.name`` (the same on every worker and in every
  process of the run, and different for buckets of different members), and
  read the step from :attr:`~pyro_distributed.GradBucket.step`, which a
  bucket sent again in the same step does not advance;
* change it only in :meth:`~pyro_distributed.Reducing.commit`, which runs
  once for each result a step keeps, after all of the step's buckets
  arrived, and only if every gradient is finite on every worker; a result
  dropped (:meth:`~pyro_distributed.Reducing.drop`: the bucket is sent
  again, or the step runs without it) and a skipped step never commit;
* return it from :meth:`~pyro_distributed.CommHook.state_dict` as plain data
  (tensors, numbers, strings, lists, dicts), which checkpoints save for every
  worker, and take it back in :meth:`~pyro_distributed.CommHook.load_state_dict`;
  loading ``{}`` starts afresh, and state of another configuration is a
  ``ValueError``. Replace tensors rather than change them in place: a state
  dict handed out must keep its values;
* serve one optimizer: a second optimizer made with the same hook, while the
  first lives, is refused (Lightning's strategy gives each optimizer a copy);
* be picklable (a :func:`~pyro_distributed.launch` function that closes over
  it sends it to the workers).

The optimizer tells its hook when the step's state ends: a loaded checkpoint
(:func:`~pyro_distributed.load_checkpoint`, Lightning's, a launch's
``resume=``) hands it the state saved for this worker, and ``optim.forget()``
hands it ``{}``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from ..engines import Engine, Pending

__all__ = [
    "AverageHook",
    "CommHook",
    "Compressor",
    "GradBucket",
    "NarrowedHook",
    "Reducing",
    "Waiting",
    "as_hook",
]


@dataclass(frozen=True)
class GradBucket:
    """One packed bucket, as a hook sees it.

    ``buffer`` is laid out as ``[gradients | tail]``: the members' gradients
    flattened in order (``size`` values), then the tail, small counts that
    must be summed exactly. The hook may write into ``buffer``.

    Example, inside a hook: each member's gradient as a matrix, and the rest::

        for piece in bucket.pieces():
            matrix = piece.reshape(piece.shape[0], -1) if piece.dim() > 1 else None
        counts = bucket.tail()  # sum these exactly
    """

    #: A name unique to the bucket and the same on every worker and in every
    #: process of the run (it follows the members' names): what a stateful
    #: hook keys its state by, and what Horovod pairs collectives by.
    name: str
    buffer: Tensor
    #: How many gradient values the buffer starts with.
    size: int
    #: The members' shapes, in the buffer's order.
    shapes: tuple[torch.Size, ...]
    world_size: int
    #: The bucket packed here (the same object while the exchange keeps its plan).
    owner: object = None
    #: The bucket's place in the step's plan, from 0 (the same on every worker).
    index: int = 0
    #: Whether it is the last bucket in the step's order, the one that leaves
    #: at the optimizer call (a bucket sent again because a gradient changed
    #: after it left may follow it, in the same step; a step that falls back
    #: from overlap, when workers disagreed on the parameters, sends every
    #: bucket again with a last one of its own).
    is_last: bool = True
    #: The optimizer steps taken before this one (restored with a
    #: checkpoint); a bucket sent again in the same step carries the same.
    step: int = 0

    def gradients(self) -> Tensor:
        """The gradient values (a view of ``buffer``)."""
        return self.buffer[: self.size]

    def tail(self) -> Tensor:
        """The values after the gradients, to be summed exactly (a view)."""
        return self.buffer[self.size :]

    def pieces(self) -> list[Tensor]:
        """Each member's gradient, a view of ``buffer`` shaped like the member."""
        numels = [shape.numel() for shape in self.shapes]
        pieces = torch.split(self.gradients(), numels)
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes, strict=True)]


class Reducing(ABC):
    """A hook's result under way.

    Example, the result of one all-reduce that sums a bucket in place, its
    gradients divided afterwards::

        class Divided(pd.Reducing):
            def __init__(self, pending, bucket):
                self.pending, self.bucket = pending, bucket

            def wait(self):
                self.pending.wait()
                self.bucket.gradients().div_(self.bucket.world_size)
                return self.bucket.buffer
    """

    @abstractmethod
    def wait(self) -> Tensor:
        """The bucket, its gradients averaged and its tail summed (may start
        further collectives; every worker waits in the same order). Changes no
        state the hook keeps across steps: that is :meth:`commit`'s."""

    def commit(self) -> None:  # noqa: B027 (a default that does nothing, by design)
        """The step keeps this result: update what the hook keeps across steps.
        Called once, after every bucket of the step arrived, and only when
        every gradient is finite on every worker. By default there is nothing
        to keep."""

    def drop(self) -> None:
        """Finish what is on the wire and keep nothing (the bucket is sent again,
        or the step runs without it): :meth:`commit` is not called. By
        default, :meth:`wait`."""
        self.wait()


class CommHook(ABC):
    """How a bucket travels (module docstring). Subclass it and define
    ``__call__``; the defaults below suit a hook that averages in the
    bucket's own type.

    Example, a hook that sums the bucket in place and divides its gradients
    afterwards (at two workers, the default average bitwise)::

        class SumThenDivide(pd.CommHook):
            in_place = True

            def __call__(self, bucket, engine):
                pending = engine.allreduce_async_(bucket.buffer, "sum", bucket.name)
                return Divided(pending, bucket)  # the example of Reducing

        optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}), comm_hook=SumThenDivide())

    .. warning::
        A hook runs on every worker for every bucket, in the same order; it
        must start the same collectives everywhere, and whatever it keeps
        across steps must leave every worker's result identical.
    """

    #: Whether :meth:`Reducing.wait` returns ``bucket.buffer`` itself; then a
    #: bucket keeps its buffer, and its members' views, from step to step.
    in_place: bool = False

    @abstractmethod
    def __call__(self, bucket: GradBucket, engine: Engine) -> Reducing:
        """Start the bucket's reduction on ``engine``."""

    def tail_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The type a bucket of ``dtype`` sums its tail in, or ``None`` where
        the tail cannot travel in the bucket (the agreement header then
        travels on its own)."""
        return dtype

    def alone_(self, tensor: Tensor, world_size: int) -> Tensor:
        """``tensor``, in place, as the hook would average it if every other
        worker sent zeros: a gradient that never travels (a local parameter's)."""
        return tensor.div_(world_size)

    def to_mean(self, world_size: int) -> float:
        """What turns a reduced gradient into a mean over workers: the divisor."""
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        """What this worker's hook keeps across steps, as plain data (saved in
        checkpoints, one per worker); ``{}`` for a hook that keeps nothing."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`); ``{}`` starts afresh.

        :raises ValueError: for state this hook does not keep.
        """
        if state:
            raise ValueError(
                f"the comm_hook {self!r} keeps no state across steps, but was given "
                f"state with entries {sorted(map(str, state))}: it was saved with another hook"
            )


class Waiting(Reducing):
    """An engine's pending collective, then ``finish()`` for the result."""

    def __init__(self, pending: Pending, finish: Callable[[], Tensor]) -> None:
        self._pending, self._finish = pending, finish

    def wait(self) -> Tensor:
        self._pending.wait()
        return self._finish()

    def drop(self) -> None:
        self._pending.wait()


class Compressor(Protocol):
    """Turns a buffer into what goes on the wire and back.

    Horovod's ``hvd.Compression.none`` and ``hvd.Compression.fp16`` have this shape.
    """

    def compress(self, tensor: Tensor) -> tuple[Tensor, Any]: ...

    def decompress(self, tensor: Tensor, ctx: Any) -> Tensor: ...


class AverageHook(CommHook):
    """One all-reduce of the bucket, scaled around the sum, optionally compressed.

    :param op: ``"mean"`` or ``"sum"``, as :class:`~.averager.Reduction` says.
    :param predivide: with ``"mean"``, the part of the division made before the sum.
    :param compression: a stateless compressor applied to the whole bucket.

    With ``op="mean"`` the division by the world size is split around the sum
    as Horovod's ``gradient_predivide_factor`` splits it; a compressor that
    narrows the type divides by the whole world size before the sum. Only the
    gradients are scaled: the tail's sum stays the exact integers it was.
    A local gradient is scaled by the same operations (:meth:`alone_`), so it
    comes out bitwise as the exchange would have averaged it.
    """

    def __init__(
        self,
        op: Literal["mean", "sum"] = "mean",
        predivide: float = 1.0,
        compression: Compressor | None = None,
    ) -> None:
        self.op, self.predivide, self.compression = op, predivide, compression
        self.in_place = compression is None
        self._narrows: dict[torch.dtype, torch.dtype | None] = {}

    def __call__(self, bucket: GradBucket, engine: Engine) -> Reducing:
        wire, context = self.encode(bucket.buffer, bucket.size, bucket.world_size)
        pending = engine.allreduce_async_(wire, "sum", bucket.name)
        return Waiting(pending, lambda: self.decode(wire, context, bucket.size, bucket.world_size))

    def encode(self, flat: Tensor, size: int, world_size: int) -> tuple[Tensor, Any]:
        """Scale the first ``size`` values of ``flat`` for the sum (in place),
        and compress; what goes on the wire, and the compressor's context."""
        _scaled(flat[:size], self._scales(flat.dtype, world_size)[0])
        if self.compression is None:
            return flat, None
        return self.compression.compress(flat)

    def decode(self, wire: Tensor, context: Any, size: int, world_size: int) -> Tensor:
        """The summed wire back as a flat bucket, its first ``size`` values averaged."""
        flat = wire if self.compression is None else self.compression.decompress(wire, context)
        _scaled(flat[:size], self._scales(flat.dtype, world_size)[1])
        return flat

    def alone_(self, tensor: Tensor, world_size: int) -> Tensor:
        wire, context = self.encode(tensor, tensor.numel(), world_size)
        averaged = self.decode(wire, context, tensor.numel(), world_size)
        return averaged if averaged is tensor else tensor.copy_(averaged)

    def tail_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        if self.compression is None:
            return dtype
        if dtype not in self._narrows:
            # Asked once per dtype: a compressor here is stateless (Horovod's are).
            # device='cpu': only the type of what the compressor returns is read.
            probe = torch.zeros(2, dtype=dtype, device="cpu")
            wire = self.compression.compress(probe)[0]
            self._narrows[dtype] = wire.dtype if wire.shape == probe.shape else None
        return self._narrows[dtype]

    def to_mean(self, world_size: int) -> float:
        return 1.0 if self.op == "mean" else float(world_size)

    def _scales(self, dtype: torch.dtype, world_size: int) -> tuple[float, float]:
        """Factors before and after the sum, for a bucket of ``dtype``."""
        if self.op == "sum":
            return 1.0, 1.0
        narrowed = self.compression is not None and self.tail_dtype(dtype) != dtype
        before = world_size if narrowed else self.predivide
        return 1.0 / before, before / world_size

    def __repr__(self) -> str:
        extra = f", compression={self.compression!r}" if self.compression is not None else ""
        return f"AverageHook(op={self.op!r}, predivide={self.predivide}{extra})"


def _scaled(tensor: Tensor, factor: float) -> Tensor:
    return tensor.mul_(factor) if factor != 1.0 else tensor


class NarrowedHook(CommHook):
    """Another hook, run on the bucket cast to a narrower type: what
    ``compression="fp16"`` (or ``"bf16"``) does together with ``comm_hook=``.

    The bucket is cast (gradients and tail) before ``hook`` starts, ``hook``
    reduces the narrow copy, and its result is cast back into the bucket's
    type. The tail is summed in the narrow type, exactly (riders are cut in
    pieces small enough for it). Unlike ``compression`` alone, which divides
    by the world size before the sum, the wrapped hook decides where it
    divides: one that sums first (as :class:`~.low_rank.LowRankHook` does)
    overflows fp16 above 65504 where the sum of W gradients does (a non-finite
    step, skipped or refused by ``nonfinite`` on every worker alike); bf16
    keeps fp32's range.

    :param hook: the hook to run in the narrow type.
    :param compressor: the cast, for example ``pyro_distributed.exchange.compression.FP16``.

    Example, low-rank factors sent in bf16::

        optim = pd.DistributedOptimizer(
            pyro.optim.Adam({"lr": 1e-3}), comm_hook=pd.LowRankHook(rank=4), compression="bf16"
        )
    """

    in_place = False

    def __init__(self, hook: CommHook, compressor: Compressor) -> None:
        self.hook, self.compressor = hook, compressor

    def __call__(self, bucket: GradBucket, engine: Engine) -> Reducing:
        wire, context = self.compressor.compress(bucket.buffer)
        narrow = dataclasses.replace(bucket, buffer=wire)
        return _Widened(self.hook(narrow, engine), self.compressor, context)

    def tail_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        # device='cpu': only the type of what the compressor returns is read.
        probe = torch.zeros(2, dtype=dtype, device="cpu")
        wire = self.compressor.compress(probe)[0]
        return self.hook.tail_dtype(wire.dtype) if wire.shape == probe.shape else None

    def alone_(self, tensor: Tensor, world_size: int) -> Tensor:
        wire, context = self.compressor.compress(tensor)
        averaged = self.hook.alone_(wire, world_size)
        return tensor.copy_(self.compressor.decompress(averaged, context))

    def to_mean(self, world_size: int) -> float:
        return self.hook.to_mean(world_size)

    def state_dict(self) -> dict[str, Any]:
        return self.hook.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.hook.load_state_dict(state)

    def __repr__(self) -> str:
        return f"NarrowedHook({self.hook!r}, {self.compressor!r})"


class _Widened(Reducing):
    """A narrowed bucket's reduction, cast back to the bucket's type."""

    def __init__(self, inner: Reducing, compressor: Compressor, context: Any) -> None:
        self._inner, self._compressor, self._context = inner, compressor, context

    def wait(self) -> Tensor:
        return self._compressor.decompress(self._inner.wait(), self._context)

    def commit(self) -> None:
        self._inner.commit()

    def drop(self) -> None:
        self._inner.drop()


class _FunctionHook(CommHook):
    def __init__(self, function: Callable[[GradBucket, Engine], Reducing]) -> None:
        self._function = function

    def __call__(self, bucket: GradBucket, engine: Engine) -> Reducing:
        return self._function(bucket, engine)

    def __repr__(self) -> str:
        return f"as_hook({getattr(self._function, '__name__', self._function)!r})"


def as_hook(hook: CommHook | Callable[[GradBucket, Engine], Reducing]) -> CommHook:
    """``hook`` as a :class:`CommHook`: a plain function ``(bucket, engine) ->
    Reducing`` gets the defaults (averages in the bucket's type, out of place)."""
    if isinstance(hook, CommHook):
        return hook
    if not callable(hook):
        raise TypeError(f"comm_hook must be a CommHook or a function, got {type(hook).__name__}")
    return _FunctionHook(hook)
