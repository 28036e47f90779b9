"""Step policies on a 1 Gbit/s link: time to a held-out loss, against averaging every step.

    python benchmarks/bench_policies.py [--workloads large1m vae] [--periods 4 16 64]
                                        [--repeats 3] [--steps N] [--curve 16]
                                        [--warmup 1] [--output-dir benchmarks]

A step policy sends less than averaging every step does, so each step is
cheaper on a slow link; but each worker steps on its own gradients between
averages, so a step may buy less of the loss. Step time alone cannot say
whether that pays: this benchmark measures the time to reach a held-out
loss. Quick check that everything runs (the numbers mean nothing)::

    python benchmarks/bench_policies.py --repeats 1 --steps 16 --curve 8 --periods 4 \\
        --output-dir /tmp/policies

Needs root and ``ip netns``, as ``bench_link.py``: two hosts as network
namespaces on one switch (``tests/support/cluster.py``), every link limited
by ``tbf`` to ``--rate``, one worker per host under ``torchrun --nnodes 2``.

Configurations, each a fresh pair of ``svi_worker.py`` processes, run in
turn within each repeat (repeat 1 of every configuration, then repeat 2...):

* ``ours``: SVI with ``DistributedOptimizer``, which averages the gradients
  of every step: the reference;
* ``ours-lowrank``: the same with ``LowRankHook`` at rank 4, compressing from
  the first timed step;
* ``ours-localsgd-H`` (``step_policy=LocalSGD(H)``) and ``ours-diloco-H``
  (``DiLoCo(H)``: outer Nesterov SGD, lr 0.7, momentum 0.9) for each H of
  ``--periods``;
* ``ddp-postlocal-H``: torch's post-local SGD on the same model as a torch
  module: DDP with ``post_localSGD_hook``, ``PostLocalSGDOptimizer`` around
  ``torch.optim.Adam`` and a ``PeriodicModelAverager`` at H;
* ``ddp``: DDP averaging every step, the torch peer of ``ours``.

Every configuration takes the same ``--warmup`` untimed steps first, all of
which average gradients (the policies' ``warmup_steps`` and torch's
``start_localSGD_iter``); the policies then average the parameters after
every H-th timed step, on the same steps for ours and torch's (see
``svi_worker.post_local_sgd``). Adam's learning rate (1e-3) is the same for
all, tuned for none.

Each run times ``--steps`` steps (by default 256 for large1m, whose step
costs about ten of the VAE's, and 512 for the VAE; by estimate, the whole
benchmark then takes 20 to 25 minutes on two idle cores, about half of it
the 72 launches) and stops its clock every E steps, E the
least common multiple of ``--curve`` and H (a sync point, where the workers
hold one model), to take worker 0's held-out loss (``svi_worker.py
--curve``). Per workload, the target is the median over repeats of
``ours``'s final held-out loss; a run reaches it at the first point whose
loss is within ``--tolerance`` (1 %) of it (``loss <= target + 0.01 *
|target|``), and its time to target is the training time to that point,
evaluations not counted. The report gives medians over repeats; a median
over runs of which too few reached the target is "not reached".

Writes ``policies_results.json`` (every run with its curve, the summary, the
settings and the environment) and ``POLICY_RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_link import RANK, RATE_BYTES, run_on_hosts
from bench_svi import WORKER, RunFailed, environment, git, parse_result

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.support.cluster import NamespaceCluster, unavailable  # noqa: E402  (after the path)

#: The workloads with a held-out loss (``svi_worker.heldout_args``), and their
#: timed steps unless ``--steps`` says otherwise.
STEPS = {"large1m": 256, "vae": 512}
WORKLOADS = tuple(STEPS)
#: A run reaches the target within this fraction of the target's magnitude.
TOLERANCE = 0.01
REFERENCE = "ours"


@dataclass(frozen=True)
class Config:
    """One configuration: its name in the report, ``--optim``, and ``--period``."""

    name: str
    optim: str
    period: int | None = None


def configs_for(periods: list[int]) -> list[Config]:
    """Every configuration at the periods asked for, the reference first."""
    policies = [
        Config(f"{optim}-{period}", optim, period)
        for period in periods
        for optim in ("ours-localsgd", "ours-diloco", "ddp-postlocal")
    ]
    every_step = [Config(REFERENCE, "ours"), Config("ours-lowrank", "ours-lowrank")]
    return [*every_step, *policies, Config("ddp", "ddp")]


def curve_every(config: Config, curve: int) -> int:
    """Steps between two evaluations: a multiple of ``--curve`` and of the period."""
    return math.lcm(curve, config.period or 1)


def steps_for(workload: str, args: argparse.Namespace) -> int:
    """The timed steps of each run on ``workload``."""
    return int(args.steps or STEPS[workload])


def run_once(
    cluster: NamespaceCluster, config: Config, workload: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One run on both hosts under torchrun; worker 0's record."""
    worker = [
        *(str(WORKER), "--workload", workload, "--optim", config.optim),
        *("--steps", str(steps_for(workload, args)), "--warmup", str(args.warmup), "--heldout"),
        *("--curve", str(curve_every(config, args.curve)), "--rank", str(RANK)),
        *([] if config.period is None else ["--period", str(config.period)]),
    ]
    return parse_result(run_on_hosts(cluster, worker, together=True)[0])


def reached(record: dict[str, Any], threshold: float) -> tuple[float, int] | None:
    """The training time and steps to the first point of ``record``'s curve at
    or below ``threshold``; ``None`` if none is."""
    every, steps = int(record["curve_every"]), int(record["steps"])
    for index, (seconds, loss) in enumerate(record["curve"]):
        if loss <= threshold:
            return float(seconds), min(index * every, steps)
    return None


def why(failure: RunFailed) -> str:
    """One line for the report: how the run ended, and the last error it printed."""
    lines = str(failure).splitlines()
    errors = [line.strip() for line in lines if "Error:" in line and "ChildFailed" not in line]
    return f"{lines[0]} {errors[-1]}" if errors else lines[0]


def median_reached(values: list[float | None]) -> float | None:
    """The median of ``values``, a run that never reached the target counting
    as slower than any that did; ``None`` if the median run did not reach it."""
    median = statistics.median([math.inf if value is None else value for value in values])
    return None if math.isinf(median) else median


def loss_within(record: dict[str, Any], seconds: float) -> float | None:
    """The held-out loss at the last point of ``record``'s curve within
    ``seconds`` of training; ``None`` if it has none so early."""
    found = None
    for elapsed, loss in record["curve"]:
        if elapsed <= seconds:
            found = float(loss)
    return found


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [float(run[key]) for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(
    runs: dict[str, dict[str, list[dict[str, Any]]]], tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Per workload: the target, and per configuration its step time, bytes
    sent, final loss and time to target (medians over repeats)."""
    summary: dict[str, Any] = {}
    for workload, by_config in runs.items():
        target = median_of(by_config.get(REFERENCE, []), "heldout_loss")
        if target is None:
            summary[workload] = {"target": None, "configs": {}}
            continue
        threshold = target + tolerance * abs(target)
        # A budget of seconds: half of what averaging every step trains for.
        ends = [float(run["curve"][-1][0]) for run in by_config[REFERENCE] if run.get("curve")]
        budget = statistics.median(ends) / 2 if ends else None
        entries: dict[str, Any] = {}
        for name, config_runs in by_config.items():
            hits = [reached(run, threshold) for run in config_runs]
            final = median_of(config_runs, "heldout_loss")
            entries[name] = {
                "period": config_runs[0].get("period"),
                "curve_every": config_runs[0].get("curve_every"),
                "runs": len(config_runs),
                "ms_per_step": median_of(config_runs, "ms_per_step"),
                "bytes_per_step": median_of(config_runs, "bytes_per_step"),
                "final_loss": final,
                "final_gap": None if final is None else (final - target) / abs(target),
                "loss_at_budget": None
                if budget is None
                else median_reached([loss_within(run, budget) for run in config_runs]),
                "reached": sum(hit is not None for hit in hits),
                "time_to_target_s": median_reached([None if h is None else h[0] for h in hits]),
                "steps_to_target": median_reached([None if h is None else h[1] for h in hits]),
                "in_sync": all(
                    bool(run.get("params_in_sync")) and bool(run.get("curve_in_sync"))
                    for run in config_runs
                ),
            }
        reference = entries.get(REFERENCE, {})
        for entry in entries.values():
            entry["step_speedup"] = ratio(reference.get("ms_per_step"), entry["ms_per_step"])
            entry["target_speedup"] = ratio(
                reference.get("time_to_target_s"), entry["time_to_target_s"]
            )
        summary[workload] = {
            "target": target,
            "threshold": threshold,
            "budget_s": budget,
            "configs": entries,
        }
    return summary


def ratio(reference: float | None, value: float | None) -> float | None:
    """``reference / value`` (above 1: ``value`` is the faster), if both are known."""
    return reference / value if reference and value else None


def markdown(report: dict[str, Any]) -> str:
    settings, summary = report["settings"], report["summary"]
    env = report["environment"]
    commit = settings.get("commit") or "unknown"
    dirty = " (with uncommitted changes)" if env.get("git_dirty") else ""
    steps = ", ".join(f"{count} for {name}" for name, count in settings["steps"].items())
    lines = [
        "# Step policies on a 1 Gbit/s link: time to a held-out loss",
        "",
        f"`{settings['command']}` at commit {commit}{dirty}, {settings['date']}; written by "
        f"`benchmarks/bench_policies.py` in {settings['wall_s'] / 60:.0f} min. Two namespace "
        f"hosts, one worker each (W=2), every link limited by `tbf` to {settings['rate']}; "
        f"{settings['repeats']} interleaved repeats, medians.",
        "",
        f"What was measured: each run trains for a fixed number of timed steps ({steps}), "
        f"after {settings['warmup']} untimed warm-up "
        "step(s) that average gradients in every configuration. The clock stops every "
        "E steps (E = the least common multiple of "
        f"{settings['curve']} and the period H, so always at a sync point) for worker 0's "
        "held-out loss (`Trace_ELBO`, 8 particles, fixed seed, on data no worker trained "
        "on). The target is `ours`'s median final held-out loss; a run reaches it at the "
        f"first evaluation within {100 * settings['tolerance']:g} % of it. Time to target "
        "is training time only, evaluations excluded; a median over repeats where most "
        "runs never got there is 'not reached'. Policies average the parameters after "
        "every H-th timed step, ours and torch's on the same steps. Adam (lr 1e-3) and "
        "DiLoCo's outer optimizer (lr 0.7, Nesterov momentum 0.9) are not tuned for any "
        "period. Sent per step: bytes out of worker 0's host interface "
        "(`/proc/net/dev`, with TCP/IP headers) per timed step.",
        "",
        "Every configuration gets the same number of steps as `ours`, so one whose "
        "steps buy less of the loss reaches the target only if it gets within the "
        "tolerance of `ours`'s final loss anyway; how long it would take with more steps "
        "is not measured. A configuration evaluated every E steps (column 'eval. every') "
        "can be seen to reach the target up to E - 1 of its steps late: a long period "
        "is evaluated seldom.",
        "",
    ]
    for workload, entry in summary.items():
        lines += _workload_section(workload, entry, settings)
    if report.get("failures"):
        lines += ["## Failed runs", ""]
        lines += [f"- {failure}" for failure in report["failures"]]
        lines.append("")
    return "\n".join(lines)


def _workload_section(workload: str, entry: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The table and plain findings for one workload."""
    target, configs = entry["target"], entry["configs"]
    if target is None:
        return [f"## {workload}", "", "No run of `ours` finished: no target.", ""]
    lines = [
        f"## {workload}",
        "",
        f"Target: held-out loss {target:.6g} (`ours` after {settings['steps'][workload]} "
        "steps); "
        f"reached at or below {entry['threshold']:.6g}. Held-out loss after a fixed "
        f"budget of seconds: after {_number(entry.get('budget_s'), '.2f')} s of training, "
        "half of what `ours` trains for (the last evaluation within it).",
        "",
        "| configuration | H | eval. every | ms/step | step vs ours | sent/step (MB) "
        "| final held-out loss | gap to target | loss after the budget of seconds "
        "| time to target (s) | reached | steps to target | time to target vs ours | in sync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, c in configs.items():
        cells = [
            name,
            str(c["period"] or "-"),
            str(c["curve_every"]),
            _number(c["ms_per_step"], ".1f"),
            _times(c["step_speedup"]),
            _number(None if c["bytes_per_step"] is None else c["bytes_per_step"] / 1e6, ".3f"),
            _number(c["final_loss"], ".6g"),
            _percent(c["final_gap"]),
            _number(c.get("loss_at_budget"), ".6g"),
            "not reached" if c["time_to_target_s"] is None else f"{c['time_to_target_s']:.2f}",
            f"{c['reached']}/{c['runs']}",
            "-" if c["steps_to_target"] is None else f"{c['steps_to_target']:.0f}",
            _times(c["target_speedup"]),
            str(c["in_sync"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Ratios are speed: ours's time over the configuration's (above 1: faster).", ""]
    return [*lines, *_findings(configs), ""]


def _findings(configs: dict[str, Any]) -> list[str]:
    """What the table says, in sentences made from its numbers."""
    reference = configs.get(REFERENCE, {})
    others = {name: c for name, c in configs.items() if name != REFERENCE}
    sooner = {n: c for n, c in others.items() if (c["target_speedup"] or 0) > 1}
    later = {n: c for n, c in others.items() if c["target_speedup"] is not None and n not in sooner}
    missed = {n: c for n, c in others.items() if c["time_to_target_s"] is None}
    cheaper_not_sooner = [
        n for n, c in others.items() if (c["step_speedup"] or 0) > 1 and n not in sooner
    ]
    lines = []
    if reference.get("time_to_target_s") is not None:
        lines.append(
            f"- `ours` reached its own target in {reference['time_to_target_s']:.2f} s "
            f"(steps of {reference['ms_per_step']:.1f} ms)."
        )
    if sooner:
        best = max(sooner, key=lambda n: sooner[n]["target_speedup"])
        listed = ", ".join(f"`{n}` {c['target_speedup']:.2f}x" for n, c in sooner.items())
        lines.append(f"- Reached the target sooner than `ours`: {listed}; fastest `{best}`.")
    else:
        lines.append("- No configuration reached the target sooner than `ours`.")
    if later:
        listed = ", ".join(f"`{n}` {c['target_speedup']:.2f}x" for n, c in later.items())
        lines.append(f"- Reached it, but no sooner than `ours`: {listed}.")
    if missed:
        listed = ", ".join(f"`{n}` ({_percent(c['final_gap'])})" for n, c in missed.items())
        lines.append(
            "- Did not reach it within the step budget (median run; final loss against "
            f"the target): {listed}."
        )
    if cheaper_not_sooner:
        listed = ", ".join(f"`{n}`" for n in cheaper_not_sooner)
        lines.append(f"- Cheaper steps than `ours` that did not pay in time to target: {listed}.")
    unsynced = [n for n, c in configs.items() if not c["in_sync"]]
    if unsynced:
        listed = ", ".join(f"`{n}`" for n in unsynced)
        lines.append(f"- Workers held different parameters at an evaluation or the end: {listed}.")
    return lines


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f} %"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--periods", nargs="+", type=int, default=[4, 16, 64])
    parser.add_argument(
        "--configs", nargs="+", help="configuration names to run (default: all; ours always)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, help="timed steps per run (default: 256 for large1m, 512 for vae)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed averaged steps first")
    parser.add_argument(
        "--curve", type=int, default=16, help="evaluate every lcm(CURVE, H) timed steps"
    )
    parser.add_argument("--rate", default="1gbit", choices=RATE_BYTES)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--output-dir", type=Path, default=HERE)
    parser.add_argument(
        "--report-from", type=Path, help="write the report again from a policies_results.json"
    )
    args = parser.parse_args()
    if min(args.repeats, args.steps or 1, args.warmup, args.curve, *args.periods) < 1:
        parser.error("--repeats, --steps, --warmup, --curve and --periods must be at least 1")
    names = [config.name for config in configs_for(args.periods)]
    unknown = sorted(set(args.configs or ()) - set(names))
    if unknown:
        parser.error(f"unknown configurations {unknown}: choose from {names}")
    every = math.lcm(args.curve, *args.periods)
    if any(steps_for(workload, args) % every for workload in args.workloads):
        parser.error(f"--steps must be a multiple of {every}: every run ends at an evaluation")
    return args


def write(report: dict[str, Any], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "policies_results.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (output_dir / "POLICY_RESULTS.md").write_text(text)
    print(text)


def main() -> None:
    args = parse_args()
    if args.report_from is not None:
        report = json.loads(args.report_from.read_text())
        summary = summarise(report["runs"], report["settings"]["tolerance"])
        write({**report, "summary": summary}, args.output_dir)
        return
    why_not = unavailable()
    if why_not:
        sys.exit(f"no namespace hosts here: {why_not}")
    configs = [
        c
        for c in configs_for(args.periods)
        if args.configs is None or c.name in [*args.configs, REFERENCE]
    ]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    failures: list[str] = []
    started = time.monotonic()
    with NamespaceCluster(2, rate=args.rate) as cluster:
        for repeat in range(1, args.repeats + 1):
            for workload in args.workloads:
                for config in configs:
                    where = f"[{repeat}/{args.repeats} {workload}] {config.name}:"
                    try:
                        record = run_once(cluster, config, workload, args)
                    except RunFailed as exc:
                        print(f"{where} FAILED {exc}", flush=True)
                        failures.append(f"{where} {why(exc)}")
                        continue
                    print(
                        f"{where} {record['ms_per_step']:.2f} ms/step, "
                        f"final held-out loss {record['heldout_loss']:.6g}",
                        flush=True,
                    )
                    runs.setdefault(workload, {}).setdefault(config.name, []).append(record)
    settings = {
        "command": shlex.join(["python", *sys.argv]),
        "commit": git("rev-parse", "--short", "HEAD"),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rate": args.rate,
        "repeats": args.repeats,
        "steps": {workload: steps_for(workload, args) for workload in args.workloads},
        "warmup": args.warmup,
        "curve": args.curve,
        "periods": args.periods,
        "tolerance": args.tolerance,
        "wall_s": time.monotonic() - started,
    }
    report = {
        "environment": environment(),
        "settings": settings,
        "summary": summarise(runs, args.tolerance),
        "runs": runs,
        "failures": failures,
    }
    write(report, args.output_dir)


if __name__ == "__main__":
    main()
