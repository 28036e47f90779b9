"""Many workers' first step on one node: ours against DDP, construction included.

    python benchmarks/bench_first_step.py [--workers 8 16] [--repeats 3] [--steps 20]
                                          [--warmup 5] [--workload vae]
                                          [--output-dir benchmarks] [--no-profile]

A data-parallel job pays once, before its steady state, for what its first
step sets up: for ``ours`` (SVI with ``DistributedOptimizer``) the first
``svi.step`` creates the parameters, agrees across workers on which ones the
step takes, broadcasts worker 0's values of them and plans the buckets; for
``ddp`` (the same model and guide as a torch module) the
``DistributedDataParallel`` constructor broadcasts worker 0's parameters and
buckets the gradients before the first step. With many workers on few cores
(W=8 and W=16 processes on one node, one thread each), every collective of
that setup waits for processes the scheduler has not run yet. This benchmark
times both ways side by side, and their steady step.

Each run is one job of W ``svi_worker.py`` processes, started as
``bench_svi.py`` starts its torchrun configurations, with
``OMP_NUM_THREADS=1``::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node W \\
        --master-addr 127.0.0.1 --master-port PORT \\
        benchmarks/svi_worker.py --workload vae --optim ours \\
        --steps 20 --warmup 5 --first-step

and the same with ``--optim ddp`` (PORT: a free one, chosen per run). For
each W, the repeats interleave the two, ``ours`` first in odd repeats and
``ddp`` first in even ones. Per run the worker reports (see the docstring
of ``svi_worker.py`` for what each clock includes):

* ``first_step_s``: the largest over the workers of the time from a barrier
  after the workload is built to the return of the first training step,
  construction included: for ``ours`` the optimizer, the ``SVI`` object and
  the first ``svi.step`` (whose first trace of guide and model creates the
  parameters); for ``ddp`` the ELBO module and its first loss evaluation
  (the first trace, before DDP is built), torch's Adam, the
  ``DistributedDataParallel`` constructor and the first step;
* ``first_step_wrapper_s``: the same from just before the optimizer is
  built (``DistributedOptimizer``; torch's Adam, then the
  ``DistributedDataParallel`` constructor): equal to ``first_step_s`` for
  ``ours``, and without the first loss evaluation for ``ddp``. The two DDP
  figures bracket the comparison: the first includes one forward pass more
  than ours does, the second leaves out the first trace that ours includes;
* ``ms_per_step``: the steady step, ``--steps`` timed steps after the
  ``--warmup`` untimed ones (the first of which is the measured first step).

The report gives per W and configuration the median and the range (min to
max) over the repeats, and the ratios ours/ddp of the medians (below 1: ours
is faster). After the repeats, unless ``--no-profile``, one more run of
``ours`` per W profiles worker 0's first step with ``cProfile``
(``--profile-first-step``) into ``first_step_profile_w<W>.txt``: the
functions with the most cumulative time, then those of ``pyro_distributed``,
then what the SVI step's parts (the step, its loss and gradients, our
optimizer's call, its reducer) spent in the functions they called. That
run is slowed by the profiler and left out of the figures.

Both clocks include the first construction of a ``torch.optim.Adam`` in the
process (ours's inside its first ``svi.step``, one per parameter), which
imports ``torch._dynamo``: about a second of CPU per process, which W
processes on few cores pay all at once. The phases (``first_step_phases``)
and the profile show how much of the first step it is.

Writes ``first_step_results.json`` (every run, the summary, the settings and
the environment) and ``FIRST_STEP_RESULTS.md`` (the tables) into
``--output-dir`` (default: this directory), and prints the tables. Quick
check that everything runs (the numbers mean nothing)::

    python benchmarks/bench_first_step.py --workers 2 --repeats 1 --steps 2 --warmup 1 \\
        --output-dir /tmp/first_step
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_svi import WORKER, RunFailed, environment, launch_prefix, parse_result, run_together
from suite import Config

HERE = Path(__file__).resolve().parent
OPTIMS = ("ours", "ddp")
RESULTS_NAME = "first_step_results.json"
MARKDOWN_NAME = "FIRST_STEP_RESULTS.md"
#: Per run: W processes on few cores start slowly (imports), so more than bench_svi's.
RUN_TIMEOUT_S = 600.0
#: What the report keeps of a worker's line.
KEPT = (
    "first_step_s",
    "first_step_wrapper_s",
    "first_step_phases",
    "ms_per_step",
    "params_in_sync",
    "param_tensors",
)
#: The figures summarised per configuration: medians, minima and maxima over repeats.
FIGURES = ("first_step_s", "first_step_wrapper_s", "ms_per_step")


def command(
    workers: int, optim: str, args: argparse.Namespace, profile: Path | None = None
) -> list[str]:
    """The command line of one run: W workers under torchrun, as ``bench_svi.py`` starts them."""
    config = Config(optim, optim, "torchrun", workers=workers)
    return [
        *launch_prefix(config),
        *(str(WORKER), "--workload", args.workload, "--optim", optim),
        *("--steps", str(args.steps), "--warmup", str(args.warmup), "--first-step"),
        *([] if profile is None else ["--profile-first-step", str(profile)]),
    ]


def run_once(
    workers: int, optim: str, args: argparse.Namespace, profile: Path | None = None
) -> dict[str, Any]:
    """One run; worker 0's figures, or the error that ended it."""
    started = time.monotonic()
    try:
        output = run_together([command(workers, optim, args, profile)], args.timeout)[0]
        record = parse_result(output)
    except RunFailed as exc:
        return {"wall_s": time.monotonic() - started, "error": str(exc)}
    if "first_step_s" not in record:
        return {"wall_s": time.monotonic() - started, "error": "no first_step_s in the line"}
    return {"wall_s": time.monotonic() - started, **{key: record.get(key) for key in KEPT}}


def describe(run: dict[str, Any]) -> str:
    """One progress line's worth of a run."""
    if "error" in run:
        return f"FAILED after {run['wall_s']:.1f} s, {run['error'].splitlines()[0]}"
    sync = "" if run["params_in_sync"] else ", workers DIVERGED"
    return (
        f"first step {run['first_step_s']:.3f} s (from the wrapper "
        f"{run['first_step_wrapper_s']:.3f} s), {run['ms_per_step']:.2f} ms/step "
        f"({run['wall_s']:.1f} s{sync})"
    )


def run_all(args: argparse.Namespace) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Every timed run, by W and configuration, interleaved within each W."""
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for workers in args.workers:
        runs[workers] = {optim: [] for optim in OPTIMS}
        for repeat in range(1, args.repeats + 1):
            order = OPTIMS if repeat % 2 else tuple(reversed(OPTIMS))
            for optim in order:
                run = run_once(workers, optim, args)
                print(f"[W={workers} {repeat}/{args.repeats}] {optim}: {describe(run)}", flush=True)
                runs[workers][optim].append(run)
    return runs


def profile_all(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """One profiled run of ``ours`` per W (not in the figures); where each profile went."""
    profiles: dict[int, dict[str, Any]] = {}
    for workers in args.workers:
        path = args.output_dir / f"first_step_profile_w{workers}.txt"
        run = run_once(workers, "ours", args, profile=path)
        print(f"[W={workers} profile] ours: {describe(run)} -> {path}", flush=True)
        profiles[workers] = {**run, "path": str(path), "written": path.exists()}
    return profiles


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min and max of ``values``; ``None`` if there are none."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: dict[int, dict[str, list[dict[str, Any]]]]) -> dict[int, dict[str, Any]]:
    """Per W: per configuration the spread of each figure and of each phase,
    and the ratios ours/ddp of the medians."""
    summary: dict[int, dict[str, Any]] = {}
    for workers, by_optim in runs.items():
        entries: dict[str, Any] = {}
        for optim, optim_runs in by_optim.items():
            done = [run for run in optim_runs if "error" not in run]
            entries[optim] = {
                "runs": len(optim_runs),
                "failed": len(optim_runs) - len(done),
                "in_sync": all(bool(run["params_in_sync"]) for run in done),
                **{figure: spread([float(run[figure]) for run in done]) for figure in FIGURES},
                "phases": phase_spreads(done),
            }
        ratios = {
            figure: ratio(entries["ours"][figure], entries["ddp"][figure]) for figure in FIGURES
        }
        # Ours's whole first step against DDP's without its first trace.
        ratios["first_step_s_vs_ddp_wrapper"] = ratio(
            entries["ours"]["first_step_s"], entries["ddp"]["first_step_wrapper_s"]
        )
        summary[workers] = {**entries, "ours_over_ddp": ratios}
    return summary


def phase_spreads(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """The spread of each phase of the first step over ``runs``."""
    phases = sorted({phase for run in runs for phase in run["first_step_phases"]})
    return {
        phase: spread(
            [run["first_step_phases"][phase] for run in runs if phase in run["first_step_phases"]]
        )
        for phase in phases
    }


def ratio(ours: dict[str, float] | None, ddp: dict[str, float] | None) -> float | None:
    """Ours's median over DDP's (below 1: ours is faster), if both are known."""
    return ours["median"] / ddp["median"] if ours and ddp and ddp["median"] else None


def cell(figure: dict[str, float] | None, scale: float = 1.0, digits: int = 3) -> str:
    """``median [min, max]`` of a figure, times ``scale``; a dash if unknown."""
    if figure is None:
        return "-"
    median, low, high = (scale * figure[key] for key in ("median", "min", "max"))
    return f"{median:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(report: dict[str, Any]) -> str:
    settings, summary, env = report["settings"], report["summary"], report["environment"]
    commit = env.get("git_commit") or "unknown"
    dirty = " (with uncommitted changes)" if env.get("git_dirty") else ""
    lines = [
        "# Many workers' first step on one node: ours against DDP",
        "",
        f"`{settings['command']}` at commit {commit}{dirty}, {env['date']}, on "
        f"{env['cpus_usable']} usable CPUs; workload `{settings['workload']}`, W processes "
        f"on this one node with `OMP_NUM_THREADS=1`, {settings['repeats']} interleaved "
        f"repeats per W: median [min, max] over them, ratios of medians (below 1: ours "
        f"is faster). Steady step: {settings['steps']} timed steps after "
        f"{settings['warmup']} untimed ones. First step: the largest over the workers "
        "of the time from a barrier to the return of the first step, construction "
        "included (ours: `DistributedOptimizer`, `SVI`, the first `svi.step`; ddp: the "
        "ELBO module and its first loss evaluation, torch's Adam, "
        "`DistributedDataParallel(...)`, the first step); 'ddp, first trace left out' "
        "starts at torch's Adam, leaving out that first loss evaluation, which is the "
        "first trace of guide and model that ours's first step includes.",
        "",
        "| W | first step, ours (s) | first step, ddp (s) | ours/ddp "
        "| ddp, first trace left out (s) | ours/that | steady step, ours (ms) "
        "| steady step, ddp (ms) | ours/ddp | in sync |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for workers, entry in summary.items():
        ours, ddp, ratios = entry["ours"], entry["ddp"], entry["ours_over_ddp"]
        synced = "yes" if ours["in_sync"] and ddp["in_sync"] else "NO"
        failed = ours["failed"] + ddp["failed"]
        cells = [
            str(workers),
            cell(ours["first_step_s"]),
            cell(ddp["first_step_s"]),
            times(ratios["first_step_s"]),
            cell(ddp["first_step_wrapper_s"]),
            times(ratios["first_step_s_vs_ddp_wrapper"]),
            cell(ours["ms_per_step"], digits=2),
            cell(ddp["ms_per_step"], digits=2),
            times(ratios["ms_per_step"]),
            synced + (f", {failed} run(s) failed" if failed else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Phases of the first step (s), each the largest over the workers, median "
        "[min, max] over the repeats: `first_call` (ddp only) the ELBO module and its "
        "first loss evaluation; `construct` the optimizer and wrapper (ours: "
        "`DistributedOptimizer` and `SVI`; ddp: torch's Adam and "
        "`DistributedDataParallel(...)`); `step` the first step.",
        "",
        "| W | configuration | first_call | construct | step |",
        "|---:|---|---:|---:|---:|",
    ]
    for workers, entry in summary.items():
        for optim in OPTIMS:
            phases = entry[optim]["phases"]
            cells = [str(workers), optim]
            cells += [cell(phases.get(phase), digits=4) for phase in ("first_call", "construct")]
            cells.append(cell(phases.get("step")))
            lines.append("| " + " | ".join(cells) + " |")
    profiles = report.get("profiles") or {}
    if profiles:
        lines += ["", "Profiles of ours's first step on worker 0 (cProfile, not in the figures):"]
        lines += [
            f"- W={workers}: `{Path(p['path']).name}`"
            + ("" if p["written"] else f" (not written: {p.get('error', 'no file')})")
            for workers, p in profiles.items()
        ]
    lines.append("")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--workers", nargs="+", type=int, default=[8, 16], help="values of W (default: 8 16)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration per W")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of the steady step")
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps first, the measured first step one"
    )
    parser.add_argument("--workload", default="vae", help="svi_worker.py's --workload")
    parser.add_argument(
        "--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds a run may take"
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="skip the profiled run of ours per W"
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=HERE,
        help=f"where {RESULTS_NAME}, {MARKDOWN_NAME} and the profiles go (default: %(default)s)",
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--repeats, --steps and --warmup must be at least 1")
    if min(args.workers) < 2:
        parser.error("--workers: DDP needs at least 2 workers")
    return args


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runs = run_all(args)
    profiles = {} if args.no_profile else profile_all(args)
    report: dict[str, Any] = {
        "environment": environment(),
        "settings": {
            "command": shlex.join(["python", *sys.argv]),
            "workers": args.workers,
            "repeats": args.repeats,
            "steps": args.steps,
            "warmup": args.warmup,
            "workload": args.workload,
            "omp_num_threads": 1,
            "run_timeout_s": args.timeout,
            "example_command": shlex.join(
                ["OMP_NUM_THREADS=1", *command(args.workers[0], "ours", args)]
            ),
            "wall_s": time.monotonic() - started,
        },
        "runs": runs,
        "summary": summarise(runs),
        "profiles": profiles,
    }
    table = markdown(report)
    print("\n" + table)
    (args.output_dir / MARKDOWN_NAME).write_text(table)
    # JSON keys are strings: W becomes "8", "16".
    (args.output_dir / RESULTS_NAME).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output_dir / RESULTS_NAME} and {args.output_dir / MARKDOWN_NAME}")


if __name__ == "__main__":
    main()
