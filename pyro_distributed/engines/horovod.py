"""The Horovod engine: collectives through ``horovod.torch``.

Horovod is optional and imported only when this engine starts. Its last
release (0.28.1) does not build against current PyTorch as published;
``scripts/install_horovod.sh`` builds it with the needed fix.

Horovod's own default on a stalled collective is a warning after 60 seconds
and then waiting forever. Unless the user set them, this engine sets
Horovod's stall-shutdown and gloo time-outs from ``timeout`` before
``hvd.init()``, so a lost worker ends the job instead of hanging it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..errors import PyroDistributedError
from .base import DEFAULT_TIMEOUT, Engine, ReduceOp

__all__ = ["HorovodEngine", "import_horovod"]

INSTALL_HINT = (
    "Horovod is not installed. Build and install it for your torch with "
    "`bash scripts/install_horovod.sh` from the pyro-distributed repository "
    "(Horovod 0.28.1 needs a C++17 fix to build against torch >= 2.1)."
)


def import_horovod() -> ModuleType:
    """``horovod.torch``, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


class HorovodEngine(Engine):
    """Collectives through Horovod (``horovodrun --gloo`` or MPI)."""

    name = "horovod"

    @staticmethod
    def detected() -> bool:
        """Whether this process was launched by ``horovodrun``."""
        return "HOROVOD_RANK" in os.environ

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        hvd = import_horovod()
        super().__init__(timeout)
        self._owns_init = not hvd.is_initialized()
        if self._owns_init:
            seconds = str(max(1, int(timeout.total_seconds())))
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", seconds)
            os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", seconds)
            os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", seconds)
            hvd.init()
        self.hvd = hvd
        self._ops = {"sum": hvd.Sum, "mean": hvd.Average, "max": hvd.Max}
        self._calls = 0

    @property
    def rank(self) -> int:
        return int(self.hvd.rank())

    @property
    def local_rank(self) -> int:
        return int(self.hvd.local_rank())

    @property
    def world_size(self) -> int:
        return int(self.hvd.size())

    def _name(self, what: str) -> str:
        # Horovod matches collectives across workers by name; a counter that
        # advances identically on every worker keeps names unique and equal.
        self._calls += 1
        return f"pyro_distributed.{what}.{self._calls}"

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except PyroDistributedError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise PyroDistributedError(
                f"{what} failed on worker {self.rank} of {self.world_size} "
                f"(horovod engine, time-out {self._timeout.total_seconds():g} s): {exc}"
            ) from exc

    def allreduce_(self, tensors: Sequence[Tensor], op: ReduceOp = "sum") -> None:
        if op not in self._ops:
            raise ValueError(f"the horovod engine has no reduction {op!r}")
        if not tensors:
            return
        with self._collective(f"allreduce ({op}) of {len(tensors)} tensor(s)"):
            self.hvd.grouped_allreduce_(list(tensors), op=self._ops[op], name=self._name(op))

    def allreduce_named_(
        self, tensors: Sequence[Tensor], names: Sequence[str], **options: Any
    ) -> None:
        """Reduce tensors with explicit collective names and Horovod options.

        ``options`` are those of ``hvd.grouped_allreduce_`` (``op``,
        ``prescale_factor``, ``postscale_factor``, ``process_set``).
        """
        with self._collective(f"allreduce of {len(tensors)} tensor(s)"):
            handles = [
                self.hvd.allreduce_async_(tensor, name=name, **options)
                for tensor, name in zip(tensors, names, strict=True)
            ]
            for handle in handles:
                self.hvd.synchronize(handle)

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        with self._collective(f"broadcast from worker {src} of {len(tensors)} tensor(s)"):
            handles = [
                self.hvd.broadcast_async_(tensor, root_rank=src, name=self._name("broadcast"))
                for tensor in tensors
            ]
            for handle in handles:
                self.hvd.synchronize(handle)

    def allgather_object(self, obj: Any) -> list[Any]:
        with self._collective("allgather of Python objects"):
            return list(self.hvd.allgather_object(obj, name=self._name("allgather_object")))

    def barrier(self) -> None:
        with self._collective("barrier"):
            self.hvd.allreduce_(torch.zeros(1), op=self.hvd.Sum, name=self._name("barrier"))

    def shutdown(self) -> None:
        if self._owns_init and self.hvd.is_initialized():
            self.hvd.shutdown()
