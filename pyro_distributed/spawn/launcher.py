"""``pd.launch``: a function on W workers, from a notebook or a script, and what they trained.

The launching process starts the workers (:mod:`.processes`), each of which
joins one engine on loopback and runs the function (:mod:`.worker`), and then
waits in one loop on everything they send: worker 0's output, its progress,
and every worker's report. The first failure stops every worker and is raised
with that worker's traceback; an interrupt (a notebook's stop button) stops
every worker too. When all have finished, what they trained is loaded into
this process (:mod:`.state`).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import IO, Any

import torch

from .. import runtime
from ..checks import check_number
from ..errors import PyroDistributedError
from . import folders, processes, progress, state, worker

#: Engines whose workers a launch can start: the others come with a launcher
#: of their own (horovodrun, mpiexec), which starts them instead.
ENGINES = ("torch",)
#: How long a failure waits to see whether a worker that has not reported died,
#: which then is the failure reported.
DEATH_GRACE_S = 0.5
#: The longest a launch reads what worker 0 wrote once it is over (or failed).
DRAIN_S = 0.5
#: What the last line of a worker's error says when it raised because a peer
#: was lost: the engine's own words and gloo's.
LOST_PEER = ("has exited", "Connection closed by peer", "Connection reset by peer")


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
    checked_timeout = None if timeout is None else runtime.as_timeout(timeout)
    limit = None if time_limit is None else _as_seconds("time_limit", time_limit)
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
                    _send(payload_write, pickled, rank, started)
        del pickled  # sent: as large as what the function refers to
        for end in (out_write, err_write, counts_write):
            end.close()
        value_bytes, saved = _follow(started, reports, out_read, err_read, counts_read, limit)
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


def _as_seconds(name: str, value: Any) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    check_number(name, seconds, positive=True)
    return float(seconds)


def _follow(
    started: list[BaseProcess],
    reports: list[Connection],
    out: Connection,
    err: Connection,
    counts: Connection,
    limit: float | None,
) -> tuple[bytes, list[str]]:
    """Wait for every worker's report, passing worker 0's output and progress on;
    worker 0's return value and the saved files, or raise on the first failure
    or once ``limit`` seconds have passed."""
    deadline = None if limit is None else time.monotonic() + limit
    waiting = {reports[rank]: rank for rank in range(len(reports))}
    sentinels = {process.sentinel: rank for rank, process in enumerate(started)}
    streams: dict[Any, IO[str]] = {out: sys.stdout, err: sys.stderr}
    drawing = progress.Drawing()
    drawn = [counts]  # until worker 0 closes it
    outcome: tuple[bytes, list[str]] | None = None
    try:
        while waiting:
            if deadline is not None and time.monotonic() > deadline:
                _drain(streams)
                raise PyroDistributedError(
                    f"the launch ran past its time_limit of {limit:g} s; every worker was "
                    f"stopped (workers {sorted(set(waiting.values()))} of {len(started)} had "
                    f"not finished)"
                )
            ready = wait([*waiting, *streams, *drawn, *sentinels], timeout=1.0)
            for source in ready:
                if source in streams:
                    if not _forward(source, streams[source]):  # type: ignore[arg-type]
                        del streams[source]
                elif source is counts:
                    if not _draw(counts, drawing):
                        drawn.clear()
                elif source in waiting:
                    rank = waiting.pop(source)
                    report = _receive(source, rank, started)
                    if report[0] == "error":
                        _drain(streams)
                        _raise_if_one_died(started, waiting, rank, report[1])
                    if rank == 0:
                        outcome = (report[1], report[2])
                elif source in sentinels:
                    rank = sentinels.pop(source)
                    still = [conn for conn, r in waiting.items() if r == rank]
                    if still and not still[0].poll(1.0):
                        raise PyroDistributedError(
                            f"worker {rank} of {len(started)} died without a word (exit "
                            f"code {started[rank].exitcode}); every worker was stopped"
                            f"{_guard_hint()}"
                        )
        # Every worker has reported, and worker 0 flushed its output before it
        # did: what it wrote is in the pipes now. Read that much and no more, as
        # a process it started may hold the pipes open for as long as it lives.
        _drain(streams, wait_s=0.0)
        while drawn and counts.poll() and _draw(counts, drawing):
            pass
    finally:
        drawing.close()
    assert outcome is not None
    return outcome


def _raise_if_one_died(
    started: list[BaseProcess], waiting: dict[Connection, int], raised: int, report: str
) -> None:
    """Raise the failure to report, once a worker has raised ``report``.

    A worker often raises because a peer vanished or failed first (a closed
    connection, a peer that "has exited"): that peer's failure is the cause.
    So the workers that have not reported get a moment: one that died without
    a word is named; else the first error that is not about a lost peer."""
    errors = {raised: report}
    deadline = time.monotonic() + DEATH_GRACE_S
    for source, rank in waiting.items():
        started[rank].join(max(0.0, deadline - time.monotonic()))
        try:
            if not source.poll():
                continue
            answer = source.recv()
        except EOFError:
            raise PyroDistributedError(
                f"worker {rank} of {len(started)} died without a word (exit code "
                f"{started[rank].exitcode}), and worker {raised} raised after it; every "
                f"worker was stopped{_guard_hint()}"
            ) from None
        if answer[0] == "error":
            errors[rank] = answer[1]
    cause = next((rank for rank, text in errors.items() if not _about_a_lost_peer(text)), raised)
    raise PyroDistributedError(
        f"worker {cause} of {len(started)} raised; every worker was stopped. Its "
        f"traceback:\n{errors[cause]}"
    )


def _about_a_lost_peer(traceback: str) -> bool:
    last = traceback.strip().splitlines()[-1] if traceback.strip() else ""
    return any(sign in last for sign in LOST_PEER)


def _guard_hint() -> str:
    """For a worker that died before it ran anything: the most common cause."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", None):
        return (
            "; if it died at its start, check that the script that launched it keeps "
            'its own code under `if __name__ == "__main__":`, which forkserver and '
            "spawn workers need"
        )
    return ""


def _send(to: Connection, payload: bytes, rank: int, started: list[BaseProcess]) -> None:
    try:
        to.send_bytes(payload)
    except (BrokenPipeError, ConnectionResetError):
        started[rank].join(1.0)
        raise PyroDistributedError(
            f"worker {rank} of {len(started)} died before it received its function "
            f"(exit code {started[rank].exitcode}){_guard_hint()}"
        ) from None


def _receive(source: Connection, rank: int, started: list[BaseProcess]) -> tuple[Any, ...]:
    try:
        report: tuple[Any, ...] = source.recv()
    except EOFError:
        started[rank].join(1.0)
        raise PyroDistributedError(
            f"worker {rank} of {len(started)} died without a word (exit code "
            f"{started[rank].exitcode}); every worker was stopped{_guard_hint()}"
        ) from None
    return report


def _forward(source: Connection, to: IO[str]) -> bool:
    """Pass what worker 0 wrote on; ``False`` once it has closed its end."""
    try:
        data = os.read(source.fileno(), 65536)
    except OSError:
        return False
    if not data:
        return False
    to.write(data.decode(errors="replace"))
    to.flush()
    return True


def _drain(streams: dict[Any, IO[str]], wait_s: float = 0.2) -> None:
    """What worker 0 wrote, so that its last words are shown: each stream until
    nothing more arrives within ``wait_s``, and for :data:`DRAIN_S` at most, as
    a worker (or a process it started) may go on writing for ever."""
    deadline = time.monotonic() + DRAIN_S
    for source, to in list(streams.items()):
        while (
            time.monotonic() < deadline
            and source.poll(min(wait_s, max(0.0, deadline - time.monotonic())))
            and _forward(source, to)
        ):
            pass


def _draw(counts: Connection, drawing: progress.Drawing) -> bool:
    """Draw what worker 0 sent; ``False`` once it has closed its end."""
    try:
        drawing.receive(counts.recv())
    except EOFError:
        return False
    return True
