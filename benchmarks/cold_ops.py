"""What a torch operation costs right after a training step, against a warm one.

    python benchmarks/cold_ops.py --workload tiny --steps 200
    python benchmarks/cold_ops.py --workload small400 --steps 120

Runs plain Pyro (no pyro_distributed in the step) and, after each step,
times one operation twice in a row on the thread's CPU clock, taking the
operations in turn (one per step, so that each first call really follows a
step). Two kinds:

* fixed-size ones the exchange issues: a flatten of 10 tensors of 100
  floats, a sum of 1,000 floats, an in-place multiply, and a pure-Python
  loop for comparison;
* the least any exchange must do with each of the workload's own P
  parameters: read every ``.grad``, copy every gradient into one flat
  buffer (one call into C++), and point every ``.grad`` at its place in
  that buffer (what makes the averages visible to the optimizer).

Prints the medians. The first of each pair is what the library's code
pays: it runs after the model, the guide and backward have filled the
caches with their own code and data. On this machine that first call costs
several times the second, which is the floor under any per-step figure of
the library's own CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import pyro
import torch
from svi_worker import prepare


def per_parameter_operations() -> dict[str, Callable[[], object]]:
    """The least an exchange does with each parameter, on the param store's tensors."""
    params = [p for _, p in pyro.get_param_store().named_parameters() if p.grad is not None]
    buffer = torch.zeros(sum(p.numel() for p in params))
    pieces = buffer.split([p.numel() for p in params])
    views = [view.view_as(p) for view, p in zip(pieces, params, strict=True)]

    def read() -> object:
        return [p.grad for p in params]

    def copy_in() -> object:
        return torch._foreach_copy_(views, [p.grad for p in params])

    def point() -> None:
        for param, view in zip(params, views, strict=True):
            param.grad = view

    count = len(params)
    return {
        f"read every .grad (P={count})": read,
        f"copy every .grad into one buffer (P={count})": copy_in,
        f"point every .grad into the buffer (P={count})": point,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="tiny")
    parser.add_argument("--steps", type=int, default=200)
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
        **per_parameter_operations(),
    }
    names = list(operations)
    timings: dict[str, tuple[list[int], list[int]]] = {n: ([], []) for n in names}
    for step in range(args.steps):
        training.step()
        name = names[step % len(names)]
        for sample in timings[name]:
            start = time.thread_time_ns()
            operations[name]()
            sample.append(time.thread_time_ns() - start)
    result = {
        name: {
            "first_us": statistics.median(first) / 1e3,
            "second_us": statistics.median(second) / 1e3,
            "samples": len(first),
        }
        for name, (first, second) in timings.items()
    }
    print(json.dumps({"workload": args.workload, "steps": args.steps, "operations": result}))


if __name__ == "__main__":
    main()
