"""The torch.distributed engine: gloo for CPU tensors, NCCL for CUDA tensors.

It joins the process group that ``torchrun`` describes in the environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), or reuses a group
the user already initialised, in which case it also leaves that group alone at
shutdown. Groups it creates itself get the bounded time-out the user asked for,
instead of torch's default of 30 minutes.

Reductions of several tensors are issued asynchronously and then awaited, so
the transport can pipeline them; every wait is bounded by the time-out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import PyroDistributedError
from .base import DEFAULT_TIMEOUT, Engine, ReduceOp

__all__ = ["TorchEngine"]

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TorchEngine(Engine):
    """Collectives on a torch.distributed process group."""

    name = "torch"

    @staticmethod
    def detected() -> bool:
        """Whether this process was launched by torchrun or already joined a group."""
        if dist.is_available() and dist.is_initialized():
            return True
        return all(variable in os.environ for variable in _TORCHRUN_VARIABLES)

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not dist.is_available():
            raise PyroDistributedError(
                "engine='torch' needs a torch build with torch.distributed; this one has none"
            )
        super().__init__(timeout)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
            if missing:
                raise PyroDistributedError(
                    f"engine='torch' found no process group and no torchrun environment "
                    f"(missing {', '.join(missing)}). Launch with `torchrun --nproc-per-node N "
                    f"script.py`, or call torch.distributed.init_process_group() first."
                )
            dist.init_process_group(backend=self._default_backend(), timeout=timeout)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._local_rank = int(os.environ.get("LOCAL_RANK", self._rank))
        self._cpu_group = self._group_for_cpu_tensors()

    @staticmethod
    def _default_backend() -> str:
        if torch.cuda.is_available() and dist.is_nccl_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            return "cpu:gloo,cuda:nccl"
        return "gloo"

    def _group_for_cpu_tensors(self) -> Any:
        """The group that carries CPU tensors and pickled objects.

        A group the user made with NCCL alone cannot move CPU tensors, so we
        add a gloo group beside it (a collective call, made by every worker
        as it creates the engine).
        """
        backend = str(dist.get_backend())
        if "gloo" in backend:
            return None  # the default group
        return dist.new_group(backend="gloo", timeout=self._timeout)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _group(self, tensor: Tensor) -> Any:
        return self._cpu_group if tensor.device.type == "cpu" else None

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except PyroDistributedError:
            raise
        except RuntimeError as exc:
            raise PyroDistributedError(
                f"{what} failed on worker {self._rank} of {self._world_size} "
                f"(torch engine, time-out {self._timeout.total_seconds():g} s): {exc}"
            ) from exc

    def allreduce_(
        self, tensors: Sequence[Tensor], op: ReduceOp = "sum", names: Sequence[str] = ()
    ) -> None:
        if op not in _REDUCE_OPS:
            raise ValueError(f"the torch engine has no reduction {op!r}")
        with self._collective(f"allreduce ({op}) of {len(tensors)} tensor(s)"):
            works = [
                dist.all_reduce(t, op=_REDUCE_OPS[op], group=self._group(t), async_op=True)
                for t in tensors
            ]
            for work in works:
                work.wait(self._timeout)
        if op == "mean":
            for t in tensors:
                t.div_(self._world_size)

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        with self._collective(f"broadcast from worker {src} of {len(tensors)} tensor(s)"):
            works = [
                dist.broadcast(t, src=src, group=self._group(t), async_op=True) for t in tensors
            ]
            for work in works:
                work.wait(self._timeout)

    def allgather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self._world_size
        with self._collective("allgather of Python objects"):
            dist.all_gather_object(gathered, obj, group=self._cpu_group)
        return gathered

    def barrier(self) -> None:
        with self._collective("barrier"):
            # monitored_barrier names the workers that did not arrive; it
            # exists for gloo only.
            if self._cpu_group is None:
                dist.monitored_barrier(timeout=self._timeout, wait_all_ranks=True)
            else:
                dist.barrier()

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
