"""GradientAverager: fused averaging across real workers, in place.

Against per-tensor averages; missing gradients; op, pre-division and
compression; groups; non-finite averages; and the squared norms it measures
for the gradient noise scale.
"""

from __future__ import annotations

import pyro
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.exchange.averager import GradientAverager, Reduction, bucket_name
from pyro_distributed.exchange.compression import compressor

from ..support.harness import ENGINES, CountingEngine, run_workers
from ..support.noise_scale import exact_norms


def _fused_and_per_tensor_means() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(pd.rank())
    shapes = [(3,), (2, 2), (), (5,)]
    params = [
        pyro.param(f"p{i}", torch.zeros(shape)).unconstrained() for i, shape in enumerate(shapes)
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    expected = [pd.all_mean(p.grad) for p in params]  # type: ignore[arg-type]
    averager = GradientAverager(pd.current_engine(), 24, Reduction())
    averager.average_(averager.plan(["a", "b", "c", "d"], params))
    return [p.grad for p in params], expected  # type: ignore[misc]


@pytest.mark.parametrize("engine", ENGINES)
def test_fused_average_equals_the_per_tensor_average(engine: str) -> None:
    for fused, expected in run_workers(_fused_and_per_tensor_means, engine=engine):
        for got, want in zip(fused, expected, strict=True):
            assert got.shape == want.shape
            assert torch.allclose(got, want, rtol=0, atol=1e-7)


def averager_norms(op: str, predivide: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The averager's norms with Horovod's op and pre-division, and the exact ones."""
    engine = pd.current_engine()
    params = [torch.zeros(5, requires_grad=True), torch.zeros(3, requires_grad=True)]
    generator = torch.Generator().manual_seed(pd.rank())
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    exact = exact_norms(torch.cat([p.grad.reshape(-1) for p in params]))  # type: ignore[union-attr]
    reduction = Reduction(op=op, predivide=predivide)  # type: ignore[arg-type]
    averager = GradientAverager(engine, 2**20, reduction, measure_norms=True)
    plan = averager.plan(["a", "b"], params)
    assert averager.average_(plan)
    return averager.squared_norms(plan), exact


@pytest.mark.parametrize(("op", "predivide"), [("mean", 2.0), ("sum", 1.0)])
def test_norms_survive_predivision_and_summing(op: str, predivide: float) -> None:
    measured, exact = run_workers(averager_norms, op, predivide, world_size=3)[0]
    assert measured == pytest.approx(exact, rel=1e-5)


def averaged(op: str, predivide: float, missing: str) -> dict[str, object]:
    rank = pd.rank()
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    c = torch.zeros(1, requires_grad=True)
    a.grad = torch.full((2,), float(rank + 1))
    b.grad = None if (missing == "one" and rank == 0) else torch.full((3,), 4.0)
    c.grad = None
    reduction = Reduction(op=op, predivide=predivide)  # type: ignore[arg-type]
    averager = GradientAverager(pd.current_engine(), 1 << 20, reduction)
    finite = averager.average_(averager.plan(["a", "b", "c"], [a, b, c]))
    grads = [None if t.grad is None else t.grad.tolist() for t in (a, b, c)]
    return {"finite": finite, "grads": grads}


@pytest.mark.parametrize(
    ("op", "predivide", "a", "b"),
    [("mean", 1.0, 2.0, 8 / 3), ("mean", 3.0, 2.0, 8 / 3), ("sum", 1.0, 6.0, 8.0)],
)
def test_a_missing_gradient_counts_as_zero_and_one_missing_everywhere_stays_none(
    op: str, predivide: float, a: float, b: float
) -> None:
    for result in run_workers(averaged, op, predivide, "one", world_size=3):
        assert result["finite"] is True
        grad_a, grad_b, grad_c = result["grads"]
        assert grad_a == pytest.approx([a] * 2)
        assert grad_b == pytest.approx([b] * 3)
        assert grad_c is None


def nonfinite_on_one_worker() -> bool:
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.tensor([1.0, float("inf") if pd.rank() == 1 else 1.0])
    averager = GradientAverager(pd.current_engine(), 1 << 20, Reduction())
    return averager.average_(averager.plan(["p"], [p]))


def test_a_non_finite_gradient_anywhere_makes_every_worker_report_it() -> None:
    assert run_workers(nonfinite_on_one_worker) == [False, False]


def grouped_buckets(groups: object) -> tuple[int, list[tuple[str, int]], list[list[float]]]:
    engine = CountingEngine(pd.current_engine())
    params = [torch.zeros(2, requires_grad=True) for _ in range(4)]
    for index, param in enumerate(params):
        param.grad = torch.full((2,), float(index + pd.rank()))
    if groups == "lists":
        groups = [[params[0], params[3]]]
    averager = GradientAverager(engine, 1 << 20, Reduction(groups=groups))  # type: ignore[arg-type]
    plan = averager.plan(["p0", "p1", "p2", "p3"], params)
    averager.average_(plan)
    grads = [p.grad.tolist() for p in params]  # type: ignore[union-attr]
    return len(plan.buckets), engine.calls, grads


@pytest.mark.parametrize(("groups", "buckets"), [(None, 1), (2, 2), ("lists", 3)])
def test_groups_split_the_buckets_without_changing_the_average(
    groups: object, buckets: int
) -> None:
    for count, calls, grads in run_workers(grouped_buckets, groups):
        assert count == buckets
        assert calls == [("allreduce_sum", buckets)], "all buckets in one call"
        assert grads == [[index + 0.5] * 2 for index in range(4)]


class _Halves:
    """A compressor that narrows to float16, as Horovod's fp16 does."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return tensor.half(), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor.to(ctx)


def compressed_large_values() -> list[float]:
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.full((2,), 40000.0 + pd.rank())  # a float16 sum of two would overflow
    averager = GradientAverager(pd.current_engine(), 1 << 20, Reduction(compression=_Halves()))
    assert averager.average_(averager.plan(["p"], [p]))
    return p.grad.tolist()  # type: ignore[union-attr]


def test_a_narrowing_compressor_divides_before_the_sum() -> None:
    for grads in run_workers(compressed_large_values):
        assert grads == pytest.approx([40000.5] * 2, abs=16.0)


def _alone_and_averaged() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per reduction: worker 0's gradient averaged with zeros from the others,
    and the same gradient through ``average_alone_``, which sends nothing."""
    reductions = [
        Reduction(),
        Reduction(op="sum"),
        Reduction(predivide=1.5),
        Reduction(compression=compressor("fp16")),
        Reduction(compression=compressor("bf16")),
    ]
    own = torch.randn(257, generator=torch.Generator().manual_seed(7)) / 3.0
    found = []
    for number, reduction in enumerate(reductions):
        param = pyro.param(f"alone{number}", torch.zeros(257)).unconstrained()
        param.grad = own.clone() if pd.rank() == 0 else torch.zeros(257)
        averager = GradientAverager(pd.current_engine(), 2**20, reduction)
        averager.average_(averager.plan([f"alone{number}"], [param]))
        found.append((param.grad.clone(), averager.average_alone_(own.clone())))
    return found


def test_a_gradient_alone_is_scaled_bitwise_as_its_average_with_zeros() -> None:
    # At W=3 1/W is inexact: the scaling must be the averager's own operations.
    for results in run_workers(_alone_and_averaged, world_size=3):
        for averaged, alone in results:
            assert torch.equal(averaged, alone)


def test_a_buckets_name_follows_all_of_its_members() -> None:
    # Horovod pairs collectives by it and a stateful hook keys its state by it:
    # buckets of different members must not share a name, on any worker.
    assert bucket_name(["p"]) == "pyro_distributed.grad.p+0"
    assert bucket_name(["a", "b"]) == bucket_name(["a", "b"])
    assert bucket_name(["a", "b"]) != bucket_name(["a", "c"])
    assert bucket_name(["a", "b"]).startswith("pyro_distributed.grad.a+1.")
