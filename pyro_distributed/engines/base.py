"""What an engine must provide.

An engine is the only place that talks to a transport (torch.distributed,
Horovod, or nothing at all). It offers a handful of collectives on tensors and
picklable objects and knows its own rank and world size. Everything that knows
about Pyro (param-store names, optimizers, plates) lives above it, in
:mod:`pyro_distributed.optim.distributed` and friends, so that adding an engine means adding
one module beside this one and one line in :mod:`pyro_distributed.engines`.

Collectives are blocking: when one returns, its result is in place on this
worker. They must be called in the same order on every worker; the one
exception, :meth:`Engine.allreduce_async_`, returns a :class:`Pending` to
wait on, so that gradients can travel while backward is still running. An
engine turns
its transport's failures (a peer died, a time-out) into
:class:`~pyro_distributed.PyroDistributedError`, naming the collective.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Literal

from torch import Tensor

from ..errors import PyroDistributedError

__all__ = ["DEFAULT_TIMEOUT", "Engine", "Pending", "ReduceOp", "process_is_alive"]

#: How long any collective may block before the workers give up. Long enough
#: for a slow first step, short enough that a lost worker costs a minute and
#: not torch.distributed's default half hour.
DEFAULT_TIMEOUT = timedelta(seconds=60)

ReduceOp = Literal["sum", "mean", "max"]


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

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self._timeout = timeout

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

    def _diagnosis(self) -> str:
        """What probably went wrong, for the message of a failed collective."""
        return "a worker died, hung or took another path through the code"

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Turn the transport's failure inside the block into PyroDistributedError."""
        try:
            yield
        except PyroDistributedError:
            raise
        except self._transport_errors as exc:
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

    @abc.abstractmethod
    def allreduce_(
        self, tensors: Sequence[Tensor], op: ReduceOp = "sum", names: Sequence[str] = ()
    ) -> None:
        """Reduce each tensor across workers, in place.

        All tensors are sent together (fused or issued asynchronously), so a
        call costs one round trip, not one per tensor. ``names``, if given,
        name the collectives for engines that match tensors by name.
        """

    def allreduce_async_(self, tensor: Tensor, op: ReduceOp = "sum", name: str = "") -> Pending:
        """Start reducing ``tensor`` in place; the result is there after ``wait()``.

        Started collectives still pair up across workers in the order they
        were started (or, for engines that match by name, by ``name``). This
        default finishes at once; engines that can overlap override it.
        """
        self.allreduce_([tensor], op, [name] if name else ())
        return _Finished()

    def _allreduce_started(
        self, tensors: Sequence[Tensor], op: ReduceOp, names: Sequence[str]
    ) -> None:
        """:meth:`allreduce_` for engines whose :meth:`allreduce_async_` really
        starts a collective: start them all, then wait, so they can pipeline."""
        pending = [
            self.allreduce_async_(tensor, op, name)
            for tensor, name in zip(tensors, list(names) or [""] * len(tensors), strict=True)
        ]
        for started in pending:
            started.wait()

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
