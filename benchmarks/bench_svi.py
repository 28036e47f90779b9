"""Time SVI steps for every configuration, interleaved and repeated; report medians.

For each workload and each repeat, every configuration runs once in turn
(repeat 1 of all of them, then repeat 2, ...), each as fresh subprocesses of
``svi_worker.py`` with ``OMP_NUM_THREADS=1``. The driver prints one Markdown
table per workload (median ms/step, min-max) and the derived figures:

* W=1 overhead: median(config) / median(plain) - 1;
* W=2 weak-scaling efficiency: median(plain-x2) / median(config).

Usage::

    python benchmarks/bench_svi.py [--repeats 5] [--json results.json] [--markdown results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

WORKER = Path(__file__).resolve().with_name("svi_worker.py")
WORKLOADS = ("small400", "large1m")
RUN_TIMEOUT_S = 300.0

Launcher = Literal["python", "torchrun", "horovodrun"]


@dataclass(frozen=True)
class Config:
    """One way of running the benchmark.

    :param launcher: ``"python"`` starts ``workers`` independent processes at
        the same time (no communication) and keeps the slowest; ``"torchrun"``
        and ``"horovodrun"`` start one job of ``workers`` communicating workers.
    :param baseline: the configuration this one is compared with, if any.
    """

    name: str
    optim: str
    launcher: Launcher
    workers: int = 1
    baseline: str | None = None

    @property
    def needs_horovod(self) -> bool:
        return self.launcher == "horovodrun" or self.optim == "pyro-horovod"


CONFIGS: list[Config] = [
    Config("plain", "plain", "python"),
    Config("plain-x2", "plain", "python", workers=2),
    Config("ours-w1", "ours", "python", baseline="plain"),
    Config("ours-w2", "ours", "torchrun", workers=2, baseline="plain-x2"),
    Config("ours-mt-w1", "ours-mt", "python", baseline="plain"),
    Config("ours-mt-w2", "ours-mt", "torchrun", workers=2, baseline="plain-x2"),
    Config("pyro-horovod-w2", "pyro-horovod", "horovodrun", workers=2, baseline="plain-x2"),
    Config("ours-horovod-w2", "ours", "horovodrun", workers=2, baseline="plain-x2"),
]


class RunFailed(RuntimeError):
    """A benchmark subprocess failed, timed out, or printed no result."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def horovod_available() -> bool:
    """Whether ``horovod.torch`` imports in this interpreter and ``horovodrun`` is on PATH."""
    if shutil.which("horovodrun") is None:
        return False
    check = [sys.executable, "-c", "import horovod.torch"]
    try:
        return subprocess.run(check, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def launch_prefix(config: Config) -> list[str]:
    """The command line up to the worker script, for one process or job of ``config``."""
    if config.launcher == "python":
        return [sys.executable]
    if config.launcher == "torchrun":
        return [
            *(sys.executable, "-m", "torch.distributed.run"),
            *("--nproc-per-node", str(config.workers)),
            *("--master-addr", "127.0.0.1", "--master-port", str(free_port())),
        ]
    hosts = f"localhost:{config.workers}"
    return ["horovodrun", "--gloo", "-np", str(config.workers), "-H", hosts, sys.executable]


def commands(config: Config, workload: str, steps: int, warmup: int) -> list[list[str]]:
    """The command lines to start together for one run of ``config``."""
    worker_args = [
        *(str(WORKER), "--workload", workload, "--optim", config.optim),
        *("--steps", str(steps), "--warmup", str(warmup)),
    ]
    copies = config.workers if config.launcher == "python" else 1
    return [[*launch_prefix(config), *worker_args] for _ in range(copies)]


def parse_result(output: str) -> float:
    """ms/step from the worker's JSON line (horovodrun prefixes each line with the rank)."""
    for line in output.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "ms_per_step" in record:
            return float(record["ms_per_step"])
    raise RunFailed(f"no JSON result in the output:\n{output[-2000:]}")


def run_together(command_lines: Sequence[Sequence[str]], timeout: float) -> list[str]:
    """Start all commands at once and return the output (stdout and stderr) of each.

    Each command gets its own process group, so a time-out kills everything
    it started (launchers included) and nothing can hang the benchmark.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in command_lines]
        procs: list[subprocess.Popen[bytes]] = []
        deadline = time.monotonic() + timeout
        try:
            for command, log in zip(command_lines, logs, strict=True):
                procs.append(
                    subprocess.Popen(
                        command,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except OSError as exc:
            raise RunFailed(f"could not start: {exc}") from exc
        except subprocess.TimeoutExpired as exc:
            raise RunFailed(f"timed out after {timeout:g} s: {' '.join(exc.cmd)}") from exc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        outputs = []
        for proc, log in zip(procs, logs, strict=True):
            log.seek(0)
            output = log.read()
            if proc.returncode != 0:
                raise RunFailed(f"exit status {proc.returncode}:\n{output[-2000:]}")
            outputs.append(output)
    return outputs


def run_config(config: Config, workload: str, steps: int, warmup: int) -> float:
    """ms/step for one run of ``config``: the slowest of its independent processes."""
    outputs = run_together(commands(config, workload, steps, warmup), RUN_TIMEOUT_S)
    return max(parse_result(output) for output in outputs)


def run_workload(
    workload: str, configs: Sequence[Config], repeats: int, steps: int, warmup: int
) -> dict[str, list[float | None]]:
    """ms/step of every run, by configuration; ``None`` for a run that failed."""
    runs: dict[str, list[float | None]] = {config.name: [] for config in configs}
    for repeat in range(1, repeats + 1):
        for config in configs:
            try:
                ms: float | None = run_config(config, workload, steps, warmup)
                print(f"[{workload} {repeat}/{repeats}] {config.name}: {ms:.1f} ms/step")
            except RunFailed as exc:
                ms = None
                print(f"[{workload} {repeat}/{repeats}] {config.name}: FAILED, {exc}")
            sys.stdout.flush()
            runs[config.name].append(ms)
    return runs


def summarise(runs: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the runs that succeeded, and how many did."""
    ok = [ms for ms in runs if ms is not None]
    summary: dict[str, Any] = {"ok": len(ok), "runs": len(runs)}
    if ok:
        summary.update(median=statistics.median(ok), min=min(ok), max=max(ok))
    return summary


def derived_figures(
    configs: Sequence[Config], summaries: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each config against its baseline: W=1 overhead, or weak-scaling efficiency for W>1."""
    figures = []
    for config in configs:
        if config.baseline is None or config.baseline not in summaries:
            continue
        ours, base = summaries[config.name].get("median"), summaries[config.baseline].get("median")
        if ours is None or base is None:
            continue
        figure = {"config": config.name, "baseline": config.baseline, "workers": config.workers}
        if config.workers == 1:
            figure.update(kind="overhead", value=ours / base - 1.0)
        else:
            figure.update(kind="efficiency", value=base / ours)
        figures.append(figure)
    return figures


def figure_line(figure: dict[str, Any]) -> str:
    """One derived figure as a Markdown list item."""
    versus, percent = f"({figure['config']} vs {figure['baseline']})", 100 * figure["value"]
    if figure["kind"] == "overhead":
        return f"- W=1 overhead {versus}: {percent:+.1f} %"
    return f"- W={figure['workers']} weak-scaling efficiency {versus}: {percent:.1f} %"


def markdown_table(
    workload: str,
    configs: Sequence[Config],
    summaries: dict[str, dict[str, Any]],
    figures: Sequence[dict[str, Any]],
) -> str:
    """One workload's results as a Markdown table followed by its derived figures."""
    lines = [
        f"### {workload}",
        "",
        "| configuration | workers | median ms/step | min-max ms/step | runs ok |",
        "|---|---:|---:|---:|---:|",
    ]
    for config in configs:
        s = summaries[config.name]
        median, spread = "n/a", "n/a"
        if s["ok"]:
            median, spread = f"{s['median']:.1f}", f"{s['min']:.1f}-{s['max']:.1f}"
        lines.append(
            f"| {config.name} | {config.workers} | {median} | {spread} | {s['ok']}/{s['runs']} |"
        )
    lines += ["", *(figure_line(figure) for figure in figures)]
    return "\n".join(lines) + "\n"


def select_configs(names: Sequence[str] | None) -> list[Config]:
    """The configurations asked for, minus those that need a missing Horovod."""
    chosen = [c for c in CONFIGS if names is None or c.name in names]
    needing = [c.name for c in chosen if c.needs_horovod]
    if needing and not horovod_available():
        print(
            f"skipped {', '.join(needing)}: needs `import horovod.torch` to work in "
            f"{sys.executable} and `horovodrun` on PATH"
        )
        chosen = [c for c in chosen if not c.needs_horovod]
    return chosen


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5, help="runs of each configuration")
    parser.add_argument("--steps", type=int, default=50, help="timed SVI steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed SVI steps per run")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=[c.name for c in CONFIGS],
        help="configurations to run (default: all that can run here)",
    )
    parser.add_argument("--json", type=Path, help="write raw runs, medians and figures here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--repeats and --steps must be at least 1, --warmup at least 0")
    return args


def main() -> None:
    args = parse_args()
    configs = select_configs(args.configs)
    if not configs:
        sys.exit("no configuration left to run")
    report: dict[str, Any] = {
        "settings": {
            "repeats": args.repeats,
            "steps": args.steps,
            "warmup": args.warmup,
            "configs": [c.name for c in configs],
        },
        "workloads": {},
    }
    tables = []
    for workload in args.workloads:
        runs = run_workload(workload, configs, args.repeats, args.steps, args.warmup)
        summaries = {name: summarise(ms) for name, ms in runs.items()}
        figures = derived_figures(configs, summaries)
        report["workloads"][workload] = {"runs": runs, "summary": summaries, "figures": figures}
        tables.append(markdown_table(workload, configs, summaries, figures))
    settings = f"{args.repeats} repeats x {args.steps} steps (after {args.warmup} warm-up)"
    markdown = f"## SVI step time, {settings}\n\n" + "\n".join(tables)
    print("\n" + markdown)
    if args.markdown is not None:
        args.markdown.write_text(markdown)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
