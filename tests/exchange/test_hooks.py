"""The default hook's arithmetic (``AverageHook``), and plain functions as hooks.

Between :meth:`AverageHook.encode` and :meth:`AverageHook.decode` the engine
sums the workers' wire tensors; here the sum is made by adding the workers'
encoded buffers in one process, so that each rule of the scaling is checked
on its own numbers. The exchange's tests check the same rules on real workers.
"""

from __future__ import annotations

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.exchange.compression import compressor
from pyro_distributed.exchange.hooks import AverageHook, as_hook


def summed_on_the_wire(
    hook: AverageHook, buffers: list[torch.Tensor], world_size: int, tail: int = 0
) -> torch.Tensor:
    """Every worker's buffer encoded, summed as the engine sums them, then decoded
    (the last ``tail`` values are the bucket's tail)."""
    size = buffers[0].numel() - tail
    encoded = [hook.encode(buffer.clone(), size, world_size) for buffer in buffers]
    total = torch.stack([sent for sent, _ in encoded]).sum(0)
    return hook.decode(total, encoded[0][1], size, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("predivide", [1.0, 2.0, "world"])
def test_mean_is_the_mean_however_the_division_is_split(
    world_size: int, predivide: float | str
) -> None:
    factor = float(world_size) if predivide == "world" else float(predivide)
    hook = AverageHook("mean", factor)
    buffers = [torch.arange(6.0) * (rank + 1) for rank in range(world_size)]
    averaged = summed_on_the_wire(hook, buffers, world_size)
    assert torch.allclose(averaged, torch.stack(buffers).mean(0), rtol=1e-6)
    assert hook.to_mean(world_size) == 1.0


def test_sum_is_left_unscaled_and_says_how_to_reach_the_mean() -> None:
    hook = AverageHook("sum", 1.0)
    buffers = [torch.full((4,), float(rank + 1)) for rank in range(3)]
    assert torch.equal(summed_on_the_wire(hook, buffers, 3), torch.full((4,), 6.0))
    assert hook.to_mean(3) == 3.0


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_the_tail_is_left_out_of_the_scaling_so_its_sum_stays_exact(compression: str) -> None:
    hook = AverageHook("mean", 3.0, compressor(compression))  # type: ignore[arg-type]
    # Per worker: two gradient values, then a tail of two (flags, riders).
    buffers = [torch.tensor([3.0, 6.0, 1.0, float(rank)]) for rank in range(3)]
    summed = summed_on_the_wire(hook, buffers, 3, tail=2)
    assert torch.equal(summed[2:], torch.tensor([3.0, 3.0])), "the tail is the exact sum"
    assert torch.allclose(summed[:2], torch.tensor([3.0, 6.0]), rtol=1e-3)


def test_a_narrowing_compression_divides_before_the_sum_so_fp16_cannot_overflow() -> None:
    big = torch.finfo(torch.float16).max / 2  # two of these overflow fp16 when summed
    hook = AverageHook("mean", 1.0, compressor("fp16"))
    averaged = summed_on_the_wire(hook, [torch.full((3,), big), torch.full((3,), big)], 2)
    assert averaged.dtype == torch.float32
    assert torch.isfinite(averaged).all()
    assert torch.allclose(averaged, torch.full((3,), big), rtol=1e-3)


def test_a_gradient_that_never_travels_is_scaled_as_a_bucket_is() -> None:
    hook = AverageHook("mean", 2.0, compressor("bf16"))
    gradient = torch.tensor([0.3, -1.7, 2.5])
    # Averaging with W-1 exact zeros: the other workers' wire tensors add nothing.
    expected = summed_on_the_wire(hook, [gradient, torch.zeros(3), torch.zeros(3)], 3)
    alone = gradient.clone()
    assert hook.alone_(alone, 3) is alone
    assert torch.equal(alone, expected)


def test_the_tail_type_is_the_compressed_type_asked_once_per_dtype() -> None:
    calls = []

    class Counting:
        def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
            calls.append(tensor.dtype)
            return tensor.to(torch.float16), tensor.dtype

        def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
            return tensor.to(ctx)

    hook = AverageHook(compression=Counting())
    assert hook.tail_dtype(torch.float32) == torch.float16
    assert hook.tail_dtype(torch.float32) == torch.float16
    assert calls == [torch.float32], "probed once, not at every encode"
    assert AverageHook().tail_dtype(torch.float64) == torch.float64


def test_a_plain_function_becomes_a_hook_and_anything_else_is_refused() -> None:
    def hook(bucket: pd.GradBucket, engine: pd.Engine) -> pd.Reducing:
        raise AssertionError("not called here")

    wrapped = as_hook(hook)
    assert isinstance(wrapped, pd.CommHook) and not wrapped.in_place
    assert as_hook(wrapped) is wrapped
    with pytest.raises(TypeError, match="comm_hook must be a CommHook or a function"):
        as_hook("fp16")  # type: ignore[arg-type]
