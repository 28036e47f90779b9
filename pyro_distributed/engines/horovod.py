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
import pickle
from collections.abc import Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .base import DEFAULT_TIMEOUT, Engine, Pending, ReduceOp, as_bytes, stacked_rows
from .launchers import horovodrun_present

INSTALL_HINT = (
    "Horovod is not installed. Build and install it for your torch with "
    "`bash scripts/install_horovod.sh` from the pyro-distributed repository "
    "(Horovod 0.28.1 builds against torch >= 2.1 only with its C++ standard raised: "
    "C++17, and C++20 from torch 2.15)."
)


def import_horovod() -> ModuleType:
    """``horovod.torch``, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


class _HorovodPending(Pending):
    def __init__(self, engine: HorovodEngine, handle: Any, what: str) -> None:
        self._engine, self._handle, self._what = engine, handle, what

    def wait(self) -> None:
        with self._engine._collective(self._what):
            self._engine.hvd.synchronize(self._handle)


class HorovodEngine(Engine):
    """Collectives through Horovod (``horovodrun --gloo`` or MPI).

    :param process_set: run every collective within this ``hvd.ProcessSet``
        instead of all workers; rank and world size are then the set's.
    """

    name = "horovod"
    #: ``horovodrun`` may itself run on MPI, whose launcher variables it then
    #: sets too: Horovod asks first.
    detection_priority = 30
    launches_own_workers = True
    launcher = "horovodrun"
    _transport_errors = (RuntimeError, ValueError)

    @staticmethod
    def detected() -> bool:
        """Whether this process was launched by ``horovodrun`` (by all of its
        variables: a stray ``HOROVOD_RANK`` in a shell launches nothing)."""
        return horovodrun_present()

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT, process_set: Any = None) -> None:
        super().__init__(timeout)
        hvd = import_horovod()
        self._owns_init = not hvd.is_initialized()
        if self._owns_init:
            seconds = str(max(1, int(timeout.total_seconds())))
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", seconds)
            os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", seconds)
            os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", seconds)
            hvd.init()
        self.hvd = hvd
        self._process_set = process_set if process_set is not None else hvd.global_process_set
        self._ops = {"sum": hvd.Sum, "mean": hvd.Average, "max": hvd.Max}
        self._calls = 0

    def within(self, process_set: Any) -> HorovodEngine:
        """The same Horovod, with collectives restricted to ``process_set``."""
        if not isinstance(process_set, self.hvd.ProcessSet):
            raise TypeError(f"process_set must be an hvd.ProcessSet, got {process_set!r}")
        if process_set.process_set_id is None:
            raise ValueError(
                f"{process_set} is not registered with Horovod; pass it to "
                f"hvd.init(process_sets=[...]) or hvd.add_process_set() first"
            )
        if not process_set.included():
            raise ValueError(f"worker {self.hvd.rank()} is not a member of {process_set}")
        view = HorovodEngine.__new__(HorovodEngine)
        view.__dict__.update(self.__dict__, _owns_init=False, _process_set=process_set, _calls=0)
        return view

    def op_name(self, op: Any) -> str | None:
        """What Horovod's reduce op ``op`` is (``hvd.Average``: ``"mean"``,
        ``hvd.Sum``: ``"sum"``, ``hvd.Adasum``: ``"adasum"``), or ``None`` for
        anything else; so that callers check Horovod's arguments without
        holding the ``horovod.torch`` module themselves."""
        ops = {"mean": self.hvd.Average, "sum": self.hvd.Sum, "adasum": self.hvd.Adasum}
        return next((name for name, known in ops.items() if op == known), None)

    def is_no_compression(self, compression: Any) -> bool:
        """Whether ``compression`` is ``hvd.Compression.none``."""
        return compression is self.hvd.Compression.none

    @property
    def rank(self) -> int:
        return int(self._process_set.rank())

    @property
    def local_rank(self) -> int:
        return int(self.hvd.local_rank())

    @property
    def world_size(self) -> int:
        return int(self._process_set.size())

    def _name(self, what: str) -> str:
        # Horovod matches collectives across workers by name; a counter that
        # advances identically on every worker keeps names unique and equal.
        self._calls += 1
        return f"pyro_distributed.{what}.{self._calls}"

    def allreduce_async_(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Pending:
        # Horovod pairs collectives by name, so no separate channel is needed.
        if op not in self._ops:
            raise ValueError(f"the horovod engine has no reduction {op!r}")
        name = name or self._name(op)
        what = f"allreduce ({op}) of {name}"
        with self._collective(what):
            handle = self.hvd.allreduce_async_(
                tensor, name=name, op=self._ops[op], process_set=self._process_set
            )
        return _HorovodPending(self, handle, what)

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        with self._collective(f"broadcast from worker {src} of {len(tensors)} tensor(s)"):
            handles = [
                self.hvd.broadcast_async_(
                    tensor,
                    root_rank=src,
                    name=self._name("broadcast"),
                    process_set=self._process_set,
                )
                for tensor in tensors
            ]
            for handle in handles:
                self.hvd.synchronize(handle)

    def all_gather(self, tensor: Tensor, name: str = "") -> Tensor:
        name = name or self._name("all_gather")
        what = f"all_gather of {name}"
        # As bytes, one row per worker: every dtype travels, bit for bit.
        sent = as_bytes(tensor).unsqueeze(0)
        with self._collective(what):
            handle = self.hvd.allgather_async(sent, name=name, process_set=self._process_set)
            gathered = self.hvd.synchronize(handle)
        return stacked_rows(gathered, tensor, self.world_size)

    def reduce_scatter(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Tensor:
        """See :meth:`~pyro_distributed.Engine.reduce_scatter`: an all-reduce
        of a copy, of which this worker keeps its rows.

        Not ``hvd.reducescatter``: it knows only sums and means, and Horovod
        0.28 adds the workers' values for it in another order than for its
        all-reduce (on gloo, with gloo's halving-doubling reduce-scatter: at
        three workers, one element in ten to one in five of two workers' rows
        differed in the last bits), while the rows must be bit for bit what
        :meth:`~pyro_distributed.Engine.allreduce_` gives.
        """
        return self._reduce_scatter_by_allreduce(tensor, op, name)

    def allgather_object(self, obj: Any) -> list[Any]:
        # hvd.allgather_object knows no process sets; allgather of bytes does,
        # and concatenates workers' payloads of different lengths.
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        with self._collective("allgather of Python objects"):
            sizes = self.hvd.allgather(
                # cpu: a size, beside a pickled payload
                torch.tensor([payload.numel()], device="cpu"),
                name=self._name("object_sizes"),
                process_set=self._process_set,
            )
            data = self.hvd.allgather(
                payload, name=self._name("objects"), process_set=self._process_set
            )
        chunks = torch.split(data, sizes.tolist())
        return [pickle.loads(chunk.numpy().tobytes()) for chunk in chunks]

    def barrier(self) -> None:
        with self._collective("barrier"):
            self.hvd.barrier(process_set=self._process_set)

    def shutdown(self) -> None:
        if self._owns_init and self.hvd.is_initialized():
            self.hvd.shutdown()
