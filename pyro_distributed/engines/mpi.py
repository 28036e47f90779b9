"""The MPI engine: collectives through mpi4py, under ``mpirun``, ``mpiexec`` or ``srun``.

mpi4py is imported only when this engine starts; detection
(:meth:`MPIEngine.detected`) reads the launcher's environment only. What a
user sees when a worker fails is ``docs/guide/faults.md``; the costs are in
``benchmarks/README.md``. The rules the code keeps:

* **Zero copy.** MPI reads and writes a tensor's own memory
  (:mod:`~pyro_distributed.engines.mpi_buffers`); float16 and bfloat16,
  which MPI cannot add, are summed in float32 and rounded back once.
* **Bounded waits.** MPI waits forever for a dead peer, so every collective
  is non-blocking and tested until a deadline, looking for exited peers on
  this host and probing those on others
  (:mod:`~pyro_distributed.engines.probes`). A started collective can never
  be cancelled, so after a failure the engine is broken and
  :meth:`MPIEngine.shutdown` (also at exit) ends the whole job with
  ``MPI_Abort``; where nothing answers the abort, the worker ends itself 5 s
  later. A thread around a blocking ``Wait`` could only abort, never raise.
* **Polling.** A waiting worker spins on its request, then yields the core at
  each test, as MPI's blocking calls do: fastest on cores of its own, costly
  on an oversubscribed machine.
* **Channels.** Collectives pair up in the order they start on one
  communicator; :meth:`MPIEngine.open_channel` duplicates it, so collectives
  started from backward hooks never pair with other ones.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..devices import cuda_device_index
from ..errors import PyroDistributedError
from .base import (
    DEFAULT_TIMEOUT,
    Engine,
    Pending,
    ReduceOp,
    as_bytes,
    describe_lost,
    stacked_rows,
)
from .launchers import mpi_launcher_present, slurm_step
from .mpi_buffers import MPIBuffers, library_takes_cuda
from .network import own_addresses

INSTALL_HINT = (
    "mpi4py is not installed. Install the MPI extra, which brings mpi4py and the "
    "MPICH wheel (no compiler, no system MPI): `pip install mpi4py mpich`, or "
    "`pip install -e '.[mpi]'` in a clone of pyro-distributed. "
    "On a cluster, build mpi4py against the system's MPI instead: "
    "`pip install --no-binary mpi4py mpi4py` with that MPI's `mpicc` on the PATH."
)

#: Seconds that MPI_Abort may take before the process ends itself (SIGALRM).
_ABORT_GRACE_S = 5

#: How often a waiting worker looks for peers on its machine that have exited.
_LIVENESS_INTERVAL = 0.5
#: Spin on the request this long (a small all-reduce takes microseconds), then
#: yield the core at every test, so that a peer sharing it can run; sleep
#: between tests only after a second. MPI moves a large message in chunks,
#: each when both sides test: sleeping earlier stretches every transfer.
_SPIN_S, _YIELD_S, _SLEEP_S = 2e-4, 1.0, 1e-3
#: While spinning, tests between two readings of the clock: a pending test is
#: cheaper than reading the clock and checking the deadline
#: (``benchmarks/README.md``, "Where the mpi engine's wait goes").
_TESTS_PER_LOOK = 16


def import_mpi() -> ModuleType:
    """``mpi4py.MPI`` (initialising MPI), or an ImportError that says how to install it."""
    try:
        return importlib.import_module("mpi4py.MPI")
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


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
    #: Asked after Horovod and torch, whose launchers' environments can sit inside MPI's.
    detection_priority = 10
    launches_own_workers = True
    launcher = "mpiexec"

    @staticmethod
    def detected() -> bool:
        """Whether an MPI launcher (mpirun, mpiexec, srun) started this process.

        A multi-task ``srun`` step without a PMI is also reported here, but
        the torch engine, asked first, takes it (see
        :mod:`~pyro_distributed.engines.launchers`).
        """
        return mpi_launcher_present() or slurm_step()

    def __init__(
        self,
        timeout: timedelta = DEFAULT_TIMEOUT,
        comm: Any = None,
        cuda_aware: bool | None = None,
    ) -> None:
        super().__init__(timeout)
        self.MPI = MPI = import_mpi()
        self._ops = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX}
        parent = MPI.COMM_WORLD if comm is None else comm
        self._rank, self._world_size = parent.Get_rank(), parent.Get_size()
        self._comm = self._duplicate(parent, "starting the mpi engine")
        # Split_type has no non-blocking form. The barrier proves every peer
        # has got this far (bounded), so the split cannot wait for an absent one.
        self.barrier()
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        self._local_rank = node.Get_rank()
        node.Free()
        takes_cuda = library_takes_cuda(self._comm) if cuda_aware is None else cuda_aware
        self._memory = MPIBuffers(MPI, takes_cuda)
        if torch.cuda.is_available():  # each worker its GPU, as the torch engine pins them
            torch.cuda.set_device(cuda_device_index(self._local_rank, torch.cuda.device_count()))
        self._learn_peers()

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
        return self._memory.cuda_aware

    # --- waiting with a deadline -------------------------------------------------------------

    def _wait(self, request: Any, what: str) -> None:
        """Test ``request`` until it completes, a peer is lost, or the time-out passes.

        The worker that arrives last at a collective waits only for the
        collective itself, which MPI moves only while a side tests it, so on
        that path a test must follow a test with nothing between: while it
        spins (the first ``_SPIN_S``), the worker reads the clock, and with it
        checks the time-out and its peers, once every ``_TESTS_PER_LOOK``
        tests. After that it yields the core at every test, and after
        ``_YIELD_S`` sleeps between tests.
        """
        with self._collective(what):
            if request.Test():
                return
            start = time.monotonic()
            deadline = start + self._timeout.total_seconds()
            next_look = start + _LIVENESS_INTERVAL
            tests, waited = 0, 0.0
            while not request.Test():
                tests += 1
                if waited < _SPIN_S and tests % _TESTS_PER_LOOK:
                    continue
                now = time.monotonic()
                waited = now - start
                if now >= next_look:
                    lost = self.lost_workers()
                    if lost:
                        self._fail(what, describe_lost(lost))
                    next_look = now + _LIVENESS_INTERVAL
                if now >= deadline:
                    reason = self._diagnosis(
                        _LIVENESS_INTERVAL,
                        "a worker hung, died on another machine or took another path "
                        "through the code",
                    )
                    self._fail(what, f"no answer within the time-out ({waited:.1f} s): {reason}")
                if waited >= _YIELD_S:
                    time.sleep(_SLEEP_S)
                elif waited >= _SPIN_S:
                    os.sched_yield()

    def _probe_addresses(self) -> tuple[str, ...]:
        """Every address of this host (loopback left out), each listened on
        alone: MPI does not say which interface the other hosts reach."""
        if self._world_size == 1:
            return ()
        return tuple(own_addresses())

    def _fail(self, what: str, reason: str) -> None:
        self._health.failed = True
        raise PyroDistributedError(
            f"{what} failed on worker {self.rank} of {self.world_size}: {reason} "
            f"(mpi engine, time-out {self._timeout.total_seconds():g} s). The job "
            f"cannot go on; pyro_distributed.shutdown(), or the end of the script, "
            f"aborts it with MPI_Abort."
        )

    def _duplicate(self, comm: Any, what: str) -> Any:
        duplicate, request = comm.Idup()
        self._wait(request, what)
        return duplicate

    # --- collectives -------------------------------------------------------------------------

    def allreduce_async_(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Pending:
        if op not in self._ops:
            raise ValueError(f"the mpi engine has no reduction {op!r}")
        what = f"allreduce ({op}) of {name or 'a tensor'}"
        work, copy_back = self._memory.on_host(tensor, what)
        narrow = work.dtype in (torch.float16, torch.bfloat16)
        # MPI has no half-precision sum: add in float32 and round once.
        wire = work.float() if narrow else work
        with self._collective(what):
            request = self._comm.Iallreduce(
                self.MPI.IN_PLACE,
                self._memory.buffer(wire, self._memory.datatype(wire.dtype)),
                self._ops[op],
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
        staged = [self._memory.on_host(tensor, what) for tensor in tensors]
        with self._collective(what):
            requests = [
                self._comm.Ibcast(self._memory.buffer(work), root=src) for work, _ in staged
            ]
        for request in requests:
            self._wait(request, what)
        for _, copy_back in staged:
            if copy_back is not None:
                copy_back()

    def all_gather(self, tensor: Tensor, name: str = "") -> Tensor:
        what = f"all_gather of {name or 'a tensor'}"
        # Only read: a staged or dense copy needs nothing copied back.
        work, _ = self._memory.on_host(tensor, what)
        # As bytes: every dtype travels (MPI has no type for some), bit for bit.
        sent = as_bytes(work)
        gathered = torch.empty(
            self._world_size * sent.numel(), dtype=torch.uint8, device=sent.device
        )
        with self._collective(what):
            request = self._comm.Iallgather(
                self._memory.buffer(sent), [self._memory.buffer(gathered)[0], self.MPI.BYTE]
            )
        self._wait(request, what)
        return stacked_rows(gathered, tensor, self._world_size).to(tensor.device)

    def reduce_scatter(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Tensor:
        """See :meth:`~pyro_distributed.Engine.reduce_scatter`: an all-reduce
        of a copy, of which this worker keeps its rows.

        Not ``MPI_Ireduce_scatter_block``: MPICH (5.0) adds the workers'
        values for it in another order than for its all-reduce once a message
        passes about a megabyte (at three workers, one element in ten of two
        workers' rows of a 3.6 MB float32 tensor differed in the last bits),
        and the rows must be bit for bit what
        :meth:`~pyro_distributed.Engine.allreduce_` gives.
        """
        return self._reduce_scatter_by_allreduce(tensor, op, name)

    def allgather_object(self, obj: Any) -> list[Any]:
        MPI = self.MPI
        what = "allgather of Python objects"
        payload = pickle.dumps(obj)
        # cpu: sizes of a pickle
        mine = torch.tensor([len(payload)], dtype=torch.int64, device="cpu")
        sizes = torch.zeros(self._world_size, dtype=torch.int64, device="cpu")  # cpu: likewise
        with self._collective(what):
            request = self._comm.Iallgather(
                self._memory.buffer(mine, MPI.INT64_T), [self._memory.buffer(sizes)[0], MPI.INT64_T]
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
            # MPI_Abort asks the launcher to end the job, and waits for it. A
            # launcher that cannot reach a lost host's proxy (a cut link) never
            # answers, and the worker would spin in MPI_Abort past every
            # time-out. The kernel's alarm ends this process regardless; no
            # Python thread could, since MPI_Abort may hold the GIL. (Handlers
            # can be set from the main thread only, where atexit runs.)
            if hasattr(signal, "alarm") and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(_ABORT_GRACE_S)
            self._comm.Abort(1)
        self._comm.Free()
        self._close_probe_listener()
