"""Local variational parameters: step time and memory per worker, N = 10^4 to 4 * 10^6.

    python benchmarks/bench_local.py             # about 20 minutes on 2 cores

Runs the ``localN`` workloads of ``suite.LOCAL_PLANS`` (N data points, each
with an 8-dimensional latent whose AutoNormal location and scale are local
parameters; 256 points per worker per step) in the configurations of
``suite.LOCAL_CONFIGS``: plain Pyro in one process, ours with every row on
every worker (``ours-w2``), ours with ownership (``ours-owned-w2``), Pyro's
``HorovodOptimizer`` and DDP, interleaved, ``--repeats`` runs each. It writes
``local_results.json`` and ``LOCAL_RESULTS.md`` with the median step time,
the parameter and optimizer-state bytes per worker, and the issue's targets
at N = 10^6.
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


def targets(table: dict[str, dict[str, float] | None]) -> list[tuple[str, float, bool]]:
    """The issue's three targets at N = 10^6, as (label, value, passed)."""
    plain, replicated, owned = table.get("plain"), table.get("ours-w2"), table.get("ours-owned-w2")
    if plain is None or replicated is None or owned is None:
        return []
    time_vs_plain = owned["ms_per_step"] / plain["ms_per_step"]
    time_vs_replicated = owned["ms_per_step"] / replicated["ms_per_step"]
    memory = owned["state_mb"] / plain["state_mb"]
    return [
        ("step time, owned W=2 / plain W=1 <= 0.6", time_vs_plain, time_vs_plain <= 0.6),
        (
            "step time, owned W=2 / replicated W=2 <= 0.4",
            time_vs_replicated,
            time_vs_replicated <= 0.4,
        ),
        ("state bytes per worker, owned W=2 / plain <= 0.55", memory, memory <= 0.55),
    ]


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Local parameters: step time and memory per worker",
        "",
        f"{results['repeats']} interleaved runs per configuration, medians; "
        f"{results['environment']['cpus']} CPUs, {results['environment']['date']}, "
        f"commit {str(results['environment']['git_commit'])[:10]}"
        f"{' (dirty)' if results['environment']['git_dirty'] else ''}.",
        "",
        "| N | configuration | ms/step (min-max) | vs plain | param + optimizer state per "
        "worker (MB) | vs plain |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for workload, table in results["tables"].items():
        plain = table.get("plain")
        for config, row in table.items():
            if row is None:
                lines.append(f"| {workload[5:]} | {config} | failed | | | |")
                continue
            speed = f"{row['ms_per_step'] / plain['ms_per_step']:.2f}x" if plain else ""
            memory = f"{row['state_mb'] / plain['state_mb']:.2f}x" if plain else ""
            drift = "" if row["in_sync"] else " (workers diverged!)"
            spread = f"({row['min']:.1f}-{row['max']:.1f})"
            lines.append(
                f"| {workload[5:]} | {config}{drift} | {row['ms_per_step']:.1f} {spread} "
                f"| {speed} | {row['state_mb']:.1f} | {memory} |"
            )
    lines += ["", f"Targets at N = 10^6 ({TARGET_WORKLOAD}):", ""]
    for label, value, passed in results["targets"]:
        lines.append(f"- {label}: {value:.2f}, {'pass' if passed else '**fail**'}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=[plan.workload for plan in LOCAL_PLANS])
    parser.add_argument("--output-dir", type=Path, default=HERE)
    args = parser.parse_args()
    configs = sorted(select_configs(list(LOCAL_CONFIGS)), key=lambda c: LOCAL_CONFIGS.index(c.name))
    started = time.monotonic()
    tables: dict[str, dict[str, dict[str, float] | None]] = {}
    for plan in LOCAL_PLANS:
        if args.workloads and plan.workload not in args.workloads:
            continue
        runs = run_plan(plan, configs, args.repeats)
        tables[plan.workload] = {name: medians(config_runs) for name, config_runs in runs.items()}
    results = {
        "repeats": args.repeats,
        "environment": environment(),
        "seconds": time.monotonic() - started,
        "tables": tables,
        "targets": targets(tables.get(TARGET_WORKLOAD, {})),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "local_results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = markdown(results)
    (args.output_dir / "LOCAL_RESULTS.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
