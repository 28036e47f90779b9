"""The MPI engine: collectives through mpi4py, under ``mpirun``, ``mpiexec`` or ``srun``.

mpi4py is optional and imported only when this engine starts; detection
(:meth:`MPIEngine.detected`) reads the launcher's environment only. On one
machine MPI moves data through shared memory, which makes a small all-reduce
about a hundred times cheaper than gloo's (``benchmarks/README.md``).

Design:

* **Zero copy.** A contiguous CPU tensor is handed to MPI by address and
  length, so MPI reads and writes the tensor's own memory; nothing is copied
  and no NumPy or DLPack object is made per call. float16 and bfloat16, which
  MPI cannot add, are summed in float32 and rounded back once.
* **Bounded waits.** MPI itself waits forever for a peer that hangs or dies.
  Every collective here is non-blocking (``Iallreduce``, ``Ibcast``,
  ``Iallgatherv``, ``Ibarrier``, ``Idup``) and waited for by testing it
  until a deadline: a peer on this machine whose process has exited is named
  within about a second (where the launcher leaves the survivors running;
  MPICH's ``mpiexec`` stops the job itself and names the dead PID), and
  anything else raises :class:`~pyro_distributed.PyroDistributedError` after
  the time-out, naming the collective. The engine is then broken (a started collective can never
  be cancelled), so :meth:`MPIEngine.shutdown`, which also runs at exit, ends
  the whole job with ``MPI_Abort``: ``mpirun`` exits non-zero instead of
  hanging in a peer's collective or in ``MPI_Finalize``. A script that dies
  of an uncaught exception aborts the job the same way.
* **Polling.** A waiting worker tests its request in a loop, yielding the
  core at each test after the first 0.2 ms, as MPI's own blocking calls poll:
  on cores of its own (how MPI jobs run) that is the fastest way to wait; on
  an oversubscribed machine it takes CPU from the other processes.
* **Channels.** Collectives pair up in the order they are started on one
  communicator. :meth:`MPIEngine.open_channel` duplicates the communicator,
  so collectives started from backward hooks never pair with other ones.
* **GPU tensors (untested: no GPU on the development machines).** If the MPI
  library reports CUDA among its memory kinds (MPI 4.1's
  ``mpi_memory_alloc_kinds``), CUDA tensors are handed to MPI as they are;
  otherwise they are staged through pinned host memory, with one warning.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..devices import cuda_device_index
from ..errors import PyroDistributedError
from .base import DEFAULT_TIMEOUT, Engine, Pending, ReduceOp, process_is_alive

__all__ = ["INSTALL_HINT", "MPIEngine", "import_mpi"]

INSTALL_HINT = (
    "mpi4py is not installed. Install the MPI extra, which brings mpi4py and the "
    "MPICH wheel (no compiler, no system MPI): `pip install pyro-distributed[mpi]`. "
    "On a cluster, build mpi4py against the system's MPI instead: "
    "`pip install --no-binary mpi4py mpi4py` with that MPI's `mpicc` on the PATH."
)

# What MPI launchers put in each process's environment: MPICH's Hydra (and
# Intel MPI, MVAPICH), Open MPI, any PMIx launcher, MVAPICH2.
_LAUNCHER_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")

#: How often a waiting worker looks for peers on its machine that have exited.
_LIVENESS_INTERVAL = 0.5
#: Spin on the request this long (a small all-reduce takes microseconds), then
#: yield the core at every test, so that a peer sharing it can run; sleep
#: between tests only after a second. MPI moves a large message in chunks,
#: each when both sides test: sleeping earlier stretches every transfer.
_SPIN_S, _YIELD_S, _SLEEP_S = 2e-4, 1.0, 1e-3


def import_mpi() -> ModuleType:
    """``mpi4py.MPI`` (initialising MPI), or an ImportError that says how to install it."""
    try:
        return importlib.import_module("mpi4py.MPI")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


def _slurm_step() -> bool:
    """Whether this is one task of a multi-task ``srun`` step.

    ``SLURM_PROCID`` alone is also set inside a batch script, where a plain
    ``python train.py`` is one process and must stay local.
    """
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1


class _Health:
    """Whether any collective of an engine or its channels has failed (shared with channels)."""

    failed = False


class _MPIPending(Pending):
    def __init__(
        self,
        engine: MPIEngine,
        request: Any,
        what: str,
        finish: Callable[[], None] | None,
        buffers: tuple[Tensor, ...],
    ) -> None:
        self._engine, self._request, self._what, self._finish = engine, request, what, finish
        # MPI holds raw addresses: the tensors must outlive the collective.
        self._buffers = buffers

    def wait(self) -> None:
        if self._request is None:
            return
        request, self._request = self._request, None
        self._engine._wait(request, self._what)
        if self._finish is not None:
            self._finish()
        self._buffers = ()


class MPIEngine(Engine):
    """Collectives on an MPI communicator (through mpi4py).

    :param timeout: how long any collective may wait.
    :param comm: the communicator to work on (default ``MPI.COMM_WORLD``). It is
        duplicated, so the engine's traffic never mixes with the caller's.
    :param cuda_aware: whether the MPI library takes CUDA buffers; ``None``
        (default) asks the library.

    Example::

        # mpirun -np 2 python train.py
        import pyro_distributed as pd

        pd.init("mpi")  # or "auto", which picks it under mpirun, mpiexec and srun
        print(pd.rank(), pd.local_rank(), pd.world_size())

    .. warning::
        MPI is started once per process and ended at exit. After a failed
        collective (a peer died, hung or took another path) the job cannot
        go on: the engine aborts all of it at :meth:`shutdown` or at exit.
    """

    name = "mpi"

    @staticmethod
    def detected() -> bool:
        """Whether an MPI launcher (mpirun, mpiexec, srun) started this process."""
        return any(variable in os.environ for variable in _LAUNCHER_VARIABLES) or _slurm_step()

    def __init__(
        self,
        timeout: timedelta = DEFAULT_TIMEOUT,
        comm: Any = None,
        cuda_aware: bool | None = None,
    ) -> None:
        super().__init__(timeout)
        self.MPI = MPI = import_mpi()
        self._health = _Health()
        self._staging_announced = False
        self._types = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.int64: MPI.INT64_T,
            torch.int32: MPI.INT32_T,
            torch.int16: MPI.INT16_T,
            torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T,
        }
        self._ops = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX}
        parent = MPI.COMM_WORLD if comm is None else comm
        self._rank, self._world_size = parent.Get_rank(), parent.Get_size()
        self._peers: list[tuple[str, int]] = []
        self._comm = self._duplicate(parent, "starting the mpi engine")
        # Split_type has no non-blocking form. The barrier proves every peer
        # has got this far (bounded), so the split cannot wait for an absent one.
        self.barrier()
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        self._local_rank = node.Get_rank()
        node.Free()
        self._cuda_aware = self._library_takes_cuda() if cuda_aware is None else cuda_aware
        if torch.cuda.is_available():  # each worker its GPU, as the torch engine pins them
            torch.cuda.set_device(cuda_device_index(self._local_rank, torch.cuda.device_count()))
        # Where every worker lives, to name the lost ones when a collective fails.
        self._peers = self.allgather_object((socket.gethostname(), os.getpid()))

    # --- where this worker stands ------------------------------------------------------------

    @property
    def rank(self) -> int:
        return int(self._rank)

    @property
    def local_rank(self) -> int:
        return int(self._local_rank)

    @property
    def world_size(self) -> int:
        return int(self._world_size)

    @property
    def cuda_aware(self) -> bool:
        """Whether CUDA tensors go to MPI as they are (else through pinned host memory)."""
        return self._cuda_aware

    def _library_takes_cuda(self) -> bool:
        info = self._comm.Get_info()
        try:
            kinds = info.Get("mpi_memory_alloc_kinds") or ""
        finally:
            info.Free()
        return any(kind.split(":")[0] == "cuda" for kind in kinds.split(","))

    # --- waiting with a deadline -------------------------------------------------------------

    def _wait(self, request: Any, what: str) -> None:
        """Test ``request`` until it completes, a peer is lost, or the time-out passes."""
        with self._collective(what):
            if request.Test():
                return
            start = time.monotonic()
            deadline = start + self._timeout.total_seconds()
            next_look = start + _LIVENESS_INTERVAL
            while not request.Test():
                now = time.monotonic()
                waited = now - start
                if now >= next_look:
                    lost = self.lost_workers()
                    if lost:
                        self._fail(what, f"{', '.join(lost)} {_has(lost)} exited")
                    next_look = now + _LIVENESS_INTERVAL
                if now >= deadline:
                    self._fail(
                        what,
                        f"no answer within the time-out ({waited:.1f} s): a worker hung, "
                        f"died on another machine or took another path through the code",
                    )
                if waited >= _YIELD_S:
                    time.sleep(_SLEEP_S)
                elif waited >= _SPIN_S:
                    os.sched_yield()

    def _fail(self, what: str, reason: str) -> None:
        self._health.failed = True
        raise PyroDistributedError(
            f"{what} failed on worker {self.rank} of {self.world_size}: {reason} "
            f"(mpi engine, time-out {self._timeout.total_seconds():g} s). The job "
            f"cannot go on; pyro_distributed.shutdown(), or the end of the script, "
            f"aborts it with MPI_Abort."
        )

    def _diagnosis(self) -> str:
        # An MPI error (the library noticed a failed peer itself).
        self._health.failed = True
        lost = self.lost_workers(grace=2.0)
        if not lost:
            return super()._diagnosis()
        return f"{', '.join(lost)} {_has(lost)} exited"

    def lost_workers(self, grace: float = 0.0) -> list[str]:
        """Workers on this machine whose process has exited, described for a message.

        Peers on other machines cannot be checked from here; losing one shows
        as the time-out. ``grace`` keeps looking, for a peer still tearing down.
        """
        here = socket.gethostname()
        local = [(r, pid) for r, (host, pid) in enumerate(self._peers) if host == here]
        deadline = time.monotonic() + grace
        while True:
            lost = [f"worker {r} (pid {pid})" for r, pid in local if not process_is_alive(pid)]
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.1)

    def _duplicate(self, comm: Any, what: str) -> Any:
        duplicate, request = comm.Idup()
        self._wait(request, what)
        return duplicate

    # --- buffers -----------------------------------------------------------------------------

    def _buffer(self, tensor: Tensor, datatype: Any = None) -> list[Any]:
        """An MPI buffer over ``tensor``'s own memory (contiguous, on a device MPI can read)."""
        nbytes = tensor.numel() * tensor.element_size()
        memory = self.MPI.buffer.fromaddress(tensor.data_ptr(), nbytes)
        if datatype is None:
            return [memory, nbytes, self.MPI.BYTE]
        return [memory, tensor.numel(), datatype]

    def _datatype(self, dtype: torch.dtype) -> Any:
        if dtype not in self._types:
            raise TypeError(f"the mpi engine cannot reduce tensors of dtype {dtype}")
        return self._types[dtype]

    def _on_host(self, tensor: Tensor, what: str) -> tuple[Tensor, Callable[[], None] | None]:
        """A contiguous tensor MPI can read and write, and what copies its result back."""
        device = tensor.device.type
        if device == "cuda":
            # Untested on a GPU so far (scripts/gpu_check.sh runs it).
            torch.cuda.current_stream(tensor.device).synchronize()  # the values must be written
            if self._cuda_aware:
                return _contiguous(tensor)
            if not self._staging_announced:
                self._staging_announced = True
                warnings.warn(
                    "this MPI library does not take CUDA buffers: the mpi engine copies CUDA "
                    "tensors through pinned host memory (an MPI built with CUDA support avoids "
                    "the copies)",
                    stacklevel=4,
                )
            # cpu: the pinned host copy MPI reads and writes in place of the CUDA tensor.
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True, device="cpu")
            host.copy_(tensor)
            return host, _copier(tensor, host)
        if device != "cpu":
            raise PyroDistributedError(
                f"{what}: a {device} tensor cannot travel on the mpi engine, which carries "
                f"CPU and CUDA tensors; move it to the CPU first"
            )
        return _contiguous(tensor)

    # --- collectives -------------------------------------------------------------------------

    def allreduce_(
        self, tensors: Sequence[Tensor], op: ReduceOp = "sum", names: Sequence[str] = ()
    ) -> None:
        self._allreduce_started(tensors, op, names)

    def allreduce_async_(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Pending:
        if op not in self._ops:
            raise ValueError(f"the mpi engine has no reduction {op!r}")
        what = f"allreduce ({op}) of {name or 'a tensor'}"
        work, copy_back = self._on_host(tensor, what)
        narrow = work.dtype in (torch.float16, torch.bfloat16)
        # MPI has no half-precision sum: add in float32 and round once.
        wire = work.float() if narrow else work
        with self._collective(what):
            request = self._comm.Iallreduce(
                self.MPI.IN_PLACE, self._buffer(wire, self._datatype(wire.dtype)), self._ops[op]
            )

        def finish() -> None:
            if op == "mean":
                wire.div_(self._world_size)
            if narrow:
                work.copy_(wire)
            if copy_back is not None:
                copy_back()

        needs_finish = op == "mean" or narrow or copy_back is not None
        return _MPIPending(
            self, request, what, finish if needs_finish else None, (tensor, work, wire)
        )

    def open_channel(self) -> MPIEngine:
        """The same workers on a duplicated communicator (made by every worker, in order)."""
        channel = MPIEngine.__new__(MPIEngine)
        channel.__dict__.update(self.__dict__)
        channel._comm = self._duplicate(self._comm, "opening a channel")
        return channel

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        if not 0 <= src < self._world_size:
            raise ValueError(
                f"broadcast source {src} does not exist: world size is {self._world_size}"
            )
        what = f"broadcast from worker {src} of {len(tensors)} tensor(s)"
        staged = [self._on_host(tensor, what) for tensor in tensors]
        with self._collective(what):
            requests = [self._comm.Ibcast(self._buffer(work), root=src) for work, _ in staged]
        for request in requests:
            self._wait(request, what)
        for _, copy_back in staged:
            if copy_back is not None:
                copy_back()

    def allgather_object(self, obj: Any) -> list[Any]:
        MPI = self.MPI
        what = "allgather of Python objects"
        payload = pickle.dumps(obj)
        # cpu: sizes of a pickle
        mine = torch.tensor([len(payload)], dtype=torch.int64, device="cpu")
        sizes = torch.zeros(self._world_size, dtype=torch.int64, device="cpu")  # cpu: likewise
        with self._collective(what):
            request = self._comm.Iallgather(
                self._buffer(mine, MPI.INT64_T), [self._buffer(sizes)[0], MPI.INT64_T]
            )
        self._wait(request, what)
        counts = sizes.tolist()
        displacements = [sum(counts[:r]) for r in range(self._world_size)]
        gathered = bytearray(sum(counts))
        with self._collective(what):
            request = self._comm.Iallgatherv(
                [payload, len(payload), MPI.BYTE], [gathered, counts, displacements, MPI.BYTE]
            )
        self._wait(request, what)
        view = memoryview(gathered)
        return [
            pickle.loads(view[start : start + count])
            for start, count in zip(displacements, counts, strict=True)
        ]

    def barrier(self) -> None:
        with self._collective("barrier"):
            request = self._comm.Ibarrier()
        self._wait(request, "barrier")

    def shutdown(self) -> None:
        """Leave together on a clean exit; after a failure, abort the job.

        A worker that left MPI while a peer still waits in a collective would
        leave that peer (and ``mpirun``) hanging, and ``MPI_Finalize`` itself
        can wait for peers. So a clean shutdown first meets every peer
        (bounded), and a failed collective, a missed meeting or a script dying
        of an uncaught exception ends every process of the job with
        ``MPI_Abort``.
        """
        if self.MPI.Is_finalized():
            return
        dying = hasattr(sys, "last_value") or sys.exc_info()[0] is not None
        if not (self._health.failed or dying):
            try:
                self.barrier()
            except PyroDistributedError as err:
                print(f"pyro_distributed: {err}", file=sys.stderr, flush=True)
        if self._health.failed or dying:
            sys.stderr.flush()
            self._comm.Abort(1)
        self._comm.Free()


def _contiguous(tensor: Tensor) -> tuple[Tensor, Callable[[], None] | None]:
    if tensor.is_contiguous():
        return tensor, None
    dense = tensor.contiguous()
    return dense, _copier(tensor, dense)


def _copier(destination: Tensor, source: Tensor) -> Callable[[], None]:
    def copy_back() -> None:
        destination.copy_(source)

    return copy_back


def _has(lost: list[str]) -> str:
    return "has" if len(lost) == 1 else "have"
