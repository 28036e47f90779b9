"""What a torch operation costs right after a training step, against a warm one.

    python benchmarks/cold_ops.py --workload tiny --steps 100

Runs plain Pyro (no pyro_distributed in the step) and, after each step,
times a few operations the exchange issues, each twice in a row, on the
thread's CPU clock: a flatten of 10 tensors of 100 floats, a sum of 1,000
floats, an in-place multiply, and a pure-Python loop for comparison. Prints
the medians. The first of each pair is what the library's code pays: it
runs after the model, the guide and backward have filled the caches with
their own code and data. On this machine that first call costs several
times the second, which is the floor under any per-step figure of the
library's own CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from svi_worker import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="tiny")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    training = prepare(args.workload, "plain", {})
    for _ in range(20):
        training.step()
    grads = [torch.randn(100) for _ in range(10)]
    values = torch.randn(1000)
    operations: dict[str, Callable[[], object]] = {
        "flatten 10 x 100": lambda: torch._utils._flatten_dense_tensors(grads),  # type: ignore[no-untyped-call]
        "sum of 1,000": values.sum,
        "multiply in place": lambda: values.mul_(1.0),
        "python loop of 100": lambda: sum(range(100)),
    }
    timings: dict[str, tuple[list[int], list[int]]] = {n: ([], []) for n in operations}
    for _ in range(args.steps):
        training.step()
        for name, operation in operations.items():
            for sample in timings[name]:
                start = time.thread_time_ns()
                operation()
                sample.append(time.thread_time_ns() - start)
    result = {
        name: {
            "first_us": statistics.median(first) / 1e3,
            "second_us": statistics.median(second) / 1e3,
        }
        for name, (first, second) in timings.items()
    }
    print(json.dumps({"workload": args.workload, "steps": args.steps, "operations": result}))


if __name__ == "__main__":
    main()
