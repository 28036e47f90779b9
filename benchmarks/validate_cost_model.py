"""Check the cost model behind ``pd.scaling.scaling_advice`` against measured step times.

    python benchmarks/validate_cost_model.py [--repeats 5] [--fit-on vae]

For each main workload of the suite it runs, interleaved, ``ours`` as two
independent one-worker processes at once (the compute time of a step beside
a second worker, without communication; the slower counts) and on two
workers under torchrun, where the worker also fits the all-reduce cost
(``--fit-cost``: latency + bytes / bandwidth from timed all-reduces of a few
sizes, :func:`pyro_distributed.scaling.measure_collective`). Then, with the medians:

1. on the ``--fit-on`` workload (each in turn by default), the latency is
   re-fitted to its measured W=2 step (:meth:`CollectiveCost.in_step`:
   compute + all-reduce = step), keeping the fitted bandwidth;
2. that cost predicts the W=2 step of every other workload as its own
   compute time plus the all-reduce of its gradient bytes;
3. the table shows predicted against measured, and the error.

It also shows the prediction with the idle all-reduce cost alone (no
re-fit), which leaves out what a collective costs inside a step here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench_svi import RUN_TIMEOUT_S, RunFailed, parse_result, run_config, run_together
from bench_svi import commands as suite_commands
from suite import CONFIGS, PLANS, Config

from pyro_distributed import CollectiveCost

# Compute without communication, but beside a second worker: two independent
# one-worker processes at once (the slower counts), as plain-x2 is the limit
# of two workers in the suite. On a 2-core machine a worker alone runs faster.
ONE = Config("ours-x2", "ours", "python", workers=2)
TWO = next(config for config in CONFIGS if config.name == "ours-w2")
MAIN = [plan for plan in PLANS if plan.main]


def run(config: Config, plan: Any, fit: bool) -> dict[str, Any]:
    if not fit:
        result = run_config(config, plan)
        if "error" in result:
            raise RunFailed(result["error"])
        return dict(result)
    command = suite_commands(config, plan)[0] + ["--fit-cost"]
    return parse_result(run_together([command], RUN_TIMEOUT_S)[0])


def report(fit_on: str, medians: dict[str, dict[str, float]]) -> None:
    """Fit on ``fit_on``; print predicted against measured W=2 steps of every workload."""
    source = medians[fit_on]
    idle = CollectiveCost(source["latency_s"], source["bandwidth"], world_size=2)
    fitted = idle.in_step(source["step_s"], source["compute_s"], source["gradient_bytes"])
    print(
        f"\nfitted on {fit_on} at W=2: idle all-reduce {1e6 * idle.latency_s:.0f} us + "
        f"bytes / {idle.bandwidth / 1e9:.2f} GB/s; "
        f"in a step, latency {1e3 * fitted.latency_s:.2f} ms"
    )
    print(
        "| workload | gradient | compute (x2) | W=2 measured | predicted | error "
        "| idle all-reduce only | error |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for workload, m in medians.items():
        predicted = m["compute_s"] + fitted.seconds(m["gradient_bytes"])
        naive = m["compute_s"] + idle.seconds(m["gradient_bytes"])
        mark = " (fit)" if workload == fit_on else ""
        print(
            f"| {workload}{mark} | {m['gradient_bytes'] / 1e3:.0f} kB "
            f"| {1e3 * m['compute_s']:.2f} ms "
            f"| {1e3 * m['step_s']:.2f} ms | {1e3 * predicted:.2f} ms "
            f"| {100 * (predicted / m['step_s'] - 1):+.0f} % | {1e3 * naive:.2f} ms "
            f"| {100 * (naive / m['step_s'] - 1):+.0f} % |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--fit-on",
        nargs="+",
        choices=[plan.workload for plan in MAIN],
        help="workloads to fit on, one table each (default: every one in turn)",
    )
    parser.add_argument("--json-out", type=Path, help="also write the medians here")
    args = parser.parse_args()

    records: dict[str, dict[str, list[dict[str, Any]]]] = {
        plan.workload: {"x2": [], "w2": []} for plan in MAIN
    }
    for repeat in range(args.repeats):
        for plan in MAIN:
            for key, config in (("x2", ONE), ("w2", TWO)):
                try:
                    record = run(config, plan, fit=key == "w2")
                except RunFailed as exc:
                    print(f"[{plan.workload} {repeat + 1}] {config.name} FAILED: {exc}")
                    continue
                records[plan.workload][key].append(record)
                print(
                    f"[{plan.workload} {repeat + 1}] {config.name}: {record['ms_per_step']:.2f} ms"
                )
                sys.stdout.flush()

    def median(workload: str, key: str, field: str) -> float:
        return statistics.median(float(r[field]) for r in records[workload][key])

    medians = {
        workload: {
            "compute_s": median(workload, "x2", "ms_per_step") / 1000,
            "step_s": median(workload, "w2", "ms_per_step") / 1000,
            "gradient_bytes": median(workload, "w2", "gradient_bytes"),
            "latency_s": median(workload, "w2", "latency_s"),
            "bandwidth": median(workload, "w2", "bandwidth"),
        }
        for workload in records
    }
    for fit_on in args.fit_on or list(medians):
        report(fit_on, medians)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"medians": medians, "records": records}, indent=1))


if __name__ == "__main__":
    main()
