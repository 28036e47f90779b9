"""Resident bucket buffers: gradients as the same views step after step, on real workers.

The views must give bitwise the averages a new tensor per step gave, decline
where a gradient is already a view into the buffer (gradients zeroed in
place), and never let a copy's broadcast hide a parameter resized in place.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.exchange.averager import GradientAverager, Reduction

from ..harness import run_workers

SHAPES = [(3,), (2, 2), (), (5,)]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def averaged_three_steps() -> dict[str, Any]:
    params = [torch.zeros(shape, requires_grad=True) for shape in SHAPES]
    averager = GradientAverager(pd.current_engine(), 2**20, Reduction())
    plan = averager.plan([f"p{i}" for i in range(len(params))], params)
    views, exact = [], []
    for step in range(3):
        for param, grad in zip(params, _grads(pd.rank(), step), strict=True):
            param.grad = grad  # a new tensor each step, as Pyro's zero_grads leaves
        assert averager.average_(plan)
        views.append([param.grad for param in params])
        mine, theirs = _grads(0, step), _grads(1, step)
        exact.append(
            all(
                torch.equal(param.grad, (a + b) * 0.5)  # type: ignore[arg-type]
                for param, a, b in zip(params, mine, theirs, strict=True)
            )
        )
    same = [all(a is b for a, b in zip(views[0], later, strict=True)) for later in views[1:]]
    return {"exact": exact, "same_views": same}


def test_gradients_are_the_same_views_step_after_step_and_bitwise_the_average() -> None:
    for result in run_workers(averaged_three_steps):
        assert result["exact"] == [True, True, True]
        assert result["same_views"] == [True, True], "views made once, not per step"


def resident_against_a_new_tensor() -> bool:
    """Three steps through the resident buffer; the last one again by the old
    path (a new tensor from ``Bucket.pack``, the same encode, sum and decode)."""
    engine = pd.current_engine()
    params = [torch.zeros(shape, requires_grad=True) for shape in SHAPES]
    averager = GradientAverager(engine, 2**20, Reduction())
    plan = averager.plan([f"p{i}" for i in range(len(params))], params)
    for step in range(3):
        for param, grad in zip(params, _grads(pd.rank(), step), strict=True):
            param.grad = grad
        if step == 2:
            bucket = plan.buckets[0]
            wire, context = averager.encode(bucket.pack(params))
            engine.allreduce_([wire], op="sum")
            expected = bucket.split_gradients(averager.decode(wire, context))
        assert averager.average_(plan)
    return all(
        torch.equal(param.grad.reshape(-1), want)  # type: ignore[union-attr]
        for param, want in zip(params, expected, strict=True)
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_resident_buffers_average_bitwise_as_a_new_tensor_per_step(world_size: int) -> None:
    # At W=3 the mean multiplies by 1/3, which is not exact: the same bytes in
    # and the same operations are what make the two paths agree.
    assert run_workers(resident_against_a_new_tensor, world_size=world_size) == [True] * world_size


def zeroed_in_place(set_to_none: bool) -> list[torch.Tensor]:
    """Gradients zeroed in place or set to None, a bucket per parameter so that
    buckets leave during backward, and one or two backward passes a step: a
    second pass after a step of one adds into members of buckets already sent."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = pd.DistributedTorchOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), bucket_cap_mb=1e-4
    )
    generator = torch.Generator().manual_seed(pd.rank())
    for step in range(8):
        optimizer.zero_grad(set_to_none=set_to_none)
        for _ in range(1 + step % 2):
            x = torch.randn(4, 6, generator=generator)
            net(x).pow(2).mean().backward()
        optimizer.step()
    assert optimizer.sync is not None and optimizer.sync.overlap_armed
    return [p.detach().clone() for p in net.parameters()]


def test_gradients_zeroed_in_place_give_the_same_parameters_as_set_to_none() -> None:
    zeroed, fresh = run_workers(zeroed_in_place, False), run_workers(zeroed_in_place, True)
    for a, b in zip(zeroed[0], fresh[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(zeroed[0], zeroed[1], strict=True):
        assert torch.equal(a, b), "workers in sync"


def shrunk_in_place() -> str:
    param = torch.zeros(4, requires_grad=True)
    other = torch.zeros(2, requires_grad=True)
    averager = GradientAverager(pd.current_engine(), 2**20, Reduction())
    param.grad, other.grad = torch.ones(4), torch.ones(2)
    plan = averager.plan(["a", "b"], [param, other])
    averager.average_(plan)  # the resident buffer is made
    param.data = torch.zeros(1)  # a gradient of 1 value would broadcast into a view of 4
    param.grad, other.grad = torch.ones(1), torch.ones(2)
    with pytest.raises(pd.PyroDistributedError) as info:
        averager.average_(plan)
    return str(info.value)


def test_a_parameter_shrunk_in_place_is_refused_not_broadcast() -> None:
    for message in run_workers(shrunk_in_place):
        assert "changed its size in place" in message
