"""Turn the suite's raw runs into figures, a Markdown report and a plot.

Everything here works from the result file alone (the dictionary that
``bench_svi.py`` writes as ``results.json``), so the report can be drawn
again without running anything::

    python benchmarks/report.py benchmarks/results.json [--output-dir DIR]

Every comparison is a ratio of medians. Medians, because single runs on a
shared machine have outliers of 40 % and more; ratios of throughput (the
reference's step time over the configuration's), so that above 1 always
means "faster than the reference".
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from suite import PEERS, SWEEP_CONFIGS, TARGETS, Target

__all__ = [
    "MARKDOWN_NAME",
    "PLOT_NAME",
    "RESULTS_NAME",
    "Run",
    "Summary",
    "derive",
    "judge",
    "markdown",
    "plot",
    "render",
    "summarise",
    "write_report",
]

RESULTS_NAME = "results.json"
MARKDOWN_NAME = "RESULTS.md"
PLOT_NAME = "step_time_vs_tensors.png"


class Run(TypedDict):
    """One run of one configuration: its result, or why it has none."""

    wall_s: float
    ms_per_step: NotRequired[float]
    param_tensors: NotRequired[int]
    params_in_sync: NotRequired[bool]
    error: NotRequired[str]


class Summary(TypedDict):
    """One configuration on one workload, over its repeats."""

    ok: int
    runs: int
    median: NotRequired[float]
    min: NotRequired[float]
    max: NotRequired[float]
    param_tensors: NotRequired[int]
    params_in_sync: NotRequired[bool]


def summarise(runs: Sequence[Run]) -> Summary:
    """Median, min and max ms/step of the runs that succeeded, and how many did.

    ``params_in_sync`` is False if any run ended with workers that disagree.
    """
    ok = [run for run in runs if "ms_per_step" in run]
    summary: Summary = {"ok": len(ok), "runs": len(runs)}
    if ok:
        times = [run["ms_per_step"] for run in ok]
        summary["median"] = statistics.median(times)
        summary["min"], summary["max"] = min(times), max(times)
        summary["param_tensors"] = ok[0].get("param_tensors", 0)
        summary["params_in_sync"] = all(run.get("params_in_sync", True) for run in ok)
    return summary


def throughput_ratio(summaries: Mapping[str, Summary], config: str, reference: str) -> float | None:
    """median(reference) / median(config), or None if either has no successful run."""
    if config not in summaries or reference not in summaries:
        return None
    ours, theirs = summaries[config].get("median"), summaries[reference].get("median")
    if ours is None or theirs is None:
        return None
    return theirs / ours


def derive(
    configs: Sequence[Mapping[str, Any]], summaries: Mapping[str, Summary]
) -> dict[str, dict[str, Any]]:
    """Each configuration against its baseline and, with two workers, against the peers.

    Against the baseline: the W=1 overhead, median / median(plain) - 1, or the
    W=2 weak-scaling efficiency, median(plain-x2) / median. Against a peer:
    the throughput ratio.
    """
    figures: dict[str, dict[str, Any]] = {}
    for config in configs:
        name, baseline = config["name"], config["baseline"]
        figure: dict[str, Any] = {}
        ratio = None if baseline is None else throughput_ratio(summaries, name, baseline)
        if ratio is not None:
            kind = "overhead" if config["workers"] == 1 else "efficiency"
            value = 1.0 / ratio - 1.0 if kind == "overhead" else ratio
            figure.update(baseline=baseline, kind=kind, value=value)
        if config["workers"] > 1 and baseline is not None:
            peers = {peer: throughput_ratio(summaries, name, peer) for peer in PEERS}
            figure["peers"] = {peer: r for peer, r in peers.items() if peer != name and r}
        if figure:
            figures[name] = figure
    return figures


def judge(
    workloads: Sequence[Mapping[str, Any]], targets: Sequence[Target] = TARGETS
) -> list[dict[str, Any]]:
    """Every target on every main workload: the measured value and whether it passes.

    A target without a successful run of both configurations has ``value`` and
    ``passed`` None.
    """
    verdicts = []
    for workload in workloads:
        if not workload["main"]:
            continue
        for target in targets:
            if target.workloads is not None and workload["workload"] not in target.workloads:
                continue
            ratio = throughput_ratio(workload["summary"], target.config, target.reference)
            value = None if ratio is None else target.value(ratio)
            verdicts.append(
                {
                    "label": target.label,
                    "workload": workload["workload"],
                    "config": target.config,
                    "reference": target.reference,
                    "kind": target.kind,
                    "threshold": target.threshold,
                    "value": value,
                    "passed": None if value is None else target.passed(value),
                }
            )
    return verdicts


# ---------------------------------------------------------------------------
# Markdown


def ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def show(kind: str, value: float) -> str:
    """A figure as the report prints it: percentages for efficiency and overhead."""
    if kind == "efficiency":
        return f"{100 * value:.1f} %"
    if kind == "overhead":
        return f"{100 * value:+.1f} %"
    return f"{value:.2f}x"


def environment_line(environment: Mapping[str, Any]) -> str:
    versions = ", ".join(
        f"{name} {environment['versions'].get(name) or 'absent'}"
        for name in ("torch", "pyro-ppl", "horovod")
    )
    commit = (environment.get("git_commit") or "unknown")[:12]
    if environment.get("git_dirty"):
        commit += " with uncommitted changes"
    return (
        f"Measured {environment['date']} on {environment['cpus']} CPUs "
        f"({environment['platform']}), Python {environment['python']}, {versions}; "
        f"commit {commit}."
    )


def workload_table(workload: Mapping[str, Any], configs: Sequence[Mapping[str, Any]]) -> str:
    """One main workload: median and spread of every configuration, and its figures."""
    summaries, figures = workload["summary"], workload["figures"]
    tensors = next((s["param_tensors"] for s in summaries.values() if "param_tensors" in s), None)
    about = f"{tensors} parameter tensors, " if tensors else ""
    lines = [
        f"### {workload['workload']}",
        "",
        f"{about}{count(workload['steps'], 'timed step')} after "
        f"{count(workload['warmup'], 'warm-up step')} per run.",
        "",
        "| configuration | W | median ms/step | min-max | overhead (W=1) or efficiency (W=2) "
        + "".join(f"| vs {peer} " for peer in PEERS)
        + "| runs ok |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(PEERS) + "---:|",
    ]
    for config in configs:
        name = config["name"]
        if name not in summaries:
            continue
        s, figure = summaries[name], figures.get(name, {})
        median, spread = "n/a", "n/a"
        if s["ok"]:
            median, spread = ms(s["median"]), f"{ms(s['min'])}-{ms(s['max'])}"
        if not s.get("params_in_sync", True):
            name += " (workers diverged!)"
        versus = show(figure["kind"], figure["value"]) if "kind" in figure else ""
        if config["name"] == "plain-x2":
            versus = "the limit"
        peers = [figure.get("peers", {}).get(peer) for peer in PEERS]
        cells = [
            name,
            str(config["workers"]),
            median,
            spread,
            versus,
            *("" if r is None else show("speedup", r) for r in peers),
            f"{s['ok']}/{s['runs']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def targets_table(verdicts: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| target | workload | configuration | measured | result |",
        "|---|---|---|---:|:---:|",
    ]
    for v in verdicts:
        measured = "n/a" if v["value"] is None else show(v["kind"], v["value"])
        result = {None: "no result", True: "pass", False: "**fail**"}[v["passed"]]
        against = f"{v['config']} vs {v['reference']}"
        lines.append(f"| {v['label']} | {v['workload']} | {against} | {measured} | {result} |")
    return "\n".join(lines) + "\n"


def sweep_points(workloads: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, Summary]]]:
    """(parameter tensors, summary) for each sweep configuration, by tensor count."""
    points: dict[str, list[tuple[int, Summary]]] = {name: [] for name in SWEEP_CONFIGS}
    for workload in workloads:
        if not workload["workload"].startswith("small"):
            continue
        for name in SWEEP_CONFIGS:
            s = workload["summary"].get(name)
            if s is not None and s["ok"] and s.get("param_tensors"):
                points[name].append((s["param_tensors"], s))
    return {name: sorted(p, key=lambda point: point[0]) for name, p in points.items() if p}


def sweep_table(points: Mapping[str, Sequence[tuple[int, Summary]]]) -> str:
    tensors = sorted({n for series in points.values() for n, _ in series})
    names = list(points)
    lines = [
        "| parameter tensors | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n in tensors:
        medians = [next((ms(s["median"]) for m, s in points[name] if m == n), "") for name in names]
        lines.append(f"| {n} | " + " | ".join(medians) + " |")
    return "\n".join(lines) + "\n"


def markdown(report: Mapping[str, Any], plot_name: str | None) -> str:
    """The short report: targets first, then one table per main workload, then the sweep."""
    settings, workloads = report["settings"], report["workloads"]
    configs = report["configs"]
    parts = [
        "# SVI performance suite: results",
        "",
        f"Written by `{settings['command']}`. {environment_line(report['environment'])}",
        "",
        f"Each workload ran every configuration in turn, {count(settings['repeats'], 'time')} "
        "(interleaved), each run in fresh processes with one thread each. Step times are "
        "medians over the runs (min-max beside them). Efficiency is median(plain-x2) / "
        "median: two independent plain-Pyro processes are the best two workers can do on "
        "this machine. Overhead is median / median(plain) - 1. `vs <peer>` is the peer's "
        "step time over ours: above 1.00x we are faster.",
        "",
    ]
    if report["targets"]:
        parts += ["## Targets", "", targets_table(report["targets"])]
    mains = [w for w in workloads if w["main"]]
    if mains:
        parts += ["## Step time by workload", ""]
        for workload in mains:
            parts += [workload_table(workload, configs)]
    points = sweep_points(workloads)
    if points:
        parts += ["## Step time against the number of parameter tensors", ""]
        parts += [
            "The grouped regression (smallN) with N parameter tensors; median ms/step.",
            "",
        ]
        if plot_name is not None:
            parts += [f"![step time against parameter tensors]({plot_name})", ""]
        parts += [sweep_table(points)]
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# Plot


def plot(report: Mapping[str, Any], path: Path) -> bool:
    """Median step time against parameter tensors, one line per configuration.

    Drawn with the Agg canvas directly, without pyplot, so no display or
    backend setting is ever needed. Returns False, drawing nothing, when the
    report holds fewer than two sweep points for every configuration.
    """
    points = sweep_points(report["workloads"])
    if not any(len(series) >= 2 for series in points.values()):
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator, ScalarFormatter

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for name, series in points.items():
        tensors = [n for n, _ in series]
        medians = [s["median"] for _, s in series]
        spread = [
            [s["median"] - s["min"] for _, s in series],
            [s["max"] - s["median"] for _, s in series],
        ]
        style = "--" if name.startswith("plain") else "-"
        axes.errorbar(tensors, medians, yerr=spread, fmt=style, marker="o", capsize=3, label=name)
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="parameter tensors (AutoNormal on the grouped regression)",
        ylabel="median ms per step (min-max bars)",
    )
    tensors = sorted({n for series in points.values() for n, _ in series})
    axes.set_xticks(tensors, labels=[str(n) for n in tensors])
    axes.xaxis.set_minor_locator(NullLocator())
    axes.yaxis.set_major_formatter(ScalarFormatter())
    repeats = report["settings"]["repeats"]
    axes.set_title(f"Step time against parameter tensors, median of {repeats}")
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    figure.savefig(path, dpi=120)
    return True


def render(report: Mapping[str, Any], output_dir: Path) -> list[Path]:
    """Draw the plot and write the Markdown report from ``report``; the paths written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    plot_path = output_dir / PLOT_NAME
    drawn = plot(report, plot_path)
    if drawn:
        written.append(plot_path)
    markdown_path = output_dir / MARKDOWN_NAME
    markdown_path.write_text(markdown(report, PLOT_NAME if drawn else None))
    written.append(markdown_path)
    return written


def write_report(report: Mapping[str, Any], output_dir: Path) -> list[Path]:
    """Write the result file, then the plot and the Markdown report; the paths written."""
    output_dir.mkdir(parents=True, exist_ok=True)
    results = output_dir / RESULTS_NAME
    results.write_text(json.dumps(report, indent=2) + "\n")
    return [results, *render(report, output_dir)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Draw the plot and the Markdown report again.")
    parser.add_argument("results", type=Path, help="a results.json written by bench_svi.py")
    parser.add_argument(
        "--output-dir", type=Path, help="where to write them (default: beside the result file)"
    )
    args = parser.parse_args()
    report = json.loads(args.results.read_text())
    for path in render(report, args.output_dir or args.results.parent):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
