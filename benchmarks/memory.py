"""What a worker holds in memory for its parameters, for the benchmarks and the memory test."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["state_bytes"]


def state_bytes(parameters: Iterable[Tensor], optimizers: Iterable[Any]) -> int:
    """Bytes of ``parameters`` plus every tensor in the torch optimizers' state:
    what a worker holds for them (for example ``optim.optim_objs.values()``)."""
    total = sum(p.numel() * p.element_size() for p in parameters)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total
