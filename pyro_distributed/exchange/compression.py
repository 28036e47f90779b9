"""Gradient compression for the wire: fp16 or bf16 instead of fp32.

A fused buffer is cast to the narrow type before the all-reduce and back
afterwards, halving the bytes each worker sends. The averaging divides by the
world size *before* summation (see :class:`~pyro_distributed.exchange.Reduction`),
so a sum of W gradients cannot overflow where one gradient would not.

Error against uncompressed averaging, per element, with g_i the workers'
gradients and u the unit roundoff (2**-11 for fp16, 2**-8 for bf16): casting
each g_i / W costs at most u |g_i| / W, and each of the W - 1 additions at most
u times the partial sum, so the result is within about W * u * mean_i |g_i| of
the exact average (plus the absolute error of fp16's subnormal range, below
6e-5). fp16 also overflows above 65504: such a gradient becomes Inf, and the
optimizer's ``nonfinite`` policy skips or raises on every worker alike. bf16
keeps fp32's range with less precision.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


class CastCompressor:
    """Sends floating-point buffers as ``dtype``; leaves other dtypes alone."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def compress(self, tensor: Tensor) -> tuple[Tensor, torch.dtype]:
        if not tensor.is_floating_point():
            return tensor, tensor.dtype
        return tensor.to(self.dtype), tensor.dtype

    def decompress(self, tensor: Tensor, ctx: torch.dtype) -> Tensor:
        return tensor.to(ctx)

    def __repr__(self) -> str:
        return f"CastCompressor({self.dtype})"


FP16 = CastCompressor(torch.float16)
BF16 = CastCompressor(torch.bfloat16)

Compression = Literal["none", "fp16", "bf16"]


def compressor(name: Compression) -> CastCompressor | None:
    """The compressor called ``name``, or ``None`` for ``"none"``."""
    choices = {"none": None, "fp16": FP16, "bf16": BF16}
    if name not in choices:
        raise ValueError(f"compression must be 'none', 'fp16' or 'bf16', got {name!r}")
    return choices[name]
