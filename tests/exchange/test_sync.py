"""GradientSync on its own: plain tensors, names and a catalog dict, no Pyro.

Two real workers (gloo on 127.0.0.1) exchange gradients of leaf tensors made
by the test; every expectation is computed from what each worker put in.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.exchange.averager import Reduction
from pyro_distributed.exchange.sync import GradientSync

from ..support.harness import CountingEngine, run_workers

CAP = 16  # bytes: four float32 values, so that w and v travel in buckets of their own


def leaves() -> dict[str, torch.Tensor]:
    """Tensors that start different on every worker."""
    rank = pd.rank()
    return {
        "w": torch.full((3,), 1.0 + rank, requires_grad=True),
        "v": torch.full((2,), -1.0 - rank, requires_grad=True),
    }


def backward(tensors: dict[str, torch.Tensor], step: int) -> None:
    scale = (pd.rank() + 1.0) * (step + 1)
    sum((t * scale * (i + 1)).sum() for i, t in enumerate(tensors.values())).backward()  # type: ignore[union-attr]


def exchanges(overlap: bool, steps: int) -> list[dict[str, Any]]:
    sync = GradientSync(pd.current_engine(), CAP, Reduction(), overlap=overlap)
    tensors = leaves()
    plan = sync.plan(tensors)
    records = []
    for step in range(steps):
        backward(tensors, step)
        done = sync.exchange(plan, lambda: tensors)
        records.append(
            {
                "names": done.names,
                "grads": {n: t.grad.clone() for n, t in zip(done.names, done.tensors, strict=True)},  # type: ignore[union-attr]
                "values": {n: t.detach().clone() for n, t in tensors.items()},
                "borrowed": done.borrowed,
                "finite": done.finite,
                "armed": sync.overlap_armed,
                "overlaps": sync.overlaps,
                "buckets": sync.bucket_count,
            }
        )
        for t in tensors.values():
            t.grad = None
    return records


@pytest.mark.parametrize("overlap", [True, False])
def test_exchange_averages_every_gradient_and_starts_from_worker_zeros_values(
    overlap: bool,
) -> None:
    steps = 5
    results = run_workers(exchanges, overlap, steps)
    for rank, records in enumerate(results):
        for step, record in enumerate(records):
            # Worker r's gradient of tensor i is (r + 1) * (step + 1) * (i + 1); mean over r: 1.5x.
            mean = 1.5 * (step + 1)
            assert record["names"] == ("v", "w"), "sorted by name"
            assert torch.equal(record["grads"]["w"], torch.full((3,), mean))
            assert torch.equal(record["grads"]["v"], torch.full((2,), 2 * mean))
            assert record["borrowed"] == frozenset() and record["finite"] is True
            assert record["overlaps"] is overlap
            assert record["buckets"] == 2
            # The values are worker 0's on every worker from the first exchange on.
            assert torch.equal(record["values"]["w"], torch.full((3,), 1.0)), rank
            assert torch.equal(record["values"]["v"], torch.full((2,), -1.0)), rank
        # With overlap, buckets leave during backward from the third step on.
        armed = [record["armed"] for record in records]
        assert armed == ([False, True, True, True, True] if overlap else [False] * steps)
    # And bitwise the same numbers the other way (with overlap or without).
    other_way = run_workers(exchanges, not overlap, steps)
    for mine, other in zip(results, other_way, strict=True):
        for a, b in zip(mine, other, strict=True):
            assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in ("v", "w"))


def borrowing() -> dict[str, Any]:
    sync = GradientSync(pd.current_engine(), CAP, Reduction())
    catalog = leaves()
    given = dict(catalog) if pd.rank() == 1 else {"w": catalog["w"]}
    backward(given, 0)
    done = sync.exchange(sync.plan(given), lambda: catalog)
    return {
        "names": done.names,
        "borrowed": sorted(done.borrowed),
        "v_grad": catalog["v"].grad.tolist(),  # type: ignore[union-attr]
        "w_grad": catalog["w"].grad.tolist(),  # type: ignore[union-attr]
        "same_objects": all(catalog[n] is t for n, t in zip(done.names, done.tensors, strict=True)),
    }


def test_a_tensor_given_only_elsewhere_is_borrowed_from_the_catalog() -> None:
    first, second = run_workers(borrowing)
    assert first["names"] == second["names"] == ("v", "w")
    assert first["borrowed"] == ["v"] and second["borrowed"] == []
    # Worker 1 alone gave v a gradient (4 per value): the average is half of it.
    assert first["v_grad"] == second["v_grad"] == [2.0, 2.0]
    # w: 1 per value on worker 0, 2 on worker 1.
    assert first["w_grad"] == second["w_grad"] == [1.5, 1.5, 1.5]
    assert first["same_objects"] and second["same_objects"]


def disagreement() -> str:
    sync = GradientSync(pd.current_engine(), CAP, Reduction(), catalog_name="module")
    catalog = leaves()
    if pd.rank() == 1:
        catalog["extra"] = torch.zeros(4, requires_grad=True)
    backward(catalog, 0)
    with pytest.raises(pd.PyroDistributedError) as info:
        sync.exchange(sync.plan(catalog), lambda: catalog)
    return str(info.value)


def test_tensors_that_cannot_be_reconciled_raise_on_every_worker() -> None:
    first, second = run_workers(disagreement)
    assert first == second
    assert (
        "parameter 'extra' is used on worker 1 but does not exist in the module of worker 0"
        in first
    )


def forgetting() -> dict[str, Any]:
    engine = CountingEngine(pd.current_engine())
    sync = GradientSync(engine, CAP, Reduction(), overlap=True)
    tensors = leaves()
    plan = sync.plan(tensors)
    for step in range(3):
        backward(tensors, step)
        sync.exchange(plan, lambda: tensors)
        for t in tensors.values():
            t.grad = None
    armed_before = sync.overlap_armed
    if pd.rank() == 1:  # values drift apart behind the exchange's back
        with torch.no_grad():
            tensors["w"].add_(5.0)
    backward(tensors, 3)
    sync.exchange(plan, lambda: tensors)
    drifted = tensors["w"].detach().clone()
    for t in tensors.values():
        t.grad = None
    sync.close()  # the epoch ends: the overlap's hooks come off
    sync = GradientSync(engine, CAP, Reduction(), overlap=True)
    plan = sync.plan(tensors)
    armed_after_forget = sync.overlap_armed
    engine.calls.clear()
    backward(tensors, 4)
    sync.exchange(plan, lambda: tensors)
    return {
        "armed_before": armed_before,
        "drifted": drifted,
        "armed_after_forget": armed_after_forget,
        "calls": list(engine.calls),
        "w": tensors["w"].detach().clone(),
    }


def test_a_new_exchange_treats_every_tensor_as_new_and_the_closed_one_sends_nothing() -> None:
    first, second = run_workers(forgetting)
    for result in (first, second):
        assert result["armed_before"] is True
        assert result["armed_after_forget"] is False
        # Worker 0's values are sent again, in the two buckets the cap makes.
        assert result["calls"] == [("allreduce_max", 1), ("broadcast", 2), ("allreduce_sum", 2)]
    # Known tensors are not re-sent: the drift survives an ordinary exchange...
    assert not torch.equal(first["drifted"], second["drifted"])
    # ...and a new exchange has every worker hold worker 0's values again.
    assert torch.equal(first["w"], second["w"])
    assert torch.equal(first["w"], first["drifted"])


def nonfinite_and_norms() -> dict[str, Any]:
    sync = GradientSync(
        pd.current_engine(), 1 << 20, Reduction(), overlap=False, measure_norms=True
    )
    w = torch.zeros(2, requires_grad=True)
    w.grad = torch.tensor([1.0, 3.0]) * (pd.rank() + 1)
    plan = sync.plan({"w": w})
    finite = sync.exchange(plan, lambda: {"w": w}).finite
    norms = sync.squared_norms()
    w.grad = torch.tensor([float("nan") if pd.rank() == 0 else 1.0, 1.0])
    return {
        "finite": finite,
        "norms": norms,
        "nan": sync.exchange(plan, lambda: {"w": w}).finite,
    }


def test_norms_are_measured_and_a_non_finite_average_is_reported_everywhere() -> None:
    for result in run_workers(nonfinite_and_norms):
        assert result["finite"] is True and result["nan"] is False
        # |g_0|^2 = 10, |g_1|^2 = 40: mean 25; the mean gradient [1.5, 4.5]: 22.5.
        assert result["norms"] == pytest.approx((25.0, 22.5))
