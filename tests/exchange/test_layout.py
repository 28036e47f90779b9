"""Bucket planning, a bucket's layout (gradients, presence flags, norm slot, riders),
and broadcasting values in fused buffers."""

from __future__ import annotations

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.exchange.layout import Bucket, broadcast_values_, plan_buckets

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


def test_groups_never_share_a_bucket() -> None:
    tensors = [torch.zeros(1) for _ in range(4)]
    buckets = plan_buckets(tensors, cap_bytes=1 << 20, group_of=[0, 1, 0, 1])
    assert [b.members for b in buckets] == [(0, 2), (1, 3)]


def test_only_float32_and_float64_buckets_get_a_norm_slot() -> None:
    tensors = [torch.zeros(2), torch.zeros(2, dtype=torch.float16), torch.zeros(2).double()]
    buckets = plan_buckets(tensors, cap_bytes=1 << 20, norm_slot=True)
    assert [(b.dtype, b.norm_slot) for b in buckets] == [
        (torch.float32, True),
        (torch.float16, False),
        (torch.float64, True),
    ]
    assert not any(b.norm_slot for b in plan_buckets(tensors, cap_bytes=1 << 20))


def _with_grads(*grads: torch.Tensor | None) -> list[torch.Tensor]:
    tensors = []
    for grad, shape in zip(grads, [(2,), (2, 2), (1,)], strict=True):
        tensor = torch.zeros(shape, requires_grad=True)
        tensor.grad = grad
        tensors.append(tensor)
    return tensors


def test_a_packed_bucket_is_gradients_then_flags_then_norm_then_riders() -> None:
    tensors = _with_grads(torch.tensor([1.0, 2.0]), None, torch.tensor([5.0]))
    (bucket,) = plan_buckets(tensors, cap_bytes=1 << 20, norm_slot=True)
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
    (bucket,) = plan_buckets(mine, cap_bytes=1 << 20)
    summed = bucket.pack(mine, riders=[1.0]) + bucket.pack(theirs, riders=[2.0])
    assert bucket.present(bucket.tail(summed)) == [True, False, True]
    assert bucket.riders(bucket.tail(summed)) == [3.0]


def test_without_a_norm_slot_riders_follow_the_flags_and_norms_are_refused() -> None:
    tensors = _with_grads(torch.ones(2), torch.ones(2, 2), torch.ones(1))
    (bucket,) = plan_buckets(tensors, cap_bytes=1 << 20)
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
    bucket = Bucket(torch.device("cpu"), torch.float32, (0, 1), [3, 2])
    flat = bucket.pack([sparse, graph])
    assert not flat.requires_grad
    assert bucket.gradients(flat).tolist() == [0.0, 4.0, 0.0, 3.0, 3.0]


def _broadcast_from_worker_zero() -> list[list[float]]:
    rank = pd.rank()
    tensors = [torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank), torch.tensor(rank)]
    broadcast_values_(pd.current_engine(), tensors, cap_bytes=8)  # several buffers
    return [t.reshape(-1).tolist() for t in tensors]


def test_broadcast_values_gives_every_worker_worker_zeros_values_in_place() -> None:
    for values in run_workers(_broadcast_from_worker_zero, world_size=3):
        assert values == [[0.0, 0.0], [10.0, 10.0, 10.0], [0]]


def test_a_parameter_resized_in_place_is_named_instead_of_mis_split() -> None:
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    bucket = plan_buckets(params, cap_bytes=1 << 20)[0]
    for param in params:
        param.grad = torch.ones_like(param)
    assert bucket.pack(params).tolist() == [1.0] * 5 + [1.0, 1.0]
    params[1].data = torch.zeros(4)
    params[1].grad = torch.ones(4)
    with pytest.raises(pd.PyroDistributedError, match=r"now \[4\] \(4 values, planned 2\)"):
        bucket.pack(params)


def test_pack_is_the_same_with_and_without_every_gradient() -> None:
    params = [torch.zeros(2, 2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    bucket = plan_buckets(params, cap_bytes=1 << 20, norm_slot=True)[0]
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
