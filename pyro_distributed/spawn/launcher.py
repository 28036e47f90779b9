"""``pd.launch``: a function on W workers, from a notebook or a script, and what they trained.

The launching process starts the workers (:mod:`.processes`), each of which
joins one engine on loopback and runs the function (:mod:`.worker`), and then
waits in one loop on everything they send: worker 0's output, its progress,
and every worker's report (:mod:`.follow`). The first failure stops every
worker and is raised with the traceback of the worker that caused it; an
interrupt (a notebook's stop button) stops every worker too. When all have
finished, what they trained is loaded into this process (:mod:`.state`).
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from ..runtime import as_timeout
from . import folders, follow, processes, state, worker

#: Engines whose workers a launch can start: the others come with a launcher
#: of their own (horovodrun, mpiexec), which starts them instead.
ENGINES = ("torch",)


@dataclass
class Launched:
    """What a :func:`launch` brought back.

    :param value: what the function returned on worker 0.
    :param world_size: how many workers ran it.
    :param local_rows_loaded: whether the owned local parameters' rows were
        loaded into this process's param store (see ``rows_in_memory``).

    Example::

        first = pd.launch(train, 500, workers=2)
        print(first.value)  # what train returned on worker 0
        second = pd.launch(train, 500, workers=2, resume=first)  # 500 steps more
    """

    value: Any
    world_size: int
    local_rows_loaded: bool
    _trained: state.TrainedState = field(repr=False)

    def local_rows(self, name: str) -> torch.Tensor:
        """Every row of owned local parameter ``name``, read from the workers'
        block files and joined in order (its unconstrained value).

        Example::

            launched = pd.launch(train, workers=4, rows_in_memory=2**30)
            z_loc = launched.local_rows("z_loc")
        """
        return state.read_rows(self._trained, name)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    workers: int = 2,
    engine: str = "torch",
    timeout: float | timedelta | None = None,
    time_limit: float | timedelta | None = None,
    start_method: str | None = None,
    resume: Launched | None = None,
    rows_in_memory: int | None = None,
) -> Launched:
    """Run ``fn(*args)`` on ``workers`` processes that join one engine, from a
    Jupyter kernel or a script, and bring what they trained back here.

    Each worker is a fresh process on this machine, forked from a server
    process that has run no computation (``forkserver``; spawn where the
    platform lacks it), with one GPU each where there are GPUs
    (``LOCAL_RANK``), joined on 127.0.0.1 at a free port. ``fn``, ``args`` and
    this process's param store travel to the workers pickled with cloudpickle,
    so a function defined in the notebook runs as it is. Inside ``fn``, write
    the same code as in a script run by torchrun: ``pd.shard``,
    ``pd.DistributedOptimizer``, ``svi.step``, and
    :func:`pyro_distributed.progress` for a bar that appears here.

    When it returns, this process holds what the workers trained:

    * ``fn``'s return value on worker 0, as ``Launched.value``;
    * the param store as they trained it, written into the tensors that
      already exist here (a guide or ``PyroModule`` made in the kernel holds
      the trained values), and the owned local parameters' rows of every
      worker joined in order;
    * the state of every :class:`~pyro_distributed.DistributedOptimizer`
      ``fn`` made, which a launch with ``resume=`` continues from.

    :param fn: the function every worker runs; unless ``start_method="fork"``,
        it and ``args`` must pickle with cloudpickle.
    :param workers: how many processes (at least 1).
    :param engine: ``"torch"``, the engine the workers join (gloo on CPUs,
        NCCL on GPUs).
    :param timeout: the engine's time-out (:func:`pyro_distributed.init`):
        bounds each collective, so a worker that stops taking part makes the
        others raise after it. It does not bound work outside collectives.
    :param time_limit: a bound on the workers' run (from their start to their
        last report), in seconds or a
        ``timedelta``: past it every worker is stopped and
        :class:`~pyro_distributed.PyroDistributedError` is raised. ``None``:
        no bound (an interrupt still stops every worker).
    :param start_method: ``None`` (forkserver where available, else spawn),
        ``"forkserver"``, ``"spawn"`` or ``"fork"``. Each worker runs
        ``OMP_NUM_THREADS`` intra-op threads where that is set, else this
        machine's cores divided by ``workers`` (at least one); under
        ``"fork"``, one (see the warning below).
    :param resume: an earlier launch of the same model: the k-th optimizer
        ``fn`` makes starts from its k-th optimizer's state, values, step
        count and (at the same number of workers) RNG states, so that two
        launches of n steps end bitwise where one of 2n steps does.
    :param rows_in_memory: the most bytes of owned local rows to load into
        this process; past it they stay on disk, read with
        :meth:`Launched.local_rows`. ``None``: always load them.
    :raises PyroDistributedError: if a worker raised (with its traceback) or
        died, or ``time_limit`` passed; every other worker is stopped first.
        Also, before any worker starts, if workers would be forked from a
        process that has initialised CUDA or holds a torch.distributed group.
    :raises KeyboardInterrupt: after stopping every worker, on an interrupt.

    Example, in a notebook cell::

        import pyro_distributed as pd

        def train(num_steps):
            pd.set_rng_seed(0)
            optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}))
            svi = SVI(model, guide, optim, Trace_ELBO())
            for _ in pd.progress(range(num_steps)):
                loss = svi.step(pd.shard(x), pd.shard(y))
            return loss

        launched = pd.launch(train, 1000, workers=2)
        print(launched.value, guide.median())  # the guide holds the trained values

    .. warning::
        Workers are separate processes: what ``fn`` changes outside Pyro's
        param store and the optimizers it makes (a module's attributes, a
        list in the kernel) stays in the workers. Return it instead.

    .. warning::
        ``start_method="fork"`` copies this process as it is, and GNU
        OpenMP's thread pool (torch's intra-op threads) does not survive a
        fork: a forked worker would wait forever in its first parallel op
        after this process has run one. Forked workers therefore run one
        thread each. A script that launches with forkserver or spawn needs
        multiprocessing's ``if __name__ == "__main__":`` guard.

    .. warning::
        Workers end with the launching process, by any signal (a kernel
        restart included), and the folder a killed launch left in the
        temporary directory is removed by the next launch.
    """
    _check_arguments(fn, workers, engine, resume, rows_in_memory)
    checked_timeout = None if timeout is None else as_timeout(timeout)
    limit = None if time_limit is None else as_timeout(time_limit, "time_limit").total_seconds()
    context = processes.context(start_method)
    method = context.get_start_method()
    pickled = processes.portable(fn, args, method)
    directory = folders.new_folder()
    trained = state.TrainedState(directory)  # removes the directory once unused
    threads = processes.worker_threads(method, workers)
    environment = dict(os.environ)
    port = processes.free_port()
    out_read, out_write = context.Pipe(duplex=False)
    err_read, err_write = context.Pipe(duplex=False)
    counts_read, counts_write = context.Pipe(duplex=False)
    reports: list[Connection] = []
    started: list[BaseProcess] = []
    try:
        for rank in range(workers):
            report_read, report_write = context.Pipe(duplex=False)
            assignment = worker.Assignment(
                rank,
                workers,
                port,
                engine,
                checked_timeout,
                directory,
                resume._trained if resume else None,
                threads,
                environment,
            )
            first = rank == 0
            # The pickled function goes down a pipe of its own, not with the
            # process's arguments, which a worker would hold for its whole life.
            payload_read, payload_write = context.Pipe(duplex=False)
            process = context.Process(  # type: ignore[attr-defined]
                target=worker.run,
                args=(
                    assignment,
                    fn if pickled is None else None,
                    args if pickled is None else (),
                    payload_read if pickled is not None else None,
                    report_write,
                    (out_write, err_write) if first else None,
                    counts_write if first else None,
                ),
                name=f"pyro-distributed-worker-{rank}",
            )
            started.append(process)  # before it starts: an interrupt may come at any moment
            reports.append(report_read)
            process.start()
            for end in (report_write, payload_read):
                end.close()
            with payload_write:
                if pickled is not None:
                    follow.send(payload_write, pickled, rank, started)
        del pickled  # sent: as large as what the function refers to
        for end in (out_write, err_write, counts_write):
            end.close()
        value_bytes, saved = follow.follow(started, reports, out_read, err_read, counts_read, limit)
    except BaseException:
        processes.stop(started)  # on an interrupt too: nothing outlives a launch
        shutil.rmtree(directory, ignore_errors=True)  # not left to the garbage collector
        raise
    finally:
        for end in (out_read, err_read, counts_read, *reports):
            end.close()
    processes.stop(started)
    trained.files, trained.world_size = saved, workers
    in_memory = rows_in_memory is None or state.local_bytes(trained) <= rows_in_memory
    state.load_here(trained, with_local=in_memory)
    return Launched(pickle.loads(value_bytes), workers, in_memory, trained)


def _check_arguments(fn: Any, workers: Any, engine: Any, resume: Any, rows_in_memory: Any) -> None:
    if not callable(fn):
        raise TypeError(f"launch: fn must be a function to run on every worker, got {fn!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"launch: workers must be an int of at least 1, got {workers!r}")
    if engine not in ENGINES:
        raise ValueError(
            f"launch: engine must be one of {ENGINES}, got {engine!r}; horovodrun and "
            f"mpiexec start their own workers, from a terminal"
        )
    if resume is not None and not isinstance(resume, Launched):
        raise TypeError(f"launch: resume must be what an earlier launch returned, got {resume!r}")
    if rows_in_memory is not None and (
        isinstance(rows_in_memory, bool)
        or not isinstance(rows_in_memory, int)
        or rows_in_memory < 0
    ):
        raise ValueError(
            f"launch: rows_in_memory must be None or a number of bytes, got {rows_in_memory!r}"
        )
