"""Worker processes started from a running Python (a Jupyter kernel, a script), and stopped.

The default start method is ``forkserver`` where the platform has it (spawn
elsewhere): each worker is forked from a small server process that was
started fresh and has run no computation, so nothing of the launching
process's threads comes along. Forking the launching process itself is not
safe once it has computed: GNU OpenMP's thread pool (torch's intra-op
threads) does not survive ``fork()``, and a forked worker's next parallel op
waits forever for threads that do not exist in it; a torch.distributed
process group's threads are lost the same way. A kernel has nearly always
run a torch op before it launches, so fork is kept for those who ask for it
by name, and then runs one thread per worker (the one count that is safe in
such a child, as torch's own DataLoader workers do) and is refused where the
launching process holds a process group or has initialised CUDA.

With forkserver and spawn the function and its arguments travel pickled with
cloudpickle (by value for a function defined in a notebook or a script's
``__main__``), together with the launching process's param store, so that a
worker starts from what the kernel holds as a forked one would. The server
preloads torch, Pyro and this package once, so later launches start in a
fraction of a second.

Each worker leads a process group of its own, so that stopping it stops
whatever it started (a DataLoader's workers, say), and nothing outlives a
launch: not a failed one, not an interrupted one, and not a launching
process that was killed (:func:`die_with_the_launcher`).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from ..engines.launchers import declared_world_size
from ..errors import PyroDistributedError
from ..pyro_internals import reduce_autoguide
from .carried import Carried

#: How long a worker has to exit on SIGTERM before it is killed.
STOP_GRACE_S = 3.0
#: What the forkserver imports once, so that each worker forked from it starts
#: without importing torch and Pyro again.
PRELOAD = ["pyro_distributed.spawn.worker"]
#: Linux's prctl option that asks the kernel to signal a process when its parent dies.
_PR_SET_PDEATHSIG = 1


def context(start_method: str | None) -> BaseContext:
    """The multiprocessing context to start workers with (``None``: forkserver
    where the platform has it, else spawn), refused where it cannot work."""
    if start_method not in (None, "fork", "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be None, 'fork', 'spawn' or 'forkserver', got {start_method!r}"
        )
    available = multiprocessing.get_all_start_methods()
    method = start_method or ("forkserver" if "forkserver" in available else "spawn")
    if method not in available:
        raise ValueError(f"start_method={method!r} is not available here (only {available})")
    _refuse_a_worker()
    if method == "fork":
        _refuse_what_fork_cannot_carry()
    chosen = multiprocessing.get_context(method)
    if method == "forkserver":
        chosen.set_forkserver_preload(PRELOAD)
    return chosen


def _refuse_a_worker() -> None:
    """A launch inside one worker of many would train a second, separate run
    while the other workers wait for this one in their next collective."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        within = f"worker {dist.get_rank()} of {dist.get_world_size()} of a running group"
    elif (declared := declared_world_size()) is not None and declared.world_size > 1:
        within = f"one of {declared.world_size} workers of {declared.launcher}"
    else:
        return
    raise PyroDistributedError(
        f"pd.launch was called in {within} (a launched worker, or a script under a "
        f"launcher), where it would start a separate run in each worker. Launch once, "
        f"from the kernel or a plain process, with as many workers as the run needs"
    )


def _refuse_what_fork_cannot_carry() -> None:
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise PyroDistributedError(
            "CUDA is already initialised in this process, and forked workers cannot use "
            "it. Leave start_method at its default (forkserver), or pass "
            "start_method='spawn'; or restart the kernel and launch before anything "
            "touches the GPU"
        )
    if dist.is_available() and dist.is_initialized():
        raise PyroDistributedError(
            "this process holds a torch.distributed process group (a Lightning fit or a "
            "launched worker), whose threads a forked worker would inherit half of and "
            "wait on forever. Leave start_method at its default (forkserver), or pass "
            "start_method='spawn'"
        )


def portable(fn: Callable[..., Any], args: tuple[Any, ...], method: str) -> bytes | None:
    """What a worker that is not a fork of this process needs, pickled: ``fn``,
    ``args`` and this interpreter's state (:class:`.carried.Carried`; ``None``
    for fork, which needs nothing). One pickle, so that a module and the store
    keep sharing tensors."""
    if method == "fork":
        return None
    buffer = io.BytesIO()
    try:
        _pickler(buffer).dump((fn, args, Carried.capture()))
    except Exception as exc:
        raise TypeError(
            f"start_method={method!r} sends the function, its arguments and the param "
            f"store to the workers pickled, and they do not pickle ({type(exc).__name__}: "
            f"{exc}); pass what the function needs as plain data, or build it inside "
            f"the function"
        ) from exc
    return buffer.getvalue()


def _pickler(buffer: io.BytesIO) -> Any:
    """cloudpickle's pickler (functions and classes of a notebook by value),
    which also keeps an AutoGuide's model (:func:`.pyro_internals.reduce_autoguide`)."""
    import cloudpickle  # type: ignore[import-untyped, import-not-found, unused-ignore]

    class Pickler(cloudpickle.Pickler):  # type: ignore[misc, unused-ignore]
        def reducer_override(self, obj: Any) -> Any:
            reduced = reduce_autoguide(obj)
            return reduced if reduced is not None else super().reducer_override(obj)

    return Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL)


def worker_threads(method: str, world_size: int) -> int:
    """The intra-op threads of each worker: ``OMP_NUM_THREADS`` where set, else
    this process's cores shared out (at least one each); one under fork."""
    if method == "fork":
        return 1
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, for the workers' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop(processes: list[BaseProcess]) -> None:
    """Stop every worker and what it started: SIGTERM to each process group,
    then SIGKILL to whatever is left after :data:`STOP_GRACE_S`, including
    a worker's descendants that left its group (``setsid``) but are still
    its descendants."""
    groups = [process.pid for process in processes if process.pid is not None]
    strays = {pid for group in groups for pid in _descendants(group)}
    for group in groups:
        _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for group in groups:
        _signal_group(group, signal.SIGKILL)
    for pid in strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for process in processes:
        process.join()


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(group, signum)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from Linux's /proc children lists (none
    where there are no such lists)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as children:
                    below = [int(child) for child in children.read().split()]
            except (OSError, ValueError):
                continue
            found.extend(below)
            pending.extend(below)
    return found


def become_group_leader() -> None:
    """Called first in a worker: its own process group, so that it and what it
    starts are stopped together (and a Ctrl-C in a terminal reaches only the parent)."""
    if sys.platform != "win32":
        os.setpgid(0, 0)


def die_with_the_launcher() -> None:
    """Called in a worker, after :func:`become_group_leader`: when the launching
    process ends by any signal (a kernel restart, ``timeout``, a scheduler's
    SIGKILL), this worker's process group is killed within a moment.

    Two guards. multiprocessing's parent sentinel, a pipe whose other end only
    the launching process holds, reaches end-of-file when it dies: a watching
    thread then kills the group (what the worker started included). And on
    Linux the operating system kills the worker when its parent dies
    (``PR_SET_PDEATHSIG``), which needs no thread to get the GIL (a worker
    stuck in C code, or stopped): under forkserver the parent is the server,
    which exits when the launching process does, once no worker holds the
    server's lifeline (:func:`_let_the_forkserver_go`). That second guard
    kills the worker alone; what it started goes with the first.
    """
    _let_the_forkserver_go()
    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        sentinel = parent.sentinel
        threading.Thread(
            target=_kill_group_when_ready,
            args=(sentinel,),
            name="pyro-distributed-lifeline",
            daemon=True,
        ).start()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            parent_pid = os.getppid()
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent_pid:  # it died before the request took hold
                _kill_group()


def _let_the_forkserver_go() -> None:
    """A worker forked by the forkserver holds a copy of the server's lifeline
    (the pipe whose end-of-file tells the server that its launching process
    has gone): close it, so that the server exits with that process, and the
    operating system then ends this worker too."""
    from multiprocessing import forkserver

    # multiprocessing's own names: no public call lets a child go of it. A
    # worker forked from a kernel that ran a forkserver holds the kernel's end.
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def _kill_group_when_ready(sentinel: int) -> None:
    wait([sentinel])
    _kill_group()


def _kill_group() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)
