"""Two hosts on a rate-limited link: ours against DDP, and the cost model against the link.

    python benchmarks/bench_link.py [--rates 1gbit 10gbit] [--workloads large1m small400 vae]
                                    [--repeats 3] [--output-dir benchmarks]

Needs root and ``ip netns``: it makes two hosts as network namespaces on one
switch (``tests/support/cluster.py``), every link limited by a token bucket (``tbf``)
to the rate, one worker per host, and removes them when it ends. Host names
resolve to loopback, as on a stock Debian node, and nothing is set by hand:
the workers find the link as a user's would (``torchrun --nnodes 2``).

For each repeat, workload and rate it runs, interleaved:

* ``plain-x2``: plain Pyro on each host at once, without communication (the
  slower counts): the limit of two workers, against which efficiency is
  measured;
* ``ours-x2``: the same with our optimizer (at W=1 it steps every tensor at
  once, faster than plain Pyro on many tensors): the compute time of a step
  for the cost model;
* ``ours``, ``ours-fp16`` (``compression="fp16"``), ``torch-ours`` (Pyro's
  torch-native loop through ``DistributedTorchOptimizer``): two hosts under
  torchrun;
* ``ddp`` and ``ddp-fp16`` (DDP's ``fp16_compress_hook``): the same ELBO
  module under ``DistributedDataParallel``;
* ``ours-lowrank`` and ``torch-ours-lowrank`` (``comm_hook=LowRankHook(rank)``
  in SVI and in the module's loop) and ``ddp-powersgd`` (DDP's
  ``powerSGD_hook`` at the same rank), all compressing from the
  first timed step; with them every configuration on two hosts also reports
  its held-out loss after training (``--heldout``), against which the
  compressed runs are judged.

``ours`` also fits the all-reduce cost on the link after its clock stops
(``pd.scaling.measure_collective`` and ``CollectiveCost.fit``). The report
holds that cost model against the link: the predicted step, compute plus one
all-reduce of the gradient's bytes, against the measured one; and the same
from the link's nominal rate (``project_scaling``'s ``network_bandwidth``).

Writes ``link_results.json`` (every run, the medians and the environment) and
``LINK_RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_svi import RUN_TIMEOUT_S, WORKER, RunFailed, environment, free_port, parse_result
from suite import PLANS

from pyro_distributed.scaling import CollectiveCost

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.support.cluster import NamespaceCluster, unavailable  # noqa: E402  (after the path)

#: (name, --optim, two hosts under torchrun or each alone)
CONFIGS: tuple[tuple[str, str, bool], ...] = (
    ("plain-x2", "plain", False),
    ("ours-x2", "ours", False),
    ("ours", "ours", True),
    ("ours-fp16", "ours-fp16", True),
    ("torch-ours", "torch-ours", True),
    ("ddp", "ddp", True),
    ("ddp-fp16", "ddp-fp16", True),
    ("ours-lowrank", "ours-lowrank", True),
    ("torch-ours-lowrank", "torch-ours-lowrank", True),
    ("ddp-powersgd", "ddp-powersgd", True),
)
#: Each configuration of ours against its DDP peer with the same compression.
PEERS = (
    ("ours", "ddp"),
    ("torch-ours", "ddp"),
    ("ours-fp16", "ddp-fp16"),
    ("ours-lowrank", "ddp-powersgd"),
    ("torch-ours-lowrank", "ddp-powersgd"),
)
#: The rows of the low-rank table, each with the uncompressed run of the same loop.
LOW_RANK = (
    ("ours", "ours"),
    ("ours-lowrank", "ours"),
    ("torch-ours", "torch-ours"),
    ("torch-ours-lowrank", "torch-ours"),
    ("ddp", "ddp"),
    ("ddp-powersgd", "ddp"),
)
RATE_BYTES = {"100mbit": 12.5e6, "1gbit": 125e6, "10gbit": 1.25e9}
#: The rank of ours-lowrank and ddp-powersgd, and the workloads with a held-out loss.
RANK = 4
HELDOUT = ("large1m", "vae")


def worker_environment() -> dict[str, str]:
    """This machine's environment without anything a launcher or a user would set by hand."""
    unset = ("GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {name: value for name, value in os.environ.items() if name not in unset}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run_once(cluster: NamespaceCluster, optim: str, together: bool, plan: Any) -> dict[str, Any]:
    """One run on both hosts; the record of worker 0 (or the slower host, when alone)."""
    worker = [
        *(str(WORKER), "--workload", plan.workload, "--optim", optim),
        *("--steps", str(plan.steps), "--warmup", str(plan.warmup)),
        *(["--fit-cost"] if optim == "ours" else []),
        *(["--heldout", "--rank", str(RANK)] if together and plan.workload in HELDOUT else []),
    ]
    outputs = run_on_hosts(cluster, worker, together)
    records = [parse_result(output) for output in (outputs if not together else outputs[:1])]
    slowest = max(records, key=lambda record: float(record["ms_per_step"]))
    return {**slowest, "params_in_sync": all(bool(r["params_in_sync"]) for r in records)}


def run_on_hosts(cluster: NamespaceCluster, worker: list[str], together: bool) -> list[str]:
    """``worker`` (a script and its arguments) on every host, under torchrun
    across the hosts (``together``) or alone on each; every host's output.

    :raises RunFailed: for a run that failed or outlasted ``RUN_TIMEOUT_S``.
    """
    master, port = cluster.hosts[0].address, free_port()
    processes = []
    for rank, host in enumerate(cluster.hosts):
        if together:
            launcher = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(len(cluster.hosts)), "--node-rank", str(rank),
                "--nproc-per-node", "1", "--master-addr", master, "--master-port", str(port),
            ]  # fmt: skip
        else:
            launcher = [sys.executable]
        processes.append(
            cluster.start(host, [*launcher, *worker], env=worker_environment(), cwd=ROOT)
        )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RunFailed(f"exit status {process.returncode}:\n{output[-2000:]}")
            outputs.append(output)
    except subprocess.TimeoutExpired as exc:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        raise RunFailed(f"timed out after {RUN_TIMEOUT_S:g} s") from exc
    return outputs


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [float(run[key]) for run in runs if key in run]
    return statistics.median(values) if values else None


def summarise(runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]]) -> dict[str, Any]:
    """Medians per rate, workload and configuration; the ratios; the cost model's error."""
    summary: dict[str, Any] = {}
    for rate, workloads in runs.items():
        for workload, configs in workloads.items():
            ms = {
                name: median_of(config_runs, "ms_per_step") for name, config_runs in configs.items()
            }
            ours = configs["ours"]
            latency = median_of(ours, "latency_s")
            bandwidth = median_of(ours, "bandwidth")
            gradient_bytes = median_of(ours, "gradient_bytes")
            compute = ms.get("ours-x2") or ms["plain-x2"]
            entry: dict[str, Any] = {
                "ms_per_step": ms,
                "efficiency": {
                    name: ms["plain-x2"] / value
                    for name, value in ms.items()
                    if name not in ("plain-x2", "ours-x2") and ms["plain-x2"] and value
                },
                "against_peer": {
                    f"{ours_name}/{peer}": ms[peer] / ms[ours_name]
                    for ours_name, peer in PEERS
                    if ms.get(peer) and ms.get(ours_name)
                },
                "in_sync": all(
                    run.get("params_in_sync", False) for runs_ in configs.values() for run in runs_
                ),
                "heldout_loss": {
                    name: value
                    for name, config_runs in configs.items()
                    if (value := median_of(config_runs, "heldout_loss")) is not None
                },
            }
            if None not in (latency, bandwidth, gradient_bytes, compute, ms["ours"]):
                assert latency is not None and bandwidth is not None  # for mypy
                assert gradient_bytes is not None and compute is not None
                fitted = CollectiveCost(latency, bandwidth, world_size=2)
                predicted = compute + 1e3 * fitted.seconds(gradient_bytes)
                nominal = compute + 1e3 * (2 * fitted.hop_s + gradient_bytes / RATE_BYTES[rate])
                entry["cost_model"] = {
                    "gradient_bytes": gradient_bytes,
                    "fitted_latency_us": 1e6 * latency,
                    "fitted_bandwidth_MBps": bandwidth / 1e6,
                    "compute_ms": compute,
                    "measured_ms": ms["ours"],
                    "predicted_ms": predicted,
                    "error": predicted / ms["ours"] - 1,
                    "nominal_rate_ms": nominal,
                    "nominal_error": nominal / ms["ours"] - 1,
                }
            summary.setdefault(rate, {})[workload] = entry
    for workloads in summary.values():
        _refit_in_step(workloads)
    return summary


def _refit_in_step(workloads: dict[str, Any]) -> None:
    """Per workload, its step predicted by the cost re-fitted in each other
    workload's step at the same rate (``CollectiveCost.in_step``: the latency
    absorbs what a collective costs inside a step, the bandwidth stays fitted)."""
    models = {
        name: entry["cost_model"] for name, entry in workloads.items() if "cost_model" in entry
    }
    for fit_on, source in models.items():
        idle = CollectiveCost(
            1e-6 * source["fitted_latency_us"], 1e6 * source["fitted_bandwidth_MBps"], 2
        )
        fitted = idle.in_step(
            1e-3 * source["measured_ms"], 1e-3 * source["compute_ms"], source["gradient_bytes"]
        )
        for name, model in models.items():
            if name == fit_on:
                continue
            predicted = model["compute_ms"] + 1e3 * fitted.seconds(model["gradient_bytes"])
            model.setdefault("in_step", {})[fit_on] = {
                "predicted_ms": predicted,
                "error": predicted / model["measured_ms"] - 1,
            }


def markdown(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    lines = [
        "# Two hosts on a rate-limited link",
        "",
        f"`{settings['command']}` at commit {settings.get('commit') or 'unknown'}: "
        f"{settings['repeats']} interleaved repeats, medians; "
        "one worker per namespace host, every link limited by `tbf`. Written by "
        "`benchmarks/bench_link.py`.",
        "",
        "## Step time (ms), efficiency against two independent processes, and against DDP",
        "",
        "| link | workload | "
        + " | ".join(name for name, _, _ in CONFIGS)
        + " | ours eff. | ours/ddp | torch-ours/ddp | ours-fp16/ddp-fp16 | in sync |",
        "|---|---|" + "---:|" * (len(CONFIGS) + 4) + "---|",
    ]
    for rate, workloads in summary.items():
        for workload, entry in workloads.items():
            ms, peer = entry["ms_per_step"], entry["against_peer"]
            cells = [f"{ms[name]:.1f}" if ms.get(name) else "-" for name, _, _ in CONFIGS]
            ratios = [
                f"{peer[key]:.2f}x" if key in peer else "-"
                for key in ("ours/ddp", "torch-ours/ddp", "ours-fp16/ddp-fp16")
            ]
            efficiency = entry["efficiency"].get("ours")
            lines.append(
                f"| {rate} | {workload} | {' | '.join(cells)} "
                f"| {efficiency:.2f} | {' | '.join(ratios)} | {entry['in_sync']} |"
            )
    lines += [
        "",
        "Ratios are throughput: DDP's median step over ours (above 1: ours is faster).",
        "",
        *_low_rank_table(summary),
        "## The cost model against the link",
        "",
        "Predicted step = compute (ours-x2) + one all-reduce of the gradient, with the "
        "latency and bandwidth `measure_collective` fitted on the link (and, last two "
        "columns, with the link's nominal rate in place of the fitted bandwidth).",
        "",
        "| link | workload | gradient | fitted all-reduce | compute | measured (ours) "
        "| predicted | error | from nominal rate | error |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rate, workloads in summary.items():
        for workload, entry in workloads.items():
            model = entry.get("cost_model")
            if model is None:
                continue
            lines.append(
                f"| {rate} | {workload} | {model['gradient_bytes'] / 1e6:.2f} MB "
                f"| {model['fitted_latency_us']:.0f} us + bytes / "
                f"{model['fitted_bandwidth_MBps']:.0f} MB/s "
                f"| {model['compute_ms']:.1f} | {model['measured_ms']:.1f} "
                f"| {model['predicted_ms']:.1f} | {100 * model['error']:+.0f} % "
                f"| {model['nominal_rate_ms']:.1f} | {100 * model['nominal_error']:+.0f} % |"
            )
    fitted_on = sorted(
        {
            fit
            for w in summary.values()
            for e in w.values()
            for fit in e.get("cost_model", {}).get("in_step", {})
        }
    )
    lines += [
        "",
        "Re-fitted inside a step (`CollectiveCost.in_step`, as `scaling_advice(compute_s=...)` "
        "does): the latency re-fitted to one workload's measured step, the bandwidth as "
        "fitted; predicted against measured for the others.",
        "",
        "| link | workload | measured | " + " | ".join(f"fit on {fit}" for fit in fitted_on) + " |",
        "|---|---|---:|" + "---:|" * len(fitted_on),
    ]
    for rate, workloads in summary.items():
        for workload, entry in workloads.items():
            model = entry.get("cost_model")
            if model is None:
                continue
            cells = []
            for fit in fitted_on:
                refit = model.get("in_step", {}).get(fit)
                cells.append(
                    "(fit)" if refit is None
                    else f"{refit['predicted_ms']:.1f}: {100 * refit['error']:+.0f} %"
                )  # fmt: skip
            lines.append(
                f"| {rate} | {workload} | {model['measured_ms']:.1f} | {' | '.join(cells)} |"
            )
    return "\n".join(lines) + "\n"


def _low_rank_table(summary: dict[str, Any]) -> list[str]:
    """Per link and workload, each loop uncompressed and low-rank, ours and DDP's."""
    lines = [
        f"## Low rank: `LowRankHook` against DDP's `powerSGD_hook`, both at rank {RANK}",
        "",
        "Per configuration: the step (ms), the efficiency against two independent "
        "processes, the speed-up over the same loop uncompressed, the throughput against "
        "`ddp-powersgd` (above 1: faster), and the held-out loss after the same steps "
        "(lower is better) with its gap to the same loop uncompressed. `torch-ours` runs "
        "the very module and `torch.optim.Adam` that DDP runs; `ours` is SVI.",
        "",
        "| link | workload | configuration | ms | eff. | over uncompressed "
        "| against ddp-powersgd | held-out loss | gap to uncompressed |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = 0
    for rate, workloads in summary.items():
        for workload, entry in workloads.items():
            ms, eff, loss = entry["ms_per_step"], entry["efficiency"], entry["heldout_loss"]
            if not (
                ms.get("ddp-powersgd") and (ms.get("ours-lowrank") or ms.get("torch-ours-lowrank"))
            ):
                continue
            for name, plain in LOW_RANK:
                if not ms.get(name):
                    continue
                rows += 1
                cells = [
                    f"{ms[name]:.1f}",
                    f"{eff[name]:.2f}" if name in eff else "-",
                    f"{ms[plain] / ms[name]:.2f}x" if ms.get(plain) else "-",
                    f"{ms['ddp-powersgd'] / ms[name]:.2f}x",
                    f"{loss[name]:.1f}" if name in loss else "-",
                    _gap(loss, name, plain) if name != plain else "",
                ]
                lines.append(f"| {rate} | {workload} | {name} | {' | '.join(cells)} |")
    return [*lines, ""] if rows else []


def _gap(loss: dict[str, float], compressed: str, plain: str) -> str:
    """The compressed run's held-out loss against the uncompressed one's, in percent."""
    if compressed not in loss or plain not in loss:
        return "-"
    return f"{100 * (loss[compressed] - loss[plain]) / abs(loss[plain]):+.2f} %"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], choices=RATE_BYTES)
    parser.add_argument(
        "--workloads", nargs="+", default=["large1m", "small400", "vae"],
        choices=[plan.workload for plan in PLANS if plan.main],
    )  # fmt: skip
    parser.add_argument("--configs", nargs="+", choices=[name for name, _, _ in CONFIGS])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, help="timed steps per run (default: the suite's)")
    parser.add_argument("--output-dir", type=Path, default=HERE)
    parser.add_argument(
        "--report-from", type=Path, help="write the report again from a link_results.json"
    )
    return parser.parse_args()


def write(report: dict[str, Any], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "link_results.json").write_text(json.dumps(report, indent=1) + "\n")
    commit = str(report["environment"].get("git_commit") or "")[:7]
    text = markdown(report["summary"], {**report["settings"], "commit": commit})
    (output_dir / "LINK_RESULTS.md").write_text(text)
    print(text)


def main() -> None:
    args = parse_args()
    if args.report_from is not None:
        report = json.loads(args.report_from.read_text())
        write({**report, "summary": summarise(report["runs"])}, args.output_dir)
        return
    why_not = unavailable()
    if why_not:
        sys.exit(f"no namespace hosts here: {why_not}")
    plans = [plan for plan in PLANS if plan.workload in args.workloads]
    if args.steps:
        plans = [
            type(plan)(plan.workload, args.steps, min(plan.warmup, args.steps)) for plan in plans
        ]
    configs = [
        c for c in CONFIGS if args.configs is None or c[0] in [*args.configs, "plain-x2", "ours"]
    ]
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    started = time.monotonic()
    with NamespaceCluster(2) as cluster:
        for repeat in range(1, args.repeats + 1):
            for plan in plans:
                for rate in args.rates:
                    for host in cluster.hosts:
                        cluster.limit(host, rate)
                    for name, optim, together in configs:
                        where = f"[{repeat}/{args.repeats} {plan.workload} {rate}] {name}:"
                        try:
                            record = run_once(cluster, optim, together, plan)
                        except RunFailed as exc:
                            print(f"{where} FAILED {exc}", flush=True)
                            continue
                        print(f"{where} {record['ms_per_step']:.2f} ms/step", flush=True)
                        by_config = runs.setdefault(rate, {}).setdefault(plan.workload, {})
                        by_config.setdefault(name, []).append(record)
    settings = {
        "command": shlex.join(["python", *sys.argv]),
        "repeats": args.repeats,
        "wall_s": time.monotonic() - started,
    }
    summary = summarise(runs)
    report = {"environment": environment(), "settings": settings, "summary": summary, "runs": runs}
    write(report, args.output_dir)


if __name__ == "__main__":
    main()
