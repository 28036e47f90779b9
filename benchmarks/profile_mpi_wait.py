"""Where a step's time goes on the mpi engine: the step, and the engine's waits inside it.

Run it under ``mpiexec`` next to the plain baseline (two independent processes
that never communicate), for example::

    mpiexec -n 2 python benchmarks/profile_mpi_wait.py --workload vae --optim plain
    mpiexec -n 2 python benchmarks/profile_mpi_wait.py --workload vae --optim ours

Worker 0 prints one JSON line: wall and CPU milliseconds per step, and, with
``--optim ours``, how long the engine waited for its collectives per step.
Waiting is the step's only part that two independent processes do not have,
and it has two parts. The worker that arrives first waits for the other (the
imbalance between them: the cost of stepping together, not of the engine);
the worker that arrives last waits only for the collective itself and for
the engine to notice that it is done, and that is the engine's cost. So, for
each collective, the shorter of the workers' waits is the critical path's
wait (``critical_wait_us``, the median over collectives), and the difference
of the two is the imbalance (``imbalance_us``).

``--variant`` replaces the engine's wait for a comparison (not for use):
``old`` is the engine's earlier loop (the clock read at every test),
``block`` waits in MPI (``request.Wait()``, no time-out), ``spin`` tests the
request without pause, ``yield`` yields the core at every test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from profile_step import time_steps
from svi_worker import OPTIMS, prepare, workload_name

import pyro_distributed
from pyro_distributed.engines import mpi


class WaitClock:
    """Times every wait of the mpi engine (wrapping ``MPIEngine._wait``)."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._wait = mpi.MPIEngine._wait
        clock = self

        def timed(engine: Any, request: Any, what: str) -> None:
            start = time.perf_counter()
            clock._wait(engine, request, what)
            clock.waits.append(time.perf_counter() - start)

        mpi.MPIEngine._wait = timed  # type: ignore[method-assign]

    def reset(self) -> None:
        """Forget the waits so far (those of the untimed steps)."""
        self.waits = []


def variant(name: str) -> None:
    """Replace the engine's wait for an A/B run (exploration only)."""
    import os as _os

    if name == "block":

        def block(engine: Any, request: Any, what: str) -> None:
            request.Wait()

        mpi.MPIEngine._wait = block  # type: ignore[method-assign]
    elif name == "spin":

        def spin(engine: Any, request: Any, what: str) -> None:
            while not request.Test():
                pass

        mpi.MPIEngine._wait = spin  # type: ignore[method-assign]
    elif name == "old":

        def old(engine: Any, request: Any, what: str) -> None:  # the earlier loop
            if request.Test():
                return
            start = time.monotonic()
            deadline, next_look = start + engine.timeout.total_seconds(), start + 0.5
            while not request.Test():
                now = time.monotonic()
                waited = now - start
                if now >= next_look:
                    engine.lost_workers()
                    next_look = now + 0.5
                if now >= deadline:
                    raise RuntimeError(f"{what}: time-out")
                if waited >= 1.0:
                    time.sleep(1e-3)
                elif waited >= 2e-4:
                    _os.sched_yield()

        mpi.MPIEngine._wait = old  # type: ignore[method-assign]
    elif name == "yield":

        def yielding(engine: Any, request: Any, what: str) -> None:
            while not request.Test():
                _os.sched_yield()

        mpi.MPIEngine._wait = yielding  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workload", type=workload_name, required=True)
    parser.add_argument("--optim", choices=OPTIMS, required=True)
    parser.add_argument(
        "--variant", choices=("engine", "old", "block", "spin", "yield"), default="engine"
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps (after 20 untimed)")
    args = parser.parse_args()
    variant(args.variant)

    clock = WaitClock()
    training = prepare(args.workload, args.optim, {})
    wall, cpu = time_steps(training, args.steps, warmup=20, at_start=clock.reset)
    waits = list(clock.waits)  # the gather below waits too
    everyone = pyro_distributed.current_engine().allgather_object(waits)
    # Collectives pair up in order, so the workers' i-th waits are one collective's.
    paired = list(zip(*everyone, strict=True)) if len({len(w) for w in everyone}) == 1 else []
    critical = [min(waited) for waited in paired]
    imbalance = [max(waited) - min(waited) for waited in paired]
    if pyro_distributed.is_main():
        summary = {
            "workload": args.workload,
            "optim": args.optim,
            "variant": args.variant,
            "world_size": pyro_distributed.world_size(),
            "wall_ms_per_step": 1000 * wall / args.steps,
            "cpu_ms_per_step": 1000 * cpu / args.steps,
            "waits_per_step": len(waits) / args.steps,
            "wait_ms_per_step": 1000 * sum(waits) / args.steps,
            "median_wait_us": 1e6 * statistics.median(waits) if waits else 0.0,
            "critical_wait_us": 1e6 * statistics.median(critical) if critical else 0.0,
            "imbalance_us": 1e6 * statistics.median(imbalance) if imbalance else 0.0,
        }
        print(json.dumps(summary), flush=True)
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main()
