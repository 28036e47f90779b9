"""What each worker sends back at the end of a call: ``("ok", value)`` or ``("error", traceback)``.

One reading of those reports, shared by the gloo spawner
(:func:`tests.support.harness.run_workers`) and the MPI pool (``tests/support/mpi_pool.py``).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any


def gather_reports(
    connections: Mapping[int, Connection], timeout: float, died: Callable[[int], str]
) -> tuple[dict[int, Any], dict[int, str]]:
    """Every worker's report, by rank, within ``timeout`` seconds: (the values of
    those that finished, the tracebacks or reasons of the rest). ``died(rank)``
    says what became of a worker whose connection closed without a report."""
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    waiting = dict(connections)
    while waiting and time.monotonic() < deadline:
        for ready in wait(list(waiting.values()), timeout=deadline - time.monotonic()):
            rank = next(r for r, c in waiting.items() if c is ready)
            del waiting[rank]
            try:
                status, payload = pickle.loads(ready.recv_bytes())
            except (EOFError, OSError):
                failures[rank] = died(rank)
                continue
            (results if status == "ok" else failures)[rank] = payload
    for rank in waiting:
        failures[rank] = f"did not finish within {timeout:g} s"
    return results, failures
