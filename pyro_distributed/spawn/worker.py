"""What each launched worker runs: join the engine, run the function, save what it trained.

Worker 0's output goes to the launching process, which prints it where the
user looks (a notebook cell); the other workers' output is dropped, as a
launcher's would be interleaved. Every worker reports once on its result
pipe: worker 0's return value, or any worker's traceback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from .. import runtime
from ..errors import PyroDistributedError
from . import processes, progress
from .state import Collector, TrainedState


@dataclass(frozen=True)
class Assignment:
    """Everything one worker needs, picklable for spawn."""

    rank: int
    world_size: int
    port: int
    engine: str
    timeout: timedelta | None
    directory: Path
    resume: TrainedState | None
    #: Intra-op threads (:func:`.processes.worker_threads`).
    threads: int
    #: The launching process's environment at the launch: a worker forked from
    #: the forkserver would otherwise see the environment of the server's start.
    environment: dict[str, str]


def run(
    assignment: Assignment,
    fn: Callable[..., Any] | None,
    args: tuple[Any, ...],
    payload: Connection | None,
    results: Connection,
    output: tuple[Connection, Connection] | None,
    counts: Connection | None,
) -> None:
    """The worker process's target."""
    processes.become_group_leader()
    processes.die_with_the_launcher()
    # A SIGINT sent to a worker stops the launch with its KeyboardInterrupt,
    # as in a plain script. Without this, a worker forked from the forkserver
    # keeps what the server had when it started: SIGINT ignored, where the
    # launching script ran as a background job of a shell script, and the
    # worker slept through the signal. (A terminal's Ctrl-C never reaches a
    # worker: each leads a process group of its own.)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _redirect_output(output)
    progress._channel = counts
    os.environ.clear()
    os.environ.update(assignment.environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(assignment.port),
        RANK=str(assignment.rank),
        WORLD_SIZE=str(assignment.world_size),
        LOCAL_RANK=str(assignment.rank),
        LOCAL_WORLD_SIZE=str(assignment.world_size),
        # For what the worker starts (a DataLoader's workers) and native code
        # that reads it; torch's own pool is sized below.
        OMP_NUM_THREADS=str(assignment.threads),
    )
    torch.set_num_threads(assignment.threads)
    # A forked worker holds its parent's engine, if it ran one (a local one):
    # it is not this worker's.
    runtime.drop_inherited_engine()
    try:
        if payload is not None:  # not forked: the function and the kernel's state
            with payload:
                pickled = payload.recv_bytes()
            fn, args, carried = pickle.loads(pickled)
            del pickled  # as large as what the function refers to
            carried.apply()
        assert fn is not None
        engine = runtime.init(assignment.engine, timeout=assignment.timeout)
        collector = Collector(assignment.resume)
        value = fn(*args)
        if runtime._engine is not engine:  # read without starting one
            raise PyroDistributedError(
                "the launched function shut down the workers' engine (pd.shutdown), so "
                "what the workers trained cannot be gathered; leave the engine to the launch"
            )
        saved = collector.save(assignment.directory)
        value_bytes = _pickled_value(value) if assignment.rank == 0 else None
        report: tuple[Any, ...] = ("ok", value_bytes, saved)
    except BaseException:  # every failure is reported, KeyboardInterrupt included
        report = ("error", traceback.format_exc())
    _flush()
    results.send(report)
    if report[0] == "ok":
        runtime.shutdown()
    _flush()
    # After an error, exit without a goodbye, as a crashing script would: the
    # others see the connection drop, and the launching process stops them.


def _pickled_value(value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"worker 0's return value cannot be sent back ({type(exc).__name__}: {exc}); "
            f"return tensors, numbers, and containers of them"
        ) from exc


def _redirect_output(output: tuple[Connection, Connection] | None) -> None:
    """Worker 0 writes to the pipes its launcher reads; the others to nowhere.

    At the file-descriptor level, so that output of C and C++ code travels too.
    """
    if output is None:
        target = os.open(os.devnull, os.O_WRONLY)
        os.dup2(target, 1)
        os.dup2(target, 2)
        os.close(target)
    else:
        os.dup2(output[0].fileno(), 1)
        os.dup2(output[1].fileno(), 2)
    # A forked worker holds its parent's sys.stdout, which in a kernel is the
    # kernel's own stream object: write through the descriptors instead.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed stream
            stream.flush()
