"""Where a step's time goes: wall time against CPU time, and the torch profiler's top ops.

Run it on two workers next to the plain baseline, for example::

    torchrun --nproc-per-node 2 benchmarks/profile_step.py --workload large1m --optim plain
    torchrun --nproc-per-node 2 benchmarks/profile_step.py --workload large1m --optim ours

(``--optim plain`` under torchrun is the two-independent-processes limit: the
workers join a process group but never communicate.) Worker 0 prints one JSON
line with wall and CPU milliseconds per step, CPU time counting every thread
of the process (gloo's included), then the profiler's table of the ops with
the most CPU time over a few more steps.

If ``cpu_ms_per_step`` rises with W=2 by as much as the step time does, the
extra time is work (copies, sums, socket I/O) on a machine whose cores are
all busy computing, and no overlap can hide it; it can hide only waiting.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
from svi_worker import OPTIMS, prepare, workload_name

import pyro_distributed


def cpu_seconds() -> float:
    """CPU time of this process so far, all threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_steps(
    training: Any, steps: int, warmup: int, at_start: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """Wall and CPU seconds of ``steps`` steps, after ``warmup`` untimed ones and a
    barrier; ``at_start`` runs just before the clock starts."""
    for _ in range(warmup):
        training.step()
    pyro_distributed.barrier()
    at_start()
    wall, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        training.step()
    return time.perf_counter() - wall, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workload", type=workload_name, required=True)
    parser.add_argument("--optim", choices=OPTIMS, required=True)
    parser.add_argument("--steps", type=int, default=50, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--profiled-steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=15, help="rows of the profiler table")
    args = parser.parse_args()

    training = prepare(args.workload, args.optim, {})
    wall, cpu = time_steps(training, args.steps, args.warmup)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(args.profiled_steps):
            training.step()
    if pyro_distributed.is_main():
        summary = {
            "workload": args.workload,
            "optim": args.optim,
            "world_size": pyro_distributed.world_size(),
            "wall_ms_per_step": 1000 * wall / args.steps,
            "cpu_ms_per_step": 1000 * cpu / args.steps,
        }
        print(json.dumps(summary), flush=True)
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        print(table, flush=True)
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main()
