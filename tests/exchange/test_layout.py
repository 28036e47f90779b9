"""Bucket planning, and fused averaging against per-tensor averaging."""

from __future__ import annotations

import pyro
import torch

import pyro_distributed as pd
from pyro_distributed.exchange.averager import GradientAverager, Reduction
from pyro_distributed.exchange.layout import plan_buckets

from ..harness import run_workers


def test_buckets_group_by_dtype_in_order_of_first_appearance() -> None:
    tensors = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(4)]
    buckets = plan_buckets(tensors, cap_bytes=1 << 20)
    assert [(b.dtype, b.members, b.numels) for b in buckets] == [
        (torch.float32, (0, 2), [3, 4]),
        (torch.float64, (1,), [2]),
    ]


def test_buckets_split_at_the_cap_and_oversized_tensors_travel_alone() -> None:
    tensors = [torch.zeros(2), torch.zeros(2), torch.zeros(10), torch.zeros(1)]
    buckets = plan_buckets(tensors, cap_bytes=16)  # four float32 values
    assert [b.members for b in buckets] == [(0, 1), (2,), (3,)]


def test_no_tensors_no_buckets() -> None:
    assert plan_buckets([], cap_bytes=16) == []


def _fused_and_per_tensor_means() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(pd.rank())
    shapes = [(3,), (2, 2), (), (5,)]
    params = [
        pyro.param(f"p{i}", torch.zeros(shape)).unconstrained() for i, shape in enumerate(shapes)
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    expected = [pd.all_mean(p.grad) for p in params]  # type: ignore[arg-type]
    GradientAverager(pd.current_engine(), 24, Reduction()).average_(["a", "b", "c", "d"], params)
    return [p.grad for p in params], expected  # type: ignore[misc]


def test_fused_average_equals_the_per_tensor_average() -> None:
    for fused, expected in run_workers(_fused_and_per_tensor_means):
        for got, want in zip(fused, expected, strict=True):
            assert got.shape == want.shape
            assert torch.allclose(got, want, rtol=0, atol=1e-7)
