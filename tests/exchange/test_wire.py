"""What a bucket becomes on the wire and back (``exchange/wire.py``).

Between :meth:`Wire.encode` and :meth:`Wire.decode` the engine sums the
workers' wire tensors; here the sum is made by adding the workers' encoded
buffers in one process, so that each rule of the scaling is checked on its
own numbers. The exchange's tests check the same rules on real workers.
"""

from __future__ import annotations

import pytest
import torch

from pyro_distributed.exchange.compression import compressor
from pyro_distributed.exchange.wire import Wire


def summed_on_the_wire(wire: Wire, buffers: list[torch.Tensor], riders: int = 0) -> torch.Tensor:
    """Every worker's buffer encoded, summed as the engine sums them, then decoded."""
    encoded = [wire.encode(buffer.clone(), riders) for buffer in buffers]
    total = torch.stack([sent for sent, _ in encoded]).sum(0)
    return wire.decode(total, encoded[0][1])


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("predivide", [1.0, 2.0, "world"])
def test_mean_is_the_mean_however_the_division_is_split(
    world_size: int, predivide: float | str
) -> None:
    factor = float(world_size) if predivide == "world" else float(predivide)
    wire = Wire("mean", factor, None, world_size)
    buffers = [torch.arange(6.0) * (rank + 1) for rank in range(world_size)]
    averaged = summed_on_the_wire(wire, buffers)
    assert torch.allclose(averaged, torch.stack(buffers).mean(0), rtol=1e-6)
    assert wire.to_mean() == 1.0


def test_sum_is_left_unscaled_and_says_how_to_reach_the_mean() -> None:
    wire = Wire("sum", 1.0, None, 3)
    buffers = [torch.full((4,), float(rank + 1)) for rank in range(3)]
    assert torch.equal(summed_on_the_wire(wire, buffers), torch.full((4,), 6.0))
    assert wire.to_mean() == 3.0


def test_riders_are_left_out_of_the_scaling_so_their_sum_stays_exact() -> None:
    wire = Wire("mean", 3.0, None, 3)  # the whole division before the sum
    flat = torch.tensor([3.0, 6.0, 1.0, 2.0])  # two values, then two riders
    sent, _ = wire.encode(flat, riders=2)
    assert torch.equal(sent[2:], torch.tensor([1.0, 2.0]))
    assert torch.allclose(sent[:2], torch.tensor([1.0, 2.0]))


def test_a_narrowing_compression_divides_before_the_sum_so_fp16_cannot_overflow() -> None:
    big = torch.finfo(torch.float16).max / 2  # two of these overflow fp16 when summed
    wire = Wire("mean", 1.0, compressor("fp16"), 2)
    averaged = summed_on_the_wire(wire, [torch.full((3,), big), torch.full((3,), big)])
    assert averaged.dtype == torch.float32
    assert torch.isfinite(averaged).all()
    assert torch.allclose(averaged, torch.full((3,), big), rtol=1e-3)


def test_a_gradient_that_never_travels_is_scaled_as_a_bucket_is() -> None:
    wire = Wire("mean", 2.0, compressor("bf16"), 3)
    gradient = torch.tensor([0.3, -1.7, 2.5])
    # Averaging with W-1 exact zeros: the other workers' wire tensors add nothing.
    expected = summed_on_the_wire(wire, [gradient, torch.zeros(3), torch.zeros(3)])
    alone = gradient.clone()
    assert wire.average_alone_(alone) is alone
    assert torch.equal(alone, expected)
