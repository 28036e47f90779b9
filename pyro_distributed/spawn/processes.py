"""Worker processes started from a running Python (a Jupyter kernel, a script), and stopped.

Fork is the default where the platform has it: a function defined in the
notebook itself runs as it is, and the workers start from the kernel's state
(its param store, its data). Fork is unsafe once CUDA is initialised in the
parent, so that case is refused before any worker starts. Spawn starts each
worker afresh; the function then travels pickled (by value with cloudpickle
where it is installed, so a notebook's own function still works).

Each worker leads a process group of its own, so that stopping it stops
whatever it started (a DataLoader's workers, say), and nothing outlives a
launch: not a failed one, not an interrupted one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from ..errors import PyroDistributedError

#: How long a worker has to exit on SIGTERM before it is killed.
STOP_GRACE_S = 3.0


def context(start_method: str | None) -> BaseContext:
    """The multiprocessing context to start workers with (``None``: fork where
    the platform has it, else spawn), refused where it cannot work."""
    if start_method not in (None, "fork", "spawn", "forkserver"):
        raise ValueError(
            f"start_method must be None, 'fork', 'spawn' or 'forkserver', got {start_method!r}"
        )
    available = multiprocessing.get_all_start_methods()
    method = start_method or ("fork" if "fork" in available else "spawn")
    if method not in available:
        raise ValueError(f"start_method={method!r} is not available here (only {available})")
    if method == "fork" and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise PyroDistributedError(
            "CUDA is already initialised in this process, and forked workers cannot use "
            "it. Restart the kernel and call pd.launch before anything touches the GPU "
            "(a .cuda() call, a tensor on a GPU), keeping GPU work inside the launched "
            "function; or pass start_method='spawn'"
        )
    return multiprocessing.get_context(method)


def portable(fn: Callable[..., Any], args: tuple[Any, ...], method: str) -> bytes | None:
    """``(fn, args)`` pickled for a spawned worker (``None`` for fork, which needs
    nothing); by value with cloudpickle where plain pickle cannot name ``fn``."""
    if method == "fork":
        return None
    try:
        return pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as plain:
        try:
            import cloudpickle  # type: ignore[import-untyped, import-not-found, unused-ignore]
        except ImportError:
            raise TypeError(
                f"start_method={method!r} must pickle the function and its arguments "
                f"({plain}); a function defined in a notebook needs cloudpickle "
                f"(pip install cloudpickle), or fork (the default on Linux)"
            ) from None
        dumped: bytes = cloudpickle.dumps((fn, args))
        return dumped


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, for the workers' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop(processes: list[BaseProcess]) -> None:
    """Stop every worker and what it started: SIGTERM to each process group,
    then SIGKILL to whatever is left after :data:`STOP_GRACE_S`."""
    groups = [process.pid for process in processes if process.pid is not None]
    for group in groups:
        _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for group in groups:
        _signal_group(group, signal.SIGKILL)
    for process in processes:
        process.join()


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(group, signum)


def become_group_leader() -> None:
    """Called first in a worker: its own process group, so that it and what it
    starts are stopped together (and a Ctrl-C in a terminal reaches only the parent)."""
    if sys.platform != "win32":
        os.setpgid(0, 0)
