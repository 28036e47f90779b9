"""Buckets: planning, a bucket's layout (gradients, presence flags, norm slot,
riders), and its resident buffer on real workers: gradients as the same views
step after step, bitwise the averages a new tensor per step gives, declined
where a gradient is already a view into the buffer (gradients zeroed in
place), and never a copy's broadcast hiding a parameter resized in place."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.exchange.averager import GradientAverager, Reduction
from pyro_distributed.exchange.hooks import AverageHook
from pyro_distributed.exchange.layout import Layout, plan_layouts

from ..support.harness import run_workers


def test_buckets_group_by_dtype_in_order_of_first_appearance() -> None:
    tensors = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(4)]
    buckets = plan_layouts(tensors, cap_bytes=1 << 20)
    assert [(b.dtype, b.members, b.numels) for b in buckets] == [
        (torch.float32, (0, 2), [3, 4]),
        (torch.float64, (1,), [2]),
    ]


def test_buckets_split_at_the_cap_and_oversized_tensors_travel_alone() -> None:
    tensors = [torch.zeros(2), torch.zeros(2), torch.zeros(10), torch.zeros(1)]
    buckets = plan_layouts(tensors, cap_bytes=16)  # four float32 values
    assert [b.members for b in buckets] == [(0, 1), (2,), (3,)]


def test_no_tensors_no_buckets() -> None:
    assert plan_layouts([], cap_bytes=16) == []


def test_groups_never_share_a_bucket() -> None:
    tensors = [torch.zeros(1) for _ in range(4)]
    buckets = plan_layouts(tensors, cap_bytes=1 << 20, group_of=[0, 1, 0, 1])
    assert [b.members for b in buckets] == [(0, 2), (1, 3)]


def test_only_float32_and_float64_buckets_get_a_norm_slot() -> None:
    tensors = [torch.zeros(2), torch.zeros(2, dtype=torch.float16), torch.zeros(2).double()]
    buckets = plan_layouts(tensors, cap_bytes=1 << 20, norm_slot=True)
    assert [(b.dtype, b.norm_slot) for b in buckets] == [
        (torch.float32, True),
        (torch.float16, False),
        (torch.float64, True),
    ]
    assert not any(b.norm_slot for b in plan_layouts(tensors, cap_bytes=1 << 20))


def _with_grads(*grads: torch.Tensor | None) -> list[torch.Tensor]:
    tensors = []
    for grad, shape in zip(grads, [(2,), (2, 2), (1,)], strict=True):
        tensor = torch.zeros(shape, requires_grad=True)
        tensor.grad = grad
        tensors.append(tensor)
    return tensors


def test_a_packed_bucket_is_gradients_then_flags_then_norm_then_riders() -> None:
    tensors = _with_grads(torch.tensor([1.0, 2.0]), None, torch.tensor([5.0]))
    (bucket,) = plan_layouts(tensors, cap_bytes=1 << 20, norm_slot=True)
    assert (bucket.members, bucket.numels, bucket.size) == ((0, 1, 2), [2, 4, 1], 7)
    flat = bucket.pack(tensors, riders=[7.0, 8.0])
    # 7 gradient values (zeros for the missing one), 3 flags, the norm slot, 2 riders.
    assert flat.tolist() == [1.0, 2.0, 0, 0, 0, 0, 5.0, 1.0, 0.0, 1.0, 0.0, 7.0, 8.0]
    assert bucket.gradients(flat).tolist() == [1.0, 2.0, 0, 0, 0, 0, 5.0]
    assert [piece.tolist() for piece in bucket.split_gradients(flat)] == [
        [1.0, 2.0],
        [0.0] * 4,
        [5.0],
    ]
    assert bucket.present(bucket.tail(flat)) == [True, False, True]
    assert bucket.riders(bucket.tail(flat)) == [7.0, 8.0]
    bucket.set_norm(flat, torch.tensor(30.0))
    assert bucket.norm(flat) == 30.0
    assert flat[bucket.size + 3] == 30.0, "the norm slot follows the flags"
    assert bucket.riders(bucket.tail(flat)) == [7.0, 8.0], "riders stay where they were"


def test_summed_buckets_say_which_members_any_worker_had() -> None:
    mine = _with_grads(torch.ones(2), None, None)
    theirs = _with_grads(None, None, torch.ones(1))
    (bucket,) = plan_layouts(mine, cap_bytes=1 << 20)
    summed = bucket.pack(mine, riders=[1.0]) + bucket.pack(theirs, riders=[2.0])
    assert bucket.present(bucket.tail(summed)) == [True, False, True]
    assert bucket.riders(bucket.tail(summed)) == [3.0]


def test_without_a_norm_slot_riders_follow_the_flags_and_norms_are_refused() -> None:
    tensors = _with_grads(torch.ones(2), torch.ones(2, 2), torch.ones(1))
    (bucket,) = plan_layouts(tensors, cap_bytes=1 << 20)
    flat = bucket.pack(tensors, riders=[4.0])
    assert len(flat) == bucket.size + 3 + 1
    assert bucket.riders(bucket.tail(flat)) == [4.0]
    with pytest.raises(AssertionError, match="no norm slot"):
        bucket.norm(flat)


def test_sparse_and_graph_carrying_gradients_pack_as_dense_values() -> None:
    sparse = torch.zeros(3, requires_grad=True)
    sparse.grad = torch.sparse_coo_tensor([[1]], [4.0], (3,), check_invariants=True)
    graph = torch.zeros(2, requires_grad=True)
    source = torch.ones(2, requires_grad=True)
    graph.grad = source * 3.0  # carries a graph, as create_graph=True leaves it
    bucket = Layout(torch.device("cpu"), torch.float32, (0, 1), [3, 2])
    flat = bucket.pack([sparse, graph])
    assert not flat.requires_grad
    assert bucket.gradients(flat).tolist() == [0.0, 4.0, 0.0, 3.0, 3.0]


def test_a_parameter_resized_in_place_is_named_instead_of_mis_split() -> None:
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    bucket = plan_layouts(params, cap_bytes=1 << 20)[0]
    for param in params:
        param.grad = torch.ones_like(param)
    assert bucket.pack(params).tolist() == [1.0] * 5 + [1.0, 1.0]
    params[1].data = torch.zeros(4)
    params[1].grad = torch.ones(4)
    with pytest.raises(pd.PyroDistributedError, match=r"now \[4\] \(4 values, planned 2\)"):
        bucket.pack(params)


def test_pack_is_the_same_with_and_without_every_gradient() -> None:
    params = [torch.zeros(2, 2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    bucket = plan_layouts(params, cap_bytes=1 << 20, norm_slot=True)[0]
    params[0].grad = torch.arange(4.0).reshape(2, 2)
    params[1].grad = torch.tensor([4.0, 5.0, 6.0])
    whole = bucket.pack(params, riders=[7.0, 8.0])
    assert whole.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0, 1.0, 0.0, 7.0, 8.0]
    params[1].grad = None
    partial = bucket.pack(params, riders=[7.0, 8.0])
    assert partial.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 7.0, 8.0]
    # A gradient that carries a graph (create_graph=True) travels detached.
    params[1].grad = torch.ones(3, requires_grad=True) * 2
    assert not bucket.pack(params).requires_grad


# -- resident buffers

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
    path (a new tensor from ``Layout.pack``, the same encode, sum and decode)."""
    engine = pd.current_engine()
    params = [torch.zeros(shape, requires_grad=True) for shape in SHAPES]
    averager = GradientAverager(engine, 2**20, Reduction())
    plan = averager.plan([f"p{i}" for i in range(len(params))], params)
    for step in range(3):
        for param, grad in zip(params, _grads(pd.rank(), step), strict=True):
            param.grad = grad
        if step == 2:
            layout = plan.buckets[0].layout
            hook, world = AverageHook(), engine.world_size
            wire, context = hook.encode(layout.pack(params), layout.size, world)
            engine.allreduce_([wire], op="sum")
            expected = layout.split_gradients(hook.decode(wire, context, layout.size, world))
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
