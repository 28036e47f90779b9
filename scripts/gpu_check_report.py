"""The table that ``scripts/gpu_check.sh`` prints last and writes to ``summary.md``.

    python scripts/gpu_check_report.py STEPS.tsv BENCH.jsonl > summary.md

``STEPS.tsv`` holds one line per step of the check: name, status (ok, FAIL,
timeout, skipped) and seconds. ``BENCH.jsonl`` holds the JSON lines that
``benchmarks/svi_worker.py`` prints, each with a ``label`` added by the check
(the engine and launcher). Timings of the same workload stand side by side,
plain Pyro first, so the library's overhead on a GPU step reads off one row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def steps_table(lines: list[str]) -> list[str]:
    rows = ["| step | result | seconds |", "| --- | --- | ---: |"]
    for line in lines:
        if line.strip():
            name, status, seconds = line.rstrip("\n").split("\t")
            rows.append(f"| {name} | {status} | {seconds} |")
    return rows


def timings_table(runs: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| workload | configuration | W | launch | ms/step | vs plain | GPU peak MiB/worker"
        " | params+state MiB/worker | in sync |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    plain = {
        run["workload"]: run["ms_per_step"]
        for run in runs
        if run.get("optim") == "plain" and run.get("world_size") == 1
    }
    for run in runs:
        if "error" in run:
            rows.append(f"| {run.get('workload', '?')} | {run.get('optim', '?')} | | "
                        f"{run.get('label', '')} | failed: {run['error']} | | | | |")  # fmt: skip
            continue
        reference = plain.get(run["workload"])
        ratio = f"{run['ms_per_step'] / reference:.2f}x" if reference else ""
        rows.append(
            f"| {run['workload']} | {run['optim']} | {run['world_size']} | {run.get('label', '')}"
            f" | {run['ms_per_step']:.2f} | {ratio} | {run.get('cuda_peak_bytes', 0) / 2**20:.0f}"
            f" | {run['state_bytes'] / 2**20:.1f} | {run['params_in_sync']} |"
        )
    return rows


def main(steps_path: str, bench_path: str) -> None:
    steps = Path(steps_path).read_text().splitlines() if Path(steps_path).exists() else []
    runs = []
    if Path(bench_path).exists():
        runs = [json.loads(line) for line in Path(bench_path).read_text().splitlines() if line]
    print("\n".join(["## Steps", "", *steps_table(steps), "", "## Timings", ""]))
    print("\n".join(timings_table(runs) if runs else ["(no timings)"]))


if __name__ == "__main__":
    main(*sys.argv[1:3])
