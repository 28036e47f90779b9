"""The library's own CPU time per step, the collectives and the wrapped optimizer excluded.

    python benchmarks/library_cpu.py --workload tiny --optim ours
    torchrun --nproc-per-node 2 benchmarks/library_cpu.py --workload tiny --optim ours

A step's time is Pyro's (the model, the guide, backward), the wrapped
optimizer's (Adam), the collectives' (the transfer and the wait for the
peer), and this library's own Python: naming, agreeing, packing, the hooks.
Only the last is ours to cut, and on a shared machine it is lost in the noise
of the others. So this measures it directly: every entry point of the
library (the front ends' step, the backward hooks) runs under a meter that
reads the calling thread's CPU clock on entry and exit, and every call into
the engine's collectives or the wrapped optimizer made from inside is
metered the same way and subtracted. What remains is CPU time spent in
pyro_distributed's code and the torch operations it issues (packing,
copying, checking), per step. The meter's own cost (two clock reads per
metered call) is measured in the same process and subtracted as well.

Worker 0 prints one JSON line: ``library_us_per_step``, ``metered_calls``
per step, ``process_cpu_ms_per_step`` (every thread of the process, the
collective's included) and ``wall_ms_per_step``. With ``--profile N`` it then
profiles N more steps with cProfile and prints the functions of
pyro_distributed with the most own time (cProfile's overhead inflates them;
read their order, not their size).

The patches are applied by name, to whichever of the entry points exist, so
the same script measures an older tree: put it first on ``PYTHONPATH``.
``--compare BEFORE_TREE`` does that for every workload and world size asked
for, interleaved (before, after, before, after, ...), and prints medians and
min-max over the repeats::

    git archive main pyro_distributed | tar -x -C /tmp/before
    python benchmarks/library_cpu.py --compare /tmp/before --repeats 5
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import json
import os
import pstats
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from svi_worker import OPTIMS, prepare, workload_name

import pyro_distributed
from pyro_distributed.engines import Engine, Pending

# The library's entry points: where a step enters pyro_distributed's code.
OURS = (
    ("pyro_distributed.optim.distributed", "DistributedOptimizer", "__call__"),
    ("pyro_distributed.optim.torch_optimizer", "DistributedTorchOptimizer", "step"),
    ("pyro_distributed.optim.torch_optimizer", "DistributedTorchOptimizer", "zero_grad"),
    ("pyro_distributed.exchange.overlap", "BackwardOverlap", "accumulated"),
    ("pyro_distributed.optim.step_guards", "GradStamps", "_stamp"),
)
# Not ours, though called from inside: the wrapped optimizer's work.
WRAPPED = (
    ("pyro.optim.optim", "PyroOptim", "__call__"),
    ("torch.optim.adam", "Adam", "step"),
    ("torch.optim.optimizer", "Optimizer", "zero_grad"),
)
# The engine's collectives, on every engine class (found at run time).
COLLECTIVES = ("allreduce_", "allreduce_async_", "broadcast_", "allgather_object", "barrier")


class Meter:
    """Thread CPU time inside the library's entry points, less time inside exclusions."""

    def __init__(self) -> None:
        self.ours_ns = 0
        self.calls = 0
        self._depth = 0  # nesting of entry points
        self._excluded_depth = 0
        #: Python and builtin function calls made inside the library (see count_calls).
        self.python_calls = 0

    def count_calls(self, frame: Any, event: str, arg: Any) -> None:
        """A ``sys.setprofile`` function: counts every call made inside the library.

        Unlike CPU time, the count does not depend on the machine's load: on a
        shared machine it is the figure that compares two versions exactly.
        """
        if event in ("call", "c_call") and self._depth and not self._excluded_depth:
            self.python_calls += 1

    def ours(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def metered(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return function(*args, **kwargs)
            self._depth = 1
            self.calls += 1
            started = time.thread_time_ns()
            try:
                return function(*args, **kwargs)
            finally:
                self.ours_ns += time.thread_time_ns() - started
                self._depth = 0

        return metered

    def excluded(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def metered(*args: Any, **kwargs: Any) -> Any:
            if not self._depth or self._excluded_depth:
                return function(*args, **kwargs)
            self._excluded_depth = 1
            self.calls += 1
            started = time.thread_time_ns()
            try:
                return function(*args, **kwargs)
            finally:
                self.ours_ns -= time.thread_time_ns() - started
                self._excluded_depth = 0

        return metered


def subclasses(cls: type) -> Iterator[type]:
    yield cls
    for sub in cls.__subclasses__():
        yield from subclasses(sub)


def install(meter: Meter) -> list[str]:
    """Patch every entry point and exclusion that exists; the names patched."""
    patched = []
    for table, wrap in ((OURS, meter.ours), (WRAPPED, meter.excluded)):
        for module_name, class_name, method in table:
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                continue
            if method in vars(cls):
                setattr(cls, method, wrap(vars(cls)[method]))
                patched.append(f"{class_name}.{method}")
    importlib.import_module("pyro_distributed.engines.torch_distributed")
    for base, methods in ((Engine, COLLECTIVES), (Pending, ("wait",))):
        for cls in subclasses(base):
            for method in methods:
                if method in vars(cls):
                    setattr(cls, method, meter.excluded(vars(cls)[method]))
                    patched.append(f"{cls.__name__}.{method}")
    return patched


def clock_cost_ns(reads: int = 20000) -> float:
    """What one metered call costs in clock reads (two per call)."""
    started = time.perf_counter_ns()
    for _ in range(reads):
        time.thread_time_ns()
    return 2 * (time.perf_counter_ns() - started) / reads


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def top_functions(profile: cProfile.Profile, steps: int, rows: int) -> list[dict[str, Any]]:
    """The library's functions with the most own time per step (cProfile's tottime)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    ours = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        if "pyro_distributed" not in path or "/engines/" in path:
            continue
        where = path.split("pyro_distributed/", 1)[1]
        ours.append(
            {
                "function": f"{where}:{line}({name})",
                "calls_per_step": calls / steps,
                "own_us_per_step": 1e6 * own / steps,
                "cumulative_us_per_step": 1e6 * cumulative / steps,
            }
        )
    return sorted(ours, key=lambda row: -row["own_us_per_step"])[:rows]


HERE = Path(__file__).resolve().parent
#: Metered steps per workload in --compare: about a second of steps each.
COMPARE_STEPS = {"tiny": 100, "small400": 15, "vae": 40}


def run_one(tree: Path, workload: str, optim: str, workers: int, steps: int) -> dict[str, Any]:
    """One measurement of ``tree``'s library, in fresh processes."""
    prefix = [sys.executable]
    if workers > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        prefix += ["-m", "torch.distributed.run", f"--nproc-per-node={workers}"]
        prefix += ["--master-addr=127.0.0.1", f"--master-port={port}"]
    command = [*prefix, str(HERE / "library_cpu.py"), "--workload", workload]
    command += ["--optim", optim, "--steps", str(steps), "--warmup", str(max(5, steps // 10))]
    command += ["--count-calls", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record: dict[str, Any] = json.loads(line)
            return record
    raise RuntimeError(f"{command} failed:\n{done.stderr[-3000:]}")


def compare(args: argparse.Namespace) -> None:
    """Before against after, interleaved; medians and min-max of each figure."""
    trees = {"before": Path(args.compare).resolve(), "after": HERE.parent}
    cases = [(w, n) for w in args.workloads for n in args.world_sizes]
    runs: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for workload, workers in cases:
            for label, tree in trees.items():
                steps = max(2, int(COMPARE_STEPS.get(workload, 100) * args.steps_scale))
                record = run_one(tree, workload, args.optim, workers, steps)
                runs.setdefault(f"{workload} W={workers} {label}", []).append(record)
                print(
                    f"[{repeat + 1}/{args.repeats}] {workload} W={workers} {label}: "
                    f"{record['library_us_per_step']:.0f} us library, "
                    f"{record['process_cpu_ms_per_step']:.2f} ms CPU, "
                    f"{record['wall_ms_per_step']:.2f} ms wall, "
                    f"{record['calls_per_step']:.0f} calls",
                    flush=True,
                )
    figures = (
        "library_us_per_step",
        "process_cpu_ms_per_step",
        "wall_ms_per_step",
        "calls_per_step",
    )
    summary = {
        key: {
            figure: {
                "median": statistics.median(r[figure] for r in records),
                "min": min(r[figure] for r in records),
                "max": max(r[figure] for r in records),
            }
            for figure in figures
        }
        for key, records in runs.items()
    }
    print("\n| case | library us/step | process CPU ms/step | wall ms/step | calls/step |")
    print("|---|---:|---:|---:|---:|")
    for key, by_figure in summary.items():
        cells = [f"{f['median']:.3g} ({f['min']:.3g}-{f['max']:.3g})" for f in by_figure.values()]
        print(f"| {key} | " + " | ".join(cells) + " |")
    out = {"args": vars(args), "load_before": os.getloadavg(), "runs": runs, "summary": summary}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workload", type=workload_name)
    parser.add_argument("--optim", choices=OPTIMS, default="ours")
    parser.add_argument("--steps", type=int, default=200, help="metered steps")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many more steps")
    parser.add_argument("--rows", type=int, default=15, help="functions to list")
    parser.add_argument(
        "--count-calls", type=int, default=0, help="count calls inside the library over N steps"
    )
    parser.add_argument("--compare", help="an older tree (holding pyro_distributed/) to compare")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=["tiny", "small400", "vae"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--output", default=str(HERE / "library_cpu.json"))
    parser.add_argument(
        "--steps-scale", type=float, default=1.0, help="scale --compare's steps (quick runs)"
    )
    args = parser.parse_args()
    if args.compare:
        compare(args)
        return
    if args.workload is None:
        parser.error("--workload is needed (or --compare)")
    meter = Meter()
    patched = install(meter)
    training = prepare(args.workload, args.optim, {})
    for _ in range(args.warmup):
        training.step()
    if pyro_distributed.world_size() > 1:
        pyro_distributed.barrier()
    meter.ours_ns, meter.calls = 0, 0
    wall, cpu = time.perf_counter(), process_cpu_s()
    for _ in range(args.steps):
        training.step()
    wall, cpu = time.perf_counter() - wall, process_cpu_s() - cpu
    calls = meter.calls / args.steps
    library_ns = meter.ours_ns / args.steps - calls * clock_cost_ns()
    record: dict[str, Any] = {
        "workload": args.workload,
        "optim": args.optim,
        "world_size": pyro_distributed.world_size(),
        "library_us_per_step": library_ns / 1e3,
        "metered_calls_per_step": calls,
        "process_cpu_ms_per_step": 1e3 * cpu / args.steps,
        "wall_ms_per_step": 1e3 * wall / args.steps,
        "patched": patched,
    }
    if args.count_calls:
        meter.python_calls = 0
        sys.setprofile(meter.count_calls)
        for _ in range(args.count_calls):
            training.step()
        sys.setprofile(None)
        record["calls_per_step"] = meter.python_calls / args.count_calls
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.profile):
            training.step()
        profile.disable()
        record["top_functions"] = top_functions(profile, args.profile, args.rows)
    if pyro_distributed.is_main():
        print(json.dumps(record), flush=True)
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main()
