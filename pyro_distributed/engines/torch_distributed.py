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
from torch.distributed.rendezvous import rendezvous

from ..devices import cuda_device_index, cuda_transport, this_gpu
from ..errors import PyroDistributedError
from ..torch_internals import PrefixStore
from .base import DEFAULT_TIMEOUT, Engine, Pending, ReduceOp
from .launchers import (
    TORCHRUN_VARIABLES,
    mpi_launcher_present,
    parse_master_port,
    slurm_step,
    torch_rendezvous_from_slurm,
)
from .network import advertised_address, check_peer_addresses, choose_gloo_interface, is_loopback

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _TorchPending(Pending):
    def __init__(
        self, engine: TorchEngine, work: Any, what: str, tensor: Tensor, divisor: int
    ) -> None:
        self._engine, self._work, self._what = engine, work, what
        self._tensor, self._divisor = tensor, divisor

    def wait(self) -> None:
        with self._engine._collective(self._what):
            self._work.wait(self._engine.timeout)
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
        self._local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
        if self._owns_group:
            missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
            if missing and slurm_step():
                slurm = torch_rendezvous_from_slurm()
                slurm.check_port_is_free()
                self._local_rank = slurm.local_rank
                # Keys under the step's ids: tasks of another step that meet
                # this store on a shared port never read or write its keys.
                prefix = f"pyro_distributed/slurm/{slurm.step}"
                self._join_group(timeout, slurm.url, slurm.address, slurm.port, prefix)
            elif missing:
                raise PyroDistributedError(
                    f"engine='torch' found no process group and no torchrun environment "
                    f"(missing {', '.join(missing)}). Launch with `torchrun --nproc-per-node N "
                    f"script.py`, or call torch.distributed.init_process_group() first."
                )
            else:
                # A ValueError that names the variable, not int()'s bare one.
                port = parse_master_port(os.environ["MASTER_PORT"])
                self._join_group(timeout, "env://", os.environ["MASTER_ADDR"], port)
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

    def _join_group(
        self,
        timeout: timedelta,
        url: str,
        master_addr: str,
        port: int,
        prefix: str = "pyro_distributed",
    ) -> None:
        """Join the group at ``url`` (torchrun's ``env://``, or a Slurm step's
        ``tcp://``), with keys under ``prefix`` and unique to this restart,
        over an interface that the other hosts can reach.

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
        store, rank, world_size = _store_of_this_attempt(url, timeout, prefix)
        if world_size > 1:
            choose_gloo_interface(master_addr, port)
            check_peer_addresses(store, rank, world_size)
        dist.init_process_group(
            backend=self._default_backend(max(self._local_rank, 0)),
            store=store,
            rank=rank,
            world_size=world_size,
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
            work = dist.all_reduce(
                tensor, op=_REDUCE_OPS[op], group=self._group(tensor), async_op=True
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
        with self._collective(f"broadcast from worker {src} of {len(tensors)} tensor(s)"):
            works = [
                dist.broadcast(t, src=src, group=self._group(t), async_op=True) for t in tensors
            ]
            for work in works:
                work.wait(self._timeout)

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


def _store_of_this_attempt(url: str, timeout: timedelta, prefix: str) -> tuple[Any, int, int]:
    """The rendezvous store at ``url``, bounded by ``timeout``, with keys under
    ``prefix`` and this restart's count where torchrun's agent store outlives a
    restart (see :meth:`TorchEngine._join_group`); this worker's rank and the
    world size."""
    store, rank, world_size = next(rendezvous(url, timeout=timeout))
    store.set_timeout(timeout)
    attempt = "0"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"{prefix}/attempt{attempt}", store), rank, world_size


def check_addresses_before_a_group(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Under torchrun, check every worker's gloo address through torchrun's own
    store before a host framework (Lightning) makes the process group itself.

    The engine checks before it joins a group of its own (:meth:`TorchEngine._join_group`);
    a group made elsewhere would otherwise wait in gloo's unbounded connect for
    a worker that advertised loopback. It runs only where the store is
    torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE=True``), which every
    worker reaches as a client: elsewhere worker 0 serves the store when the
    group is made, and a second server could not take the port.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if any(name not in os.environ for name in TORCHRUN_VARIABLES):
        return
    prefix = "pyro_distributed/host_framework"
    store, rank, world_size = _store_of_this_attempt("env://", timeout, prefix)
    if world_size > 1:
        check_peer_addresses(store, rank, world_size)
