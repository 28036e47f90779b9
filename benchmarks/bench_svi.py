"""Run the whole SVI performance suite with one command and write its report.

    python benchmarks/bench_svi.py

runs every configuration in ``suite.CONFIGS`` on every workload in
``suite.PLANS`` that asks for it, and writes three files into
``--output-dir`` (default: this directory):

* ``results.json``: every run, the medians, min and max, the derived figures,
  the targets' verdicts, the settings and the environment (versions, CPUs,
  date, git commit);
* ``RESULTS.md``: the targets, pass or fail, one table per main workload,
  and the step-time sweep;
* ``step_time_vs_tensors.png``: median step time against the number of
  parameter tensors, one line per configuration.

For each workload and each repeat, every configuration runs once in turn
(repeat 1 of all of them, then repeat 2, ...), so that slow drifts of a
shared machine hit all configurations alike. Each run is a fresh set of
``svi_worker.py`` processes with ``OMP_NUM_THREADS=1``. Quick check that
everything runs (the numbers mean nothing)::

    python benchmarks/bench_svi.py --repeats 1 --steps 3 --warmup 1 --output-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, replace
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from report import Run, derive, judge, markdown, summarise, write_report
from suite import CONFIGS, PLANS, Config, Plan

HERE = Path(__file__).resolve().parent
WORKER = HERE / "svi_worker.py"
RUN_TIMEOUT_S = 300.0


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
    if config.launcher == "mpirun":
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        return [mpiexec, "-n", str(config.workers), sys.executable]
    hosts = f"localhost:{config.workers}"
    return ["horovodrun", "--gloo", "-np", str(config.workers), "-H", hosts, sys.executable]


def commands(config: Config, plan: Plan) -> list[list[str]]:
    """The command lines to start together for one run of ``config`` on ``plan``."""
    worker_args = [
        *(str(WORKER), "--workload", plan.workload, "--optim", config.optim),
        *("--steps", str(plan.steps * config.steps_scale)),
        *("--warmup", str(plan.warmup * config.steps_scale)),
    ]
    copies = config.workers if config.launcher == "python" else 1
    return [[*launch_prefix(config), *worker_args] for _ in range(copies)]


def parse_result(output: str) -> dict[str, Any]:
    """The worker's JSON record (horovodrun prefixes each line with the rank)."""
    for line in output.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "ms_per_step" in record:
            return record
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


def run_config(config: Config, plan: Plan) -> Run:
    """One run of ``config``; with independent processes, the slowest one counts."""
    started = time.monotonic()
    try:
        outputs = run_together(commands(config, plan), RUN_TIMEOUT_S)
        records = [parse_result(output) for output in outputs]
    except RunFailed as exc:
        return {"wall_s": time.monotonic() - started, "error": str(exc)}
    return {
        "wall_s": time.monotonic() - started,
        "ms_per_step": max(float(r["ms_per_step"]) for r in records),
        "param_tensors": int(records[0]["param_tensors"]),
        "params_in_sync": all(bool(r["params_in_sync"]) for r in records),
        "state_bytes": max(int(r.get("state_bytes", 0)) for r in records),
    }


def run_plan(plan: Plan, configs: Sequence[Config], repeats: int) -> dict[str, list[Run]]:
    """Every run of every configuration on one workload, interleaved, by configuration."""
    runs: dict[str, list[Run]] = {config.name: [] for config in configs}
    for repeat in range(1, repeats + 1):
        for config in configs:
            run = run_config(config, plan)
            where = f"[{plan.workload} {repeat}/{repeats}] {config.name}:"
            if "error" in run:
                print(f"{where} FAILED after {run['wall_s']:.1f} s, {run['error']}")
            else:
                sync = "" if run["params_in_sync"] else ", workers DIVERGED"
                print(f"{where} {run['ms_per_step']:.2f} ms/step ({run['wall_s']:.1f} s{sync})")
            sys.stdout.flush()
            runs[config.name].append(run)
    return runs


def mpi_available() -> bool:
    """Whether ``mpi4py`` imports in this interpreter and ``mpiexec`` lies beside it."""
    if not (Path(sys.executable).parent / "mpiexec").exists():
        return False
    check = [sys.executable, "-c", "import mpi4py.MPI"]
    try:
        return subprocess.run(check, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def select_configs(names: Sequence[str] | None) -> list[Config]:
    """The configurations asked for, minus those that need a missing Horovod or MPI."""
    chosen = [c for c in CONFIGS if names is None or c.name in names]
    needing = [c.name for c in chosen if c.needs_horovod]
    if needing and not horovod_available():
        print(
            f"skipped {', '.join(needing)}: needs `import horovod.torch` to work in "
            f"{sys.executable} and `horovodrun` on PATH (scripts/install_horovod.sh builds it)"
        )
        chosen = [c for c in chosen if not c.needs_horovod]
    needing = [c.name for c in chosen if c.needs_mpi]
    if needing and not mpi_available():
        print(
            f"skipped {', '.join(needing)}: needs mpi4py and mpiexec in {sys.executable}'s "
            f"environment (`pip install -e '.[mpi]'`)"
        )
        chosen = [c for c in chosen if not c.needs_mpi]
    return chosen


def select_plans(names: Sequence[str] | None, steps: int | None, warmup: int | None) -> list[Plan]:
    """The workloads asked for, with ``--steps`` and ``--warmup`` applied to all of them."""
    plans = [plan for plan in PLANS if names is None or plan.workload in names]
    if steps is not None:
        plans = [replace(plan, steps=steps) for plan in plans]
    if warmup is not None:
        plans = [replace(plan, warmup=warmup) for plan in plans]
    return plans


def git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """What the numbers depend on besides the code: versions, CPUs, date, commit.

    Versions are read from the installed metadata of the driver's interpreter,
    which is also the workers'; nothing is imported.
    """
    status = git("status", "--porcelain")
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "versions": {
            name: package_version(name)
            for name in ("torch", "pyro-ppl", "horovod", "mpi4py", "mpich")
        },
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    plans, configs = [plan.workload for plan in PLANS], [c.name for c in CONFIGS]
    parser.add_argument(
        "--workloads", nargs="+", choices=plans, help="workloads to run (default: all)"
    )
    parser.add_argument(
        "--configs", nargs="+", choices=configs, help="configurations to run (default: all)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each configuration")
    parser.add_argument("--steps", type=int, help="timed steps per run (default: per workload)")
    parser.add_argument("--warmup", type=int, help="untimed steps per run (default: per workload)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=HERE,
        help="where results.json, RESULTS.md and the plot go (default: %(default)s)",
    )
    args = parser.parse_args()
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--repeats and --steps must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def main() -> None:
    args = parse_args()
    configs = select_configs(args.configs)
    plans = select_plans(args.workloads, args.steps, args.warmup)
    started = time.monotonic()
    workloads = []
    for plan in plans:
        chosen = [config for config in configs if plan.runs(config)]
        if not chosen:
            print(f"skipped {plan.workload}: none of the chosen configurations runs on it")
            continue
        runs = run_plan(plan, chosen, args.repeats)
        summaries = {name: summarise(config_runs) for name, config_runs in runs.items()}
        workloads.append(
            {
                "workload": plan.workload,
                "steps": plan.steps,
                "warmup": plan.warmup,
                "main": plan.main,
                "runs": runs,
                "summary": summaries,
                "figures": derive([asdict(c) for c in chosen], summaries),
            }
        )
        print(f"{plan.workload} done, {(time.monotonic() - started) / 60:.1f} min so far")
    if not workloads:
        sys.exit("nothing to run")
    report = {
        "environment": environment(),
        "settings": {
            "command": shlex.join(["python", *sys.argv]),
            "repeats": args.repeats,
            "run_timeout_s": RUN_TIMEOUT_S,
            "wall_s": time.monotonic() - started,
        },
        "configs": [asdict(config) for config in configs],
        "workloads": workloads,
        "targets": judge(workloads),
    }
    print("\n" + markdown(report, plot_name=None))
    for path in write_report(report, args.output_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
