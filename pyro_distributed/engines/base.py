"""What an engine must provide.

An engine is the only place that talks to a transport: a handful of
collectives on tensors and picklable objects, its rank and world size, and
nothing of Pyro, so adding one is a module beside this one and its line in
the registry of :mod:`pyro_distributed.engines`. The class says what differs
between engines: whether its launcher's environment is present
(:meth:`Engine.detected`, asked in the order of
:attr:`Engine.detection_priority`) and whether that launcher starts every
worker (:attr:`Engine.launches_own_workers`), which integrations ask instead
of naming engines.

Collectives block until their result is in place and must be called in the
same order on every worker; :meth:`Engine.allreduce_async_` alone returns a
:class:`Pending`, so gradients can travel during backward. Most work in
place; :meth:`Engine.all_gather` and :meth:`Engine.reduce_scatter` return a
new tensor. A transport's failures (a dead peer, a time-out) become
:class:`~pyro_distributed.PyroDistributedError`, naming the collective.
"""

from __future__ import annotations

import abc
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from ..errors import PyroDistributedError
from .network import own_addresses
from .probes import UNREACHABLE, Peer, ProbeListener, remote_losses

#: How long any collective may block before the workers give up. Long enough
#: for a slow first step, short enough that a lost worker costs a minute and
#: not torch.distributed's default half hour.
DEFAULT_TIMEOUT = timedelta(seconds=60)

ReduceOp = Literal["sum", "mean", "max"]

#: How long a failed collective's diagnosis keeps looking for a peer that has
#: exited. The transport notices a peer's failure (a dropped connection, say)
#: while that peer may still be tearing down, so a look at once would often
#: find it alive; the wait is paid once, on a path that is already failing.
_TEARDOWN_GRACE_S = 2.0


def process_is_alive(pid: int) -> bool:
    """Whether process ``pid`` on this machine still runs (for naming lost workers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, under another user
    try:  # a killed process that nobody has reaped yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True  # no /proc here: trust kill()


class Pending(abc.ABC):
    """A collective that was started and has not necessarily finished."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the result is in place (bounded by the engine's time-out)."""


class _Finished(Pending):
    def wait(self) -> None:
        pass


class _Health:
    """Whether any collective of an engine or its channels has failed (shared with them)."""

    failed = False


class Engine(abc.ABC):
    """A transport with a rank, a world size and a few collectives.

    :func:`~pyro_distributed.current_engine` returns the running one, and
    :class:`~pyro_distributed.DistributedOptimizer`'s ``engine=`` takes one
    instead of a name. Example::

        engine = pd.current_engine()
        total = torch.tensor([float(len(x_mine))])
        engine.allreduce_([total])  # in place: the sum over the workers
        print(engine.name, engine.rank, engine.world_size, total.item())
    """

    #: The name users pass as ``engine=...``.
    name: ClassVar[str]

    #: Where ``engine="auto"`` asks this engine's :meth:`detected`, highest
    #: first: an engine whose launcher's environment can sit inside another's
    #: asks before it (``horovodrun`` may run on MPI; a torch process group
    #: may be made under ``mpiexec``).
    detection_priority: ClassVar[int] = 0

    #: Whether this engine's own launcher (``horovodrun``, ``mpiexec``) starts
    #: every worker, so that a host framework must start none and make no
    #: torch process group.
    launches_own_workers: ClassVar[bool] = False

    #: The launcher's command, for messages (``"horovodrun"``, ``"mpiexec"``).
    launcher: ClassVar[str] = "the launcher"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.allreduce_ is Engine.allreduce_ and cls.allreduce_async_ is Engine.allreduce_async_:
            raise TypeError(
                f"{cls.__name__} must override allreduce_ or allreduce_async_: "
                f"each default is written with the other"
            )

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self._timeout = timeout
        # Shared with channels: a failure on any of them marks the engine broken.
        self._health = _Health()
        #: Where every worker lives, ``(host, pid)`` by rank, once
        #: :meth:`_learn_peers` ran: to name the lost ones when a collective fails.
        self._peers: list[Peer] = []
        #: Open while this process lives, on what :meth:`_probe_addresses` gave.
        self._probe_listener: ProbeListener | None = None

    @staticmethod
    def detected() -> bool:
        """Whether this process was launched for this engine (read from the environment)."""
        return False

    def outgrown(self) -> str | None:
        """A larger group of workers that this process has joined since this
        engine started, described for a message; ``None`` if there is none.

        Only an engine of one worker can be outgrown: it was chosen before a
        launcher or a host framework (Lightning, say) created a process group.
        """
        return None

    @property
    def timeout(self) -> timedelta:
        """How long a collective may block before it fails."""
        return self._timeout

    #: The transport's exceptions that mean a collective failed.
    _transport_errors: ClassVar[tuple[type[Exception], ...]] = (RuntimeError,)

    # -- liveness of peers, for messages

    def _learn_peers(self) -> None:
        """Record where every worker lives (a collective, made once at start)."""
        self._peers = [
            Peer(*entry)
            for entry in self.allgather_object(
                (socket.gethostname(), os.getpid(), *self._open_probe_listener())
            )
        ]

    def _probe_addresses(self) -> tuple[str, ...]:
        """The addresses at which other hosts can probe this worker's process
        (:mod:`.probes`); empty for an engine that knows of no such place."""
        return ()

    def _open_probe_listener(self) -> tuple[tuple[str, ...], int | None]:
        """Listen on :meth:`_probe_addresses`, and on nothing else, while this
        process lives; what to publish: those addresses and the port."""
        addresses = self._probe_addresses()
        if not addresses:
            return (), None
        try:
            self._probe_listener = ProbeListener(addresses)
        except OSError:
            # The probe only sharpens a failure's message; without it a lost
            # peer on another host is reported as the time-out. Not worth
            # refusing to train for.
            return (), None
        return self._probe_listener.addresses, self._probe_listener.port

    def _close_probe_listener(self) -> None:
        if self._probe_listener is not None:
            self._probe_listener.close()
            self._probe_listener = None

    def lost_workers(self, grace: float = 0.0) -> list[str]:
        """Workers whose process has exited, or whose host cannot be reached,
        described for a message.

        Peers on this machine are looked up by pid; peers on other hosts are
        probed where the engine gave them a probe address (:mod:`.probes`,
        bounded by a second), and otherwise show only as the time-out.
        ``grace`` keeps looking (every 0.1 s) for a peer still tearing down;
        ``0`` looks once, which is what a check on a healthy path wants. Empty
        for an engine that never learnt where its peers are.
        """
        here = socket.gethostname()
        local = [(r, peer.pid) for r, peer in enumerate(self._peers) if peer.host == here]
        deadline = time.monotonic() + grace
        while True:
            lost = [f"worker {r} (pid {pid})" for r, pid in local if not process_is_alive(pid)]
            if lost or not local or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        remote = {r: peer for r, peer in enumerate(self._peers) if peer.host != here}
        if remote and grace > 0:  # the failure path: probing costs up to a second
            lost += remote_losses(remote, frozenset(own_addresses()))
        return lost

    def _diagnosis(
        self,
        grace: float = _TEARDOWN_GRACE_S,
        otherwise: str = "a worker died, hung or took another path through the code",
    ) -> str:
        """What probably went wrong, for the message of a failed collective:
        the lost workers (looked for during ``grace``), or ``otherwise``."""
        lost = self.lost_workers(grace=grace)
        if lost:
            return describe_lost(lost)
        return otherwise

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Turn the transport's failure inside the block into PyroDistributedError."""
        try:
            yield
        except PyroDistributedError:
            raise
        except self._transport_errors as exc:
            self._health.failed = True
            raise PyroDistributedError(
                f"{what} failed on worker {self.rank} of {self.world_size}: "
                f"{self._diagnosis()} ({self.name} engine, time-out "
                f"{self._timeout.total_seconds():g} s). Underlying error: {exc}"
            ) from exc

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This worker's global rank, from 0 to ``world_size - 1``."""

    @property
    @abc.abstractmethod
    def local_rank(self) -> int:
        """This worker's rank among the workers on its machine."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """How many workers take part."""

    def allreduce_(
        self, tensors: Sequence[Tensor], op: ReduceOp = "sum", names: Sequence[str] = ()
    ) -> None:
        """Reduce each tensor across workers, in place.

        All tensors are sent together, so a call costs one round trip, not one
        per tensor. ``names``, if given, name the collectives for engines that
        match tensors by name. This default starts every reduction with
        :meth:`allreduce_async_` and then waits for them all, so that the
        transport can pipeline them (Horovod's background thread fuses what is
        pending into one buffer per cycle); an engine overrides one of the two.
        """
        pending = [
            self.allreduce_async_(tensor, op, name)
            for tensor, name in zip(tensors, list(names) or [""] * len(tensors), strict=True)
        ]
        for started in pending:
            started.wait()

    def allreduce_async_(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Pending:
        """Start reducing ``tensor`` in place; the result is there after ``wait()``.

        Started collectives still pair up across workers in the order they
        were started (or, for engines that match by name, by ``name``). This
        default finishes at once, through :meth:`allreduce_`; engines that can
        overlap override it.
        """
        self.allreduce_([tensor], op, [name] if name else ())
        return _Finished()

    def open_channel(self) -> Engine:
        """An engine on the same workers whose collectives pair up independently of this one's.

        Collectives started from backward hooks go through a channel, so that
        they can never be paired with a collective that some other code
        issues on this engine meanwhile. Opening one is itself a collective.
        Engines that pair collectives by name return themselves.
        """
        return self

    @abc.abstractmethod
    def broadcast_(self, tensors: Sequence[Tensor], src: int = 0) -> None:
        """Overwrite each tensor, in place, with worker ``src``'s values."""

    def all_gather(self, tensor: Tensor, name: str = "") -> Tensor:
        """Every worker's ``tensor``, stacked by rank, in a new tensor.

        Every worker passes a tensor of the same shape and dtype; the result has
        shape ``(world_size, *tensor.shape)`` and row ``r`` holds worker ``r``'s
        tensor, bit for bit (a copy: nothing is added or rounded, whatever the
        dtype). ``name`` names the collective for engines that match
        collectives by name, and in messages. Example::

            engine = pd.current_engine()
            counts = engine.all_gather(torch.tensor([len(x_mine)]))  # shape (world_size, 1)
            print(counts[:, 0].tolist())  # every worker's count, by rank

        This default broadcasts each worker's tensor in turn; every engine of
        this package overrides it with its transport's all-gather.
        """
        gathered = torch.empty(
            (self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        gathered[self.rank].copy_(tensor.detach())
        for source in range(self.world_size):
            self.broadcast_([gathered[source]], src=source)
        return gathered

    def reduce_scatter(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Tensor:
        """This worker's rows of the reduction of every worker's ``tensor``, in a new tensor.

        Every worker passes a tensor of the same shape and dtype, whose first
        dimension ``n`` is a multiple of the world size ``W``; worker ``r`` gets
        rows ``r * n // W`` to ``(r + 1) * n // W`` of the elementwise reduction
        (``op`` as in :meth:`allreduce_`). Those rows are bit for bit what
        :meth:`allreduce_` of the same tensors leaves there. A first dimension
        that the world size does not divide is a ValueError, raised before any
        communication. Example::

            engine = pd.current_engine()
            grads = torch.randn(4 * engine.world_size, 10)  # every worker's
            mine = engine.reduce_scatter(grads, "mean")  # shape (4, 10): my rows of the mean

        This default reduces a copy of the whole tensor with :meth:`allreduce_`
        and keeps this worker's rows.
        """
        return self._reduce_scatter_by_allreduce(tensor, op, name)

    def _rows_per_worker(self, tensor: Tensor, op: ReduceOp) -> int:
        """How many rows of ``tensor`` :meth:`reduce_scatter` leaves on each
        worker; a ValueError, before any communication, where there is no such
        number or no such reduction."""
        if op not in get_args(ReduceOp):
            raise ValueError(f"the {self.name} engine has no reduction {op!r}")
        shape, world = tuple(tensor.shape), self.world_size
        if tensor.dim() == 0:
            raise ValueError(
                f"reduce_scatter splits the first dimension among the workers, and a tensor "
                f"of shape {shape} has none (world size {world})"
            )
        if tensor.shape[0] % world:
            raise ValueError(
                f"reduce_scatter splits the first dimension among the workers, and a tensor "
                f"of shape {shape} has {shape[0]} rows, not a multiple of the world size {world}"
            )
        return tensor.shape[0] // self.world_size

    def _reduce_scatter_by_allreduce(self, tensor: Tensor, op: ReduceOp, name: str) -> Tensor:
        """:meth:`reduce_scatter` as an :meth:`allreduce_` of a copy of
        ``tensor`` of which this worker keeps its rows: bit for bit the
        all-reduce, at the cost of moving the whole tensor."""
        rows = self._rows_per_worker(tensor, op)
        reduced = tensor.detach().clone(memory_format=torch.contiguous_format)
        self.allreduce_([reduced], op, [name] if name else ())
        # A copy of the rows, so that the whole reduced tensor is not kept alive.
        return reduced.narrow(0, self.rank * rows, rows).clone()

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every worker's ``obj`` (picklable), indexed by rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every worker has reached this call."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release what the engine set up (not what the user set up)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} world_size={self.world_size}>"


def as_bytes(tensor: Tensor) -> Tensor:
    """``tensor``'s elements as one flat, contiguous ``uint8`` tensor (a view of
    it where it is contiguous), so that a gather moves bits of any dtype."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def stacked_rows(gathered: Tensor, like: Tensor, world_size: int) -> Tensor:
    """The bytes that :func:`as_bytes` of ``like`` gave on every worker, one
    after another in ``gathered``, as a tensor of shape ``(world_size, *like.shape)``
    and ``like``'s dtype."""
    return gathered.reshape(-1).view(like.dtype).reshape(world_size, *like.shape)


def describe_lost(lost: Sequence[str]) -> str:
    """``"worker 1 (pid 42) has exited"``, for one lost worker or several."""
    exited = [entry for entry in lost if not entry.endswith(UNREACHABLE)]
    said = [f"{', '.join(exited)} {'has' if len(exited) == 1 else 'have'} exited"] if exited else []
    return "; ".join(said + [entry for entry in lost if entry.endswith(UNREACHABLE)])
