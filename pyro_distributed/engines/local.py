"""The engine for one plain process: world size 1, no communication.

Every collective is a no-op on its input, so code written for many workers
runs unchanged, and at no cost, as a single ``python script.py``.

It is also what ``engine="auto"`` finds in a process whose launcher has not
yet created its process group (Lightning creates it inside ``trainer.fit``).
:meth:`LocalEngine.outgrown` notices such a group once it exists, so that
nothing bound to this engine goes on averaging over one worker.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Engine, ReduceOp


class LocalEngine(Engine):
    """World size 1. Reductions and broadcasts leave tensors as they are;
    ``all_gather`` returns a copy with a first dimension of 1 in front, and
    ``reduce_scatter`` a copy."""

    name = "local"
    #: Asked last, and always there: one plain process.
    detection_priority = -1

    @staticmethod
    def detected() -> bool:
        """Always: what ``engine="auto"`` falls back to when no launcher is found."""
        return True

    @property
    def rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def outgrown(self) -> str | None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return f"a torch.distributed process group of {dist.get_world_size()} workers"
        hvd = sys.modules.get("horovod.torch")  # only if someone imported it: never import it here
        if hvd is not None and hvd.is_initialized() and hvd.size() > 1:
            return f"a Horovod job of {hvd.size()} workers"
        return None

    def allreduce_(
        self, tensors: Sequence[Tensor], op: ReduceOp = "sum", names: Sequence[str] = ()
    ) -> None:
        pass

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        if src != 0:
            raise ValueError(f"broadcast source {src} does not exist: world size is 1")

    def all_gather(self, tensor: Tensor, name: str = "") -> Tensor:
        return tensor.detach().unsqueeze(0).clone(memory_format=torch.contiguous_format)

    def reduce_scatter(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Tensor:
        self._rows_per_worker(tensor, op)  # the same refusals as on many workers
        # Every reduction over one worker is the tensor itself; a mean divides by 1,
        # which leaves every value as it is.
        return tensor.detach().clone(memory_format=torch.contiguous_format)

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
