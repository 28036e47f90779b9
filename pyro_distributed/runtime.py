"""The process-wide engine and the module-level API around it.

One engine serves the whole process, as one process group does in
torch.distributed. :func:`init` starts it explicitly; every other function
here starts ``engine="auto"`` on first use, so all of them also work in a
plain single process (rank 0 of 1) without any set-up.
"""

from __future__ import annotations

import atexit
import math
from datetime import timedelta
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from .engines import DEFAULT_TIMEOUT, Engine, check_engine_name, create_engine, detect_engine
from .errors import PyroDistributedError

_engine: Engine | None = None
# Whether _engine was chosen by "auto" (and may be replaced when it is outgrown).
_detected = False


def as_timeout(timeout: float | timedelta, name: str = "timeout") -> timedelta:
    """A duration given as seconds or a timedelta, checked: positive and finite
    (``name`` is the argument the messages name)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"{name} must be seconds (a number) or a timedelta, got {timeout!r}")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be a positive, finite duration, got {timeout!r}")
    return timedelta(seconds=seconds)


def init(engine: str = "auto", *, timeout: float | timedelta | None = None) -> Engine:
    """Start the distributed engine for this process, or return the running one.

    :param engine: ``"auto"`` (default), ``"torch"``, ``"horovod"``, ``"mpi"``
        or ``"local"``. ``"auto"`` returns the running engine if there is one;
        otherwise it picks ``horovod`` under ``horovodrun``, ``torch`` under
        ``torchrun`` or when a torch.distributed process group exists (one
        that Lightning, Ray Train or Accelerate created is adopted, not
        replaced) or under a ``srun`` step without a PMI, ``mpi`` under
        ``mpirun``, ``mpiexec`` or ``srun --mpi=pmi2`` (it needs mpi4py:
        ``pip install mpi4py``), and ``local`` (one
        process, no communication) otherwise. A ``local`` engine that
        ``"auto"`` chose is replaced once a larger process group appears;
        optimizers already bound to it then raise
        :class:`PyroDistributedError` instead of averaging over one worker.
    :param timeout: how long, in seconds or as a :class:`~datetime.timedelta`,
        any collective may block before every worker raises
        :class:`PyroDistributedError`. Defaults to 60 seconds.
    :returns: the engine.
    :raises PyroDistributedError: if a different engine, or a different
        time-out, is already running in this process; or if the engine joined
        another number of workers than its launcher started (an MPI of one
        worker under ``srun --mpi=none``, say).

    Example::

        import pyro_distributed as pd

        pd.init()  # under torchrun: joins the process group; under mpirun: MPI
        print(pd.rank(), pd.world_size())

    .. warning::
        Call :func:`init` at the same point on every worker: with the torch,
        horovod and mpi engines it is itself a collective.
    """
    global _engine, _detected
    wanted_timeout = None if timeout is None else as_timeout(timeout)
    check_engine_name(engine, f"init(engine={engine!r})")
    if _engine is not None and _detected and engine == "auto" and _engine.outgrown():
        _engine.shutdown()  # a local engine: nothing to tear down, nothing in flight
        _engine = None
    if _engine is not None:
        if engine not in ("auto", _engine.name):
            raise PyroDistributedError(
                f"pyro_distributed is already running the {_engine.name!r} engine; "
                f"init(engine={engine!r}) cannot switch engines. Call shutdown() first."
            )
        if wanted_timeout is not None and wanted_timeout != _engine.timeout:
            raise PyroDistributedError(
                f"pyro_distributed is already running with a time-out of "
                f"{_engine.timeout.total_seconds():g} s; init(timeout="
                f"{wanted_timeout.total_seconds():g}) cannot change it. Call shutdown() first."
            )
        return _engine
    name = detect_engine() if engine == "auto" else engine
    _engine = create_engine(name, wanted_timeout or DEFAULT_TIMEOUT)
    _detected = engine == "auto"
    return _engine


def current_engine() -> Engine:
    """The running engine, started with ``init("auto")`` if none is running
    (or if the running one was outgrown, see :func:`init`).

    Example::

        engine = pd.current_engine()
        print(type(engine).__name__, engine.rank, engine.world_size)
    """
    return init()


def shutdown() -> None:
    """Stop the running engine, if any. A later call to any function restarts one.

    A process group that you created yourself is left alone. Example::

        pd.init()
        ...  # train
        pd.shutdown()  # optional: it also runs at exit
    """
    global _engine
    if _engine is not None:
        engine, _engine = _engine, None
        engine.shutdown()


def drop_inherited_engine() -> None:
    """In a forked child: drop the engine copied from the parent, without
    tearing down what belongs to the parent."""
    global _engine
    _engine = None


# Most scripts never call shutdown(). A gloo group still alive while the
# interpreter finalises can abort the process, so tear it down at exit.
atexit.register(shutdown)


def rank() -> int:
    """This worker's global rank (0 in a plain process).

    Example::

        print(f"worker {pd.rank()} of {pd.world_size()}")
    """
    return current_engine().rank


def local_rank() -> int:
    """This worker's rank on its own machine (0 in a plain process).

    Example::

        device = torch.device("cuda", pd.local_rank()) if torch.cuda.is_available() else "cpu"
    """
    return current_engine().local_rank


def world_size() -> int:
    """The number of workers (1 in a plain process).

    Example::

        loader = DataLoader(dataset, batch_size=256 // pd.world_size(), sampler=sampler)
    """
    return current_engine().world_size


def is_main() -> bool:
    """Whether this is worker 0, the one that should print and write files.

    Example::

        if pd.is_main():
            print(f"step {step}: loss {loss:.1f}")
    """
    return current_engine().rank == 0


def barrier() -> None:
    """Wait until every worker reaches this call (bounded by the time-out).

    Example::

        if pd.is_main():
            prepare_files()
        pd.barrier()  # the others read them only after worker 0 wrote them
    """
    current_engine().barrier()


Number = TypeVar("Number", float, Tensor)


def all_mean(value: Number) -> Number:
    """The mean of ``value`` across workers, of the same type as ``value``.

    A float (or int) gives a float; a tensor gives a new tensor of the same
    shape, dtype and device, detached from the graph. Every worker must call it
    with a value of the same shape.

    Example::

        loss = svi.step(batch)
        global_loss = pyro_distributed.all_mean(loss)  # the same on every worker
        if pyro_distributed.is_main():
            print(global_loss)
    """
    engine = current_engine()
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(
                f"all_mean: value must be a floating-point tensor, got dtype {value.dtype}"
            )
        result = value.detach().clone()
        engine.allreduce_([result], op="mean")
        return result
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"all_mean: value must be a float or a tensor, got {value!r:.60}")
    return float_mean(engine, float(value))


def float_mean(engine: Engine, value: float) -> float:
    """The mean of one number across ``engine``'s workers, computed in float64."""
    # cpu: a Python float, read back
    buffer = torch.tensor([value], dtype=torch.float64, device="cpu")
    engine.allreduce_([buffer], op="mean")
    return float(buffer.item())


def any_worker(flag: bool | Tensor) -> bool:
    """Whether ``flag`` is true on at least one worker; the same answer on every worker.

    For decisions that every worker must take together, such as stopping early:
    a worker that left the training loop alone would leave the others waiting
    in their next step.

    Example::

        best, patience = float("inf"), 0
        for step in range(max_steps):
            loss = pd.all_mean(svi.step(x_mine))
            patience = 0 if loss < best else patience + 1
            best = min(best, loss)
            if pd.any_worker(patience >= 100):  # every worker stops at this step
                break

    .. warning::
        A collective: call it on every worker, at the same point.
    """
    return _reduce_flag(flag, "any_worker", negate=False)


def all_workers(flag: bool | Tensor) -> bool:
    """Whether ``flag`` is true on every worker; the same answer on every worker.

    Example::

        if pd.all_workers(converged_here):
            break

    .. warning::
        A collective: call it on every worker, at the same point.
    """
    return not _reduce_flag(flag, "all_workers", negate=True)


def _reduce_flag(flag: bool | Tensor, caller: str, *, negate: bool) -> bool:
    if isinstance(flag, Tensor):
        if flag.numel() != 1:
            raise ValueError(
                f"{caller}: flag must be one flag, got a tensor of shape {tuple(flag.shape)}"
            )
        flag = bool(flag.item())
    if isinstance(flag, np.bool_):
        flag = bool(flag)
    if not isinstance(flag, bool):
        raise TypeError(f"{caller}: flag must be a bool (or a one-element tensor), got {flag!r}")
    # cpu: a Python flag
    buffer = torch.tensor([int(flag != negate)], dtype=torch.int64, device="cpu")
    current_engine().allreduce_([buffer], op="max")
    return bool(buffer.item())
