"""Local variational parameters: step time and memory per worker, N = 10^4 to 10^7.

    python benchmarks/bench_local.py             # about 40 minutes on 2 cores

Runs the ``localN`` workloads of ``suite.LOCAL_PLANS`` (N data points, each
with an 8-dimensional latent whose AutoNormal location and scale are local
parameters; 256 points per worker per step) in the configurations of
``suite.LOCAL_CONFIGS``: plain Pyro in one process, ours with every row on
every worker (``ours-w2``), ours with ownership (``ours-owned-w2``), ours with
ownership and sparse local steps (``ours-sparse-w2``,
``local_updates="sparse"``), Pyro's ``HorovodOptimizer`` and DDP,
interleaved, ``--repeats`` runs each (each plan's ``configs`` of them). It
writes ``local_results.json`` and ``LOCAL_RESULTS.md`` with the median step
time, the parameter and optimizer-state bytes per worker, and the suite's
targets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench_svi import environment, run_plan, select_configs
from suite import LOCAL_CONFIGS, LOCAL_PLANS

HERE = Path(__file__).resolve().parent
TARGET_WORKLOAD = "local1000000"
SMALLEST_WORKLOAD, LARGEST_WORKLOAD = "local10000", "local10000000"


def medians(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    good = [run for run in runs if "error" not in run]
    if not good:
        return None
    return {
        "ms_per_step": statistics.median(run["ms_per_step"] for run in good),
        "min": min(run["ms_per_step"] for run in good),
        "max": max(run["ms_per_step"] for run in good),
        "state_mb": max(run["state_bytes"] for run in good) / 2**20,
        "in_sync": all(run["params_in_sync"] for run in good),
    }


def targets(tables: dict[str, dict[str, dict[str, float] | None]]) -> list[tuple[str, float, bool]]:
    """The targets, as (label, value, passed): ownership's and sparse steps'."""
    table = tables.get(TARGET_WORKLOAD, {})
    plain, replicated, owned = table.get("plain"), table.get("ours-w2"), table.get("ours-owned-w2")
    found: list[tuple[str, float, bool]] = []
    if plain is not None and replicated is not None and owned is not None:
        time_vs_plain = owned["ms_per_step"] / plain["ms_per_step"]
        time_vs_replicated = owned["ms_per_step"] / replicated["ms_per_step"]
        memory = owned["state_mb"] / plain["state_mb"]
        found += [
            ("step time, owned W=2 / plain W=1 <= 0.6", time_vs_plain, time_vs_plain <= 0.6),
            (
                "step time, owned W=2 / replicated W=2 <= 0.4",
                time_vs_replicated,
                time_vs_replicated <= 0.4,
            ),
            ("state bytes per worker, owned W=2 / plain <= 0.55", memory, memory <= 0.55),
        ]
    sparse = table.get("ours-sparse-w2")
    if sparse is not None and owned is not None:
        speed = sparse["ms_per_step"] / owned["ms_per_step"]
        memory = sparse["state_mb"] / owned["state_mb"]
        found += [
            ("step time, sparse W=2 / dense owned W=2 <= 0.1", speed, speed <= 0.1),
            ("state bytes per worker, sparse / dense owned = 1", memory, memory == 1.0),
        ]
    smallest = tables.get(SMALLEST_WORKLOAD, {}).get("ours-sparse-w2")
    largest = tables.get(LARGEST_WORKLOAD, {}).get("ours-sparse-w2")
    if smallest is not None and largest is not None:
        flat = largest["ms_per_step"] / smallest["ms_per_step"]
        found.append(("step time, sparse N = 10^7 / N = 10^4 <= 2", flat, flat <= 2.0))
    return found


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Local parameters: step time and memory per worker",
        "",
        f"{results['repeats']} interleaved runs per configuration, medians; "
        f"{results['environment']['cpus']} CPUs, {results['environment']['date']}, "
        f"commit {str(results['environment']['git_commit'])[:10]}"
        f"{' (dirty)' if results['environment']['git_dirty'] else ''}.",
        "",
        "| N | configuration | ms/step (min-max) | vs plain | vs dense owned | param + "
        "optimizer state per worker (MB) | vs plain |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for workload, table in results["tables"].items():
        plain, owned = table.get("plain"), table.get("ours-owned-w2")
        for config, row in table.items():
            if row is None:
                lines.append(f"| {workload[5:]} | {config} | failed | | | | |")
                continue
            speed = f"{row['ms_per_step'] / plain['ms_per_step']:.3f}x" if plain else ""
            vs_owned = f"{row['ms_per_step'] / owned['ms_per_step']:.3f}x" if owned else ""
            memory = f"{row['state_mb'] / plain['state_mb']:.2f}x" if plain else ""
            drift = "" if row["in_sync"] else " (workers diverged!)"
            spread = f"({row['min']:.1f}-{row['max']:.1f})"
            lines.append(
                f"| {workload[5:]} | {config}{drift} | {row['ms_per_step']:.1f} {spread} "
                f"| {speed} | {vs_owned} | {row['state_mb']:.1f} | {memory} |"
            )
    lines += ["", f"Targets (at N = 10^6, {TARGET_WORKLOAD}, unless they say otherwise):", ""]
    for label, value, passed in results["targets"]:
        lines.append(f"- {label}: {value:.2f}, {'pass' if passed else '**fail**'}")
    lines += [
        "",
        "Bytes sent per step are not measured here: `tests/local/test_ownership.py` and",
        "`tests/local/test_sparse.py` count them, equal for dense and sparse local steps",
        "and the same at N = 100 and N = 10,000. The machine is shared and noisy: compare",
        "configurations within one run (interleaved), not across runs.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=[plan.workload for plan in LOCAL_PLANS])
    parser.add_argument("--output-dir", type=Path, default=HERE)
    parser.add_argument(
        "--configs", nargs="+", choices=LOCAL_CONFIGS, help="configurations (default: all)"
    )
    args = parser.parse_args()
    chosen = list(args.configs or LOCAL_CONFIGS)
    configs = sorted(select_configs(chosen), key=lambda c: LOCAL_CONFIGS.index(c.name))
    started = time.monotonic()
    tables: dict[str, dict[str, dict[str, float] | None]] = {}
    for plan in LOCAL_PLANS:
        if args.workloads and plan.workload not in args.workloads:
            continue
        runs = run_plan(plan, [c for c in configs if plan.runs(c)], args.repeats)
        tables[plan.workload] = {name: medians(config_runs) for name, config_runs in runs.items()}
    results = {
        "repeats": args.repeats,
        "environment": environment(),
        "seconds": time.monotonic() - started,
        "tables": tables,
        "targets": targets(tables),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "local_results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = markdown(results)
    (args.output_dir / "LOCAL_RESULTS.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
