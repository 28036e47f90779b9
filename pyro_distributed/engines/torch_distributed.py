"""The torch.distributed engine: gloo for CPU tensors, NCCL for CUDA tensors.

It joins the process group ``torchrun`` describes in the environment, or
reuses (and at shutdown leaves alone) a group the user already made. Groups
it makes get the user's bounded time-out, not torch's 30 minutes. Workers
that share a GPU send CUDA tensors over gloo, as NCCL refuses two ranks on
one device (:func:`pyro_distributed.devices.cuda_transport`). Reductions of
several tensors are issued asynchronously and then awaited, so the transport
can pipeline them; every wait is bounded by the time-out.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Sequence
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..devices import cuda_device_index, cuda_transport, this_gpu
from ..errors import PyroDistributedError
from .base import DEFAULT_TIMEOUT, Engine, Pending, ReduceOp, as_bytes, stacked_rows
from .launchers import (
    TORCHRUN_VARIABLES,
    Rendezvous,
    mpi_launcher_present,
    slurm_step,
    torch_rendezvous_from_slurm,
    torch_rendezvous_from_torchrun,
)
from .network import advertised_address, check_peer_addresses, choose_gloo_interface, is_loopback
from .rendezvous_store import open_store
from .variables import env_int

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _single(current: str, former: str) -> Any:
    """torch.distributed's collective named ``current``, or ``former`` in a
    torch that predates the name. torch 2.13 has both and warns that the
    former (``all_gather_into_tensor``, ``reduce_scatter_tensor``) are
    deprecated; the oldest torch this package supports has only those."""
    return getattr(dist, current, None) or getattr(dist, former)


def _started(work: dist.Work | None, what: str) -> dist.Work:
    """The handle of a collective started with ``async_op=True``.

    torch returns ``None`` instead where this process is not a member of the
    group, which never happens to a group the engine made: refused by name
    rather than left to fail later as an attribute error.
    """
    if work is None:
        raise PyroDistributedError(
            f"torch.distributed started no {what} on worker {dist.get_rank()}: this "
            f"process is not a member of the group it was started on"
        )
    return work


class _TorchPending(Pending):
    def __init__(
        self, engine: TorchEngine, work: dist.Work, what: str, tensor: Tensor, divisor: int
    ) -> None:
        self._engine, self._what = engine, what
        self._work: dist.Work | None = work
        self._tensor, self._divisor = tensor, divisor

    def wait(self) -> None:
        if self._work is not None:
            with self._engine._collective(self._what):
                self._work.wait(self._engine.timeout)
            # Let go of gloo's work as soon as it finished, not when this
            # handle goes: a hook's result keeps the handle until the bucket
            # is decoded, and holding the work that long fragments the main
            # heap (wide40 at W=2: about 3x the page faults a step).
            self._work = None
        if self._divisor != 1:
            self._tensor.div_(self._divisor)


class TorchEngine(Engine):
    """Collectives on a torch.distributed process group."""

    name = "torch"
    #: Under ``mpiexec``, a torch process group (Lightning's ``MPIEnvironment``
    #: makes one) wins over the MPI engine.
    detection_priority = 20

    @staticmethod
    def detected() -> bool:
        """Whether this process was launched by torchrun, already joined a
        group, or is a task of a ``srun`` step that MPI could not join (no PMI)."""
        if dist.is_available() and dist.is_initialized():
            return True
        if all(variable in os.environ for variable in TORCHRUN_VARIABLES):
            return True
        return slurm_step() and not mpi_launcher_present()

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not dist.is_available():
            raise PyroDistributedError(
                "engine='torch' needs a torch build with torch.distributed; this one has none"
            )
        super().__init__(timeout)
        self._owns_group = not dist.is_initialized()
        self._local_rank = -1
        if self._owns_group:
            missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
            if missing and not slurm_step():
                raise PyroDistributedError(
                    f"engine='torch' found no process group and no torchrun environment "
                    f"(missing {', '.join(missing)}). Launch with `torchrun --nproc-per-node N "
                    f"script.py`, or call torch.distributed.init_process_group() first."
                )
            joining = torch_rendezvous_from_slurm() if missing else torch_rendezvous_from_torchrun()
            if missing:
                # A derived or reserved Slurm port is checked before it is served.
                # Under torchrun's variables, a port held by another process fails
                # the store at once (EADDRINUSE, named by _store_failure), and one
                # this process still serves from an earlier engine is reused.
                joining.check_port_is_free()
            if joining.local_rank is not None:
                self._local_rank = joining.local_rank
            self._join_group(timeout, joining)
        elif "LOCAL_RANK" in os.environ:
            self._local_rank = env_int(
                "LOCAL_RANK", minimum=0, what="this worker's rank on its host"
            )
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        if self._local_rank < 0:
            self._local_rank = self._rank
        self._backend = str(dist.get_backend())
        # Channels (open_channel) share this set, so that shutdown reaches them.
        self._channels: weakref.WeakSet[TorchEngine] = weakref.WeakSet()
        self._shut = False
        self._cpu_group = self._group_for_cpu_tensors()
        self._cuda_group: Any = None  # the default group, when it has NCCL
        self._learn_peers()
        self._cuda_backend = self._transport_for_cuda_tensors()

    def _join_group(self, timeout: timedelta, joining: Rendezvous) -> None:
        """Join the group that ``joining`` describes (torchrun's variables, or a
        Slurm step's), with keys under its prefix, over an interface that the
        other hosts can reach.

        After ``torchrun --max-restarts`` restarts a job on its agent's store
        (``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's default), that store
        still holds the previous attempt's connection keys, and workers that
        read them dial peers that no longer exist. A prefix per restart keeps
        every attempt's keys apart, as torch's own ``env://`` does. Where each
        round gets a store of its own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``),
        there are no stale keys, and no such prefix: a host restarted by hand
        counts its restarts from 0 while a survivor counts 1, so the prefix
        would part workers of the same round. Before gloo connects, every worker
        checks that no worker would advertise a loopback address to another
        host (:mod:`.network`): gloo's own connect would wait unbounded.
        """
        store = open_store(joining, timeout)
        if joining.world_size > 1:
            choose_gloo_interface(joining.address, joining.port)
            check_peer_addresses(store, joining.rank, joining.world_size)
        dist.init_process_group(
            backend=self._default_backend(max(self._local_rank, 0)),
            store=store,
            rank=joining.rank,
            world_size=joining.world_size,
            timeout=timeout,
        )

    @staticmethod
    def _default_backend(local_rank: int) -> str:
        if torch.cuda.is_available() and dist.is_nccl_available():
            torch.cuda.set_device(cuda_device_index(local_rank, torch.cuda.device_count()))
            return "cpu:gloo,cuda:nccl"
        return "gloo"

    def _probe_addresses(self) -> tuple[str, ...]:
        """The address gloo gives its peers, where other hosts can reach it."""
        address = advertised_address().address
        if self._world_size == 1 or address is None or is_loopback(address):
            return ()  # one host, or an address only this host can reach
        return (address,)

    def _group_for_cpu_tensors(self) -> Any:
        """The group that carries CPU tensors and pickled objects.

        A group the user made with NCCL alone cannot move CPU tensors, so we
        add a gloo group beside it (a collective call, made by every worker
        as it creates the engine).
        """
        if "gloo" in self._backend:
            return None  # the default group
        return dist.new_group(backend="gloo", timeout=self._timeout)

    def _transport_for_cuda_tensors(self) -> str | None:
        """Decide, with every worker, how CUDA tensors travel (see :mod:`..devices`).

        Workers that share a GPU cannot use NCCL: their CUDA tensors go over a
        gloo group (made here, by every worker alike), with one warning.
        """
        transport = cuda_transport(self._backend, self.allgather_object(this_gpu()))
        if transport.backend == "gloo":
            if transport.warning and self._rank == 0:
                warnings.warn(transport.warning, RuntimeWarning, stacklevel=4)
            if "nccl" in self._backend:
                # The default group would hand CUDA tensors to NCCL: a gloo group of our own.
                with self._collective("creating a process group"):
                    self._cuda_group = dist.new_group(backend="gloo", timeout=self._timeout)
        return transport.backend

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _open_group(self) -> Any:
        """The group for CPU tensors and objects, unless this engine was shut down."""
        if self._shut:
            raise PyroDistributedError(
                "this engine was shut down (pd.shutdown()); start another with pd.init()"
            )
        return self._cpu_group

    def _group(self, tensor: Tensor) -> Any:
        cpu_group = self._open_group()
        device = tensor.device.type
        if device == "cpu":
            return cpu_group
        if device == "cuda" and self._cuda_backend is not None:
            return self._cuda_group
        raise PyroDistributedError(
            f"a {device} tensor cannot travel on this process group (backend "
            f"{self._backend!r}, which carries CPU tensors only). Keep parameters on the "
            f"CPU, or use a group with NCCL for CUDA tensors: pyro_distributed picks "
            f"'cpu:gloo,cuda:nccl' itself when CUDA is available."
        )

    def allreduce_async_(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Pending:
        if op not in _REDUCE_OPS:
            raise ValueError(f"the torch engine has no reduction {op!r}")
        what = f"allreduce ({op}) of {name or 'a tensor'}"
        with self._collective(what):
            work = _started(
                dist.all_reduce(
                    tensor, op=_REDUCE_OPS[op], group=self._group(tensor), async_op=True
                ),
                what,
            )
        divisor = self._world_size if op == "mean" else 1
        return _TorchPending(self, work, what, tensor, divisor)

    def open_channel(self) -> TorchEngine:
        """The same workers over new process groups (made by every worker, in the same order)."""
        channel = TorchEngine.__new__(TorchEngine)
        channel.__dict__.update(self.__dict__, _owns_group=False)
        with self._collective("creating a process group"):
            channel._cpu_group = dist.new_group(backend="gloo", timeout=self._timeout)
            if self._cuda_backend is not None:
                channel._cuda_group = dist.new_group(
                    backend=self._cuda_backend, timeout=self._timeout
                )
        self._channels.add(channel)
        return channel

    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        what = f"broadcast from worker {src} of {len(tensors)} tensor(s)"
        with self._collective(what):
            works = [
                _started(dist.broadcast(t, src=src, group=self._group(t), async_op=True), what)
                for t in tensors
            ]
            for work in works:
                work.wait(self._timeout)

    def all_gather(self, tensor: Tensor, name: str = "") -> Tensor:
        what = f"all_gather of {name or 'a tensor'}"
        group = self._group(tensor)
        # As bytes: every dtype travels, and arrives bit for bit.
        sent = as_bytes(tensor)
        gathered = sent.new_empty(self._world_size * sent.numel())
        gather = _single("all_gather_single", "all_gather_into_tensor")
        with self._collective(what):
            _started(gather(gathered, sent, group=group, async_op=True), what).wait(self._timeout)
        return stacked_rows(gathered, tensor, self._world_size)

    def reduce_scatter(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Tensor:
        """See :meth:`~pyro_distributed.Engine.reduce_scatter`.

        On gloo, torch's own reduce-scatter, which gloo carries out as an
        all-reduce of a copy of which each worker keeps its rows: bit for bit
        :meth:`~pyro_distributed.Engine.allreduce_`. NCCL's reduce-scatter is
        an algorithm of its own, and nothing promises that it adds the workers'
        values in the order its all-reduce does (MPICH's and Horovod's do not);
        CUDA tensors on NCCL therefore go through
        :meth:`~pyro_distributed.Engine.allreduce_` too.
        """
        rows = self._rows_per_worker(tensor, op)
        if tensor.device.type == "cuda" and self._cuda_backend == "nccl":
            return self._reduce_scatter_by_allreduce(tensor, op, name)
        what = f"reduce_scatter ({op}) of {name or 'a tensor'}"
        group = self._group(tensor)
        sent = tensor.detach().contiguous()
        mine = sent.new_empty((rows, *sent.shape[1:]))
        scatter = _single("reduce_scatter_single", "reduce_scatter_tensor")
        with self._collective(what):
            _started(
                scatter(mine, sent, op=_REDUCE_OPS[op], group=group, async_op=True), what
            ).wait(self._timeout)
        if op == "mean":
            mine.div_(self._world_size)  # as allreduce_ divides the sum
        return mine

    def allgather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self._world_size
        with self._collective("allgather of Python objects"):
            dist.all_gather_object(gathered, obj, group=self._open_group())
        return gathered

    def barrier(self) -> None:
        with self._collective("barrier"):
            # monitored_barrier names the workers that did not arrive; it
            # needs gloo, which the CPU group always has.
            dist.monitored_barrier(
                group=self._open_group(), timeout=self._timeout, wait_all_ranks=True
            )

    def shutdown(self) -> None:
        self._close_probe_listener()
        if not (self._owns_group and dist.is_initialized()):
            return
        # On a clean exit, tear down together: a gloo group destroyed while a
        # peer's is still open can abort the slower process ("terminate called
        # without an active exception"). After a failure, or when the script
        # is dying of an uncaught exception, leave at once: peers then see the
        # connection drop instead of waiting. The group's threads are not
        # joined then (one may be blocked on the lost peer until gloo's
        # time-out): the process is leaving anyway.
        dying = hasattr(sys, "last_value") or sys.exc_info()[0] is not None
        if self._health.failed or dying:
            _LEFT_BEHIND.append(dist.group.WORLD)
            dist.destroy_process_group()
            return
        with suppress(RuntimeError):
            dist.monitored_barrier(timeout=min(self._timeout, timedelta(seconds=10)))
        dist.destroy_process_group()
        self._release_groups()

    def _release_groups(self) -> None:
        """Drop this engine's and its channels' references to their groups, the
        last ones once the groups are destroyed, so that each group's threads
        are joined now. A group that lives on until the interpreter finalises
        can abort the process at exit, when one of its threads releases a
        finished collective's tensors and takes the GIL."""
        for engine in [self, *self._channels]:
            engine._cpu_group = engine._cuda_group = None
            engine._shut = True


#: Groups left when leaving after a failure (see :meth:`TorchEngine.shutdown`).
_LEFT_BEHIND: list[Any] = []
