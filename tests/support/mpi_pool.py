"""Many :func:`~tests.support.harness.run_workers` calls on the mpi engine, one
``mpiexec`` per world size.

Starting ``mpiexec -n W`` and importing torch and Pyro on every worker costs
2.5 s at W=2 and 4 s at W=3 on two cores, more than most calls take. So the
first call at a world size launches ``mpiexec -n W python -m tests.support.mpi_pool``
once; its workers connect back to the test process and run one call after
another, each exactly as :func:`tests.support.harness.run_workers` would: a cleared
param store, the engine started with the tests' time-out, ``fn(*args)``, the
engine shut down, and the environment and Pyro's and torch's global switches
put back as they were.

A call that fails anywhere ends its pool, as a crashing script ends its job:
the worker that raised reports its traceback and exits at once, ``mpiexec``
ends the others (they report "died without reporting"), and the next call at
that world size launches a fresh pool. A call that overruns its time-out kills
the pool's process group. :func:`close_all` ends every pool; the test session
calls it at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .reports import gather_reports

ROOT = Path(__file__).resolve().parents[2]
#: How long a fresh pool may take to connect back (mpiexec, imports, a busy machine).
START_TIMEOUT = 120.0
_AUTHKEY_VARIABLE = "TEST_MPI_POOL_KEY"


class MpiPool:
    """One ``mpiexec -n world_size`` launch whose workers run calls on demand."""

    def __init__(self, world_size: int, launcher: list[str], engine_timeout: float) -> None:
        self.world_size = world_size
        self._key = secrets.token_hex(16)
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(START_TIMEOUT)
        port = server.getsockname()[1]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
            ).rstrip(os.pathsep),
            _AUTHKEY_VARIABLE: self._key,
        }
        command = [
            *launcher, sys.executable, "-m", "tests.support.mpi_pool", str(port),
            str(engine_timeout),
        ]  # fmt: skip
        # The workers' output goes to a file, never a pipe that nobody reads
        # between calls (a full pipe would block them); failures quote its end.
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by kill())
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.connections: dict[int, Connection] = {}
        #: The end of what the workers and mpiexec printed, once the pool has ended.
        self.log_tail = ""
        try:
            while len(self.connections) < world_size:
                accepted, _ = server.accept()
                accepted.settimeout(None)
                connection = Connection(accepted.detach())
                key, rank = pickle.loads(connection.recv_bytes())
                if key != self._key:
                    connection.close()
                    continue
                self.connections[rank] = connection
        except OSError as error:
            self.kill()
            raise RuntimeError(
                f"mpiexec -n {world_size} pool did not connect within {START_TIMEOUT:g} s "
                f"({error}): {self.log_tail}"
            ) from error
        finally:
            server.close()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and bool(self.connections)

    def run(
        self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """Run ``fn(*args)`` on every worker: (results by rank, failures by rank).
        Any failure ends the pool."""
        job = pickle.dumps((f"{fn.__module__}:{fn.__name__}", args))
        for connection in self.connections.values():
            connection.send_bytes(job)
        results, failures = gather_reports(
            self.connections, timeout, lambda _: "died without reporting"
        )
        if failures:
            self.kill()
            ending = f"; the pool's output ends:\n{self.log_tail}"
            failures = {
                rank: text if text.startswith("Traceback") else text + ending
                for rank, text in failures.items()
            }
        return results, failures

    def close(self) -> None:
        """Ask the workers to leave; kill the launch if they do not within seconds."""
        for connection in self.connections.values():
            with contextlib.suppress(OSError):
                connection.send_bytes(pickle.dumps(None))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=15)
        self.kill()

    def kill(self) -> None:
        """End the launch at once; keep the end of its output in :attr:`log_tail`."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for connection in self.connections.values():
            connection.close()
        self.connections = {}
        if not self._log.closed:
            self._log.seek(0)
            self.log_tail = self._log.read()[-3000:]
            self._log.close()


_pools: dict[int, MpiPool] = {}


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    timeout: float,
    launcher: list[str],
    engine_timeout: float,
) -> tuple[dict[int, Any], dict[int, str]]:
    """``fn(*args)`` on this world size's pool (launched on first use, again after a failure)."""
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = MpiPool(world_size, launcher, engine_timeout)
    return pool.run(fn, args, timeout)


@atexit.register
def close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()


# --- the workers' side -----------------------------------------------------------------------


def _serve(port: int, engine_timeout: float) -> None:
    import importlib

    import pyro
    import torch
    from pyro.infer.util import is_validation_enabled

    import pyro_distributed

    torch.set_num_threads(1)
    rank = int(os.environ["PMI_RANK"])  # set by MPICH's Hydra for every process it starts
    connection = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    connection.send_bytes(pickle.dumps((os.environ[_AUTHKEY_VARIABLE], rank)))
    while True:
        job = pickle.loads(connection.recv_bytes())
        if job is None:
            return
        target, args = job
        environment = dict(os.environ)
        validation = is_validation_enabled()
        pyro.clear_param_store()
        try:
            module_name, function_name = target.split(":")
            function = getattr(importlib.import_module(module_name), function_name)
            pyro_distributed.init("mpi", timeout=engine_timeout)
            result: tuple[str, Any] = ("ok", function(*args))
        except BaseException:  # report everything, including KeyboardInterrupt
            result = ("error", traceback.format_exc())
        connection.send_bytes(pickle.dumps(result))
        if result[0] == "error":
            # Leave at once, without a goodbye, as a crashing script would:
            # mpiexec then ends the peers still blocked in a collective.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        pyro_distributed.shutdown()
        # What a call may have switched, back as a fresh process has it.
        os.environ.clear()
        os.environ.update(environment)
        pyro.enable_validation(validation)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), float(sys.argv[2]))
