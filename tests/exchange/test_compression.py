"""fp16 and bf16 gradient compression on the torch engine."""

from __future__ import annotations

import pyro
import pytest
import torch

import pyro_distributed as pd

from ..support.harness import run_workers, with_engines

UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def local_gradient(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    magnitudes = 10.0 ** torch.linspace(-3, 3, 200)
    return torch.randn(200, generator=generator) * magnitudes


def compressed_average(compression: str, large: bool) -> torch.Tensor:
    p = pyro.param("p", torch.zeros(200)).unconstrained()
    optim = pd.DistributedOptimizer(pyro.optim.SGD({"lr": 0.0}), compression=compression)  # type: ignore[arg-type]
    p.grad = torch.full((200,), 40_000.0) if large else local_gradient(pd.rank())
    optim([p])
    assert p.grad is not None
    return p.grad.clone()


@pytest.mark.parametrize(("engine", "compression"), with_engines(["fp16", "bf16"], on_mpi=["fp16"]))
def test_compressed_average_is_within_the_documented_bound(engine: str, compression: str) -> None:
    first, second = run_workers(compressed_average, compression, False, engine=engine)
    assert torch.equal(first, second)
    grads = torch.stack([local_gradient(0), local_gradient(1)])
    exact = grads.mean(0)
    bound = 2 * UNIT_ROUNDOFF[compression] * grads.abs().mean(0) + 6e-5
    assert ((first - exact).abs() <= bound).all()
    assert not torch.equal(first, exact), "compression changed nothing"


def test_fp16_divides_before_summing_so_the_sum_cannot_overflow() -> None:
    # Each worker's gradient reaches 40000; their sum (80000) exceeds fp16's
    # 65504, but their average does not.
    first, _ = run_workers(compressed_average, "fp16", True)
    assert torch.equal(first, torch.full((200,), 40_000.0))


def test_unknown_compression_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="compression must be 'none', 'fp16' or 'bf16'"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="local", compression="int8")  # type: ignore[arg-type]
    pd.shutdown()
