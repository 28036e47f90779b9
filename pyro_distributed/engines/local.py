"""The engine for one plain process: world size 1, no communication.

Every collective is a no-op on its input, so code written for many workers
runs unchanged, and at no cost, as a single ``python script.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .base import Engine, ReduceOp

__all__ = ["LocalEngine"]


class LocalEngine(Engine):
    """World size 1. Reductions and broadcasts leave tensors as they are."""

    name = "local"

    @property
    def rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def allreduce_(
        self, tensors: Sequence[Tensor], op: ReduceOp = "sum", names: Sequence[str] = ()
    ) -> None:
        pass

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        if src != 0:
            raise ValueError(f"broadcast source {src} does not exist: world size is 1")

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
