"""What a bucket becomes on the wire, where it is summed, and back.

A packed bucket (:mod:`.bucket`) is scaled for the reduction before the sum
and after it, and may be compressed (:mod:`.compression`) on the way:
:class:`Wire` holds those rules for one world size, so that every bucket,
and a gradient that never travels (:meth:`Wire.average_alone_`), is scaled
by the same operations. With ``op="mean"`` the division by the world size
is split around the sum as Horovod's ``gradient_predivide_factor`` splits
it; a compression that narrows the type divides by the whole world size
before the sum, which then cannot overflow the narrow type. Riders (the
agreement header) are left out of the scaling, so their sum stays the exact
integers they were.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
from torch import Tensor


class Compressor(Protocol):
    """Turns a buffer into what goes on the wire and back.

    Horovod's ``hvd.Compression.none`` and ``hvd.Compression.fp16`` have this shape.
    """

    def compress(self, tensor: Tensor) -> tuple[Tensor, Any]: ...

    def decompress(self, tensor: Tensor, ctx: Any) -> Tensor: ...


class Wire:
    """The scaling and compression of every bucket of one exchange (module docstring).

    :param op: ``"mean"`` or ``"sum"``, as :class:`~.averager.Reduction` says.
    :param predivide: with ``"mean"``, the part of the division made before the sum.
    :param compression: applied to each packed bucket before it travels.
    :param world_size: the number of workers.
    """

    def __init__(
        self,
        op: Literal["mean", "sum"],
        predivide: float,
        compression: Compressor | None,
        world_size: int,
    ) -> None:
        self.compression = compression
        self._to_mean = float(world_size) if op == "sum" else 1.0
        # Factors before and after summation, without and with a narrowing
        # compression: fixed for the world size, so worked out once.
        self._plain = _scales(op, predivide, world_size, narrowed=False)
        self._narrowed = _scales(op, predivide, world_size, narrowed=True)

    def encode(self, flat: Tensor, riders: int = 0) -> tuple[Tensor, Any]:
        """Scale (and compress) a packed bucket for the wire, where it is summed.

        The last ``riders`` values of ``flat`` are left out of the scaling:
        small integers, which a cast to the wire's type keeps exact, so that
        their sum stays exact (:meth:`riders_dtype`).
        """
        compression = self.compression
        narrowed = compression is not None and compression.compress(flat[:1])[0].dtype != flat.dtype
        pre = (self._narrowed if narrowed else self._plain)[0]
        _scaled(flat[: flat.numel() - riders] if riders else flat, pre)
        if compression is None:
            return flat, None
        return compression.compress(flat)

    def decode(self, wire: Tensor, context: Any) -> Tensor:
        """The summed wire tensor back as an averaged flat bucket."""
        compression = self.compression
        if compression is None:
            return _scaled(wire, self._plain[1])
        restored = compression.decompress(wire, context)
        narrowed = wire.dtype != restored.dtype
        return _scaled(restored, (self._narrowed if narrowed else self._plain)[1])

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

    def to_mean(self) -> float:
        """What turns a decoded value into a mean over workers: the divisor."""
        return self._to_mean

    def riders_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
        """The type riders travel in, in a bucket of ``dtype`` on ``device``:
        the wire's; or ``None`` where a compressor changes the shape of what it
        sends, and riders cannot ride.

        The riders are left out of any scaling (:meth:`encode`), cast with the
        bucket, and read from the summed wire before it is decoded, so this
        type and the number of workers alone decide whether their sum is
        exact (:func:`~.agreement.digest_bits`).
        """
        probe = torch.zeros(2, dtype=dtype, device=device)
        wire = probe if self.compression is None else self.compression.compress(probe)[0]
        return wire.dtype if wire.shape == probe.shape else None


def _scales(
    op: Literal["mean", "sum"], predivide: float, world_size: int, narrowed: bool
) -> tuple[float, float]:
    """Factors applied before and after summation. A narrowing compression
    divides by the whole world size before the sum, which then cannot
    overflow the narrow type."""
    if op == "sum":
        return 1.0, 1.0
    before = world_size if narrowed else predivide
    return 1.0 / before, before / world_size


def _scaled(tensor: Tensor, factor: float) -> Tensor:
    return tensor.mul_(factor) if factor != 1.0 else tensor
