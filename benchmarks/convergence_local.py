"""Dense against sparse local steps: the same fit, in less wall time.

    python benchmarks/convergence_local.py        # about 5 minutes on 2 cores

Trains two models twice each on two workers (torchrun, gloo), once with
``shard_subsamples(own_local_params=True)`` (dense local steps) and once with
``local_updates="sparse"``, interleaved, and compares the results:

* ``examples/random_effects.py``: per-group effects, scored by their
  correlation with the true effects and their RMS distance to the exact
  posterior means of this conjugate model;
* the local-rows benchmark model (``svi_worker.local_latents``: one
  8-dimensional latent per data point, AutoNormal with ``create_plates``),
  here on data drawn from the model, scored by the locations' correlation
  with the true latents and their RMS distance to the exact posterior means,
  and the scales against the exact posterior standard deviation.

It writes ``convergence_local.json``, ``CONVERGENCE_LOCAL.md`` and the figure
``docs/sparse_local_convergence.png`` (the ELBO against wall time, smoothed).
With ``--worker`` it is one worker of the second model (torchrun starts it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIGURE = ROOT / "docs" / "sparse_local_convergence.png"
MODES = ("dense", "sparse")

# The runs: random effects at 100,000 groups, the same steps in both modes;
# the latent model at 500,000 points, where a sparse step costs about 1/8 of
# a dense one, and the sparse run takes 6 times the dense run's steps. Lazy
# Adam moves a row less per visit than dense Adam, whose momentum keeps
# moving it for ~10 steps after each visit: it needs more epochs, which its
# cheaper steps pay for.
GROUPS, GROUP_BATCH, GROUP_STEPS = 100_000, 1000, 3000
POINTS = 500_000
POINT_STEPS = {"dense": 3000, "sparse": 18000}
TRUE_MU, OBS_SCALE = 1.0, 0.5


def latent_worker(local_updates: str, points: int, steps: int, out: Path) -> None:
    """One worker: fit the benchmark's local-latent model on data drawn from it."""
    import pyro
    import torch
    from pyro.infer import SVI, Trace_ELBO

    import pyro_distributed as pd

    sys.path.insert(0, str(HERE))
    from svi_worker import LOCAL_DIM, local_latents

    torch.set_num_threads(1)
    pd.init()
    pd.set_rng_seed(0)
    generator = torch.Generator().manual_seed(1)  # the same data on every worker
    truth = TRUE_MU + torch.randn(points, LOCAL_DIM, generator=generator)
    x = truth + OBS_SCALE * torch.randn(points, LOCAL_DIM, generator=generator)
    workload = local_latents(points, generator)
    # lr decays 100-fold over the run, so that each row settles at the end.
    lrd = 0.01 ** (1 / steps)
    optim = pd.DistributedOptimizer(pyro.optim.ClippedAdam({"lr": 0.05, "lrd": lrd}))
    svi = SVI(workload.model, workload.guide, optim, Trace_ELBO())
    trace = []
    started = time.perf_counter()
    for _ in range(steps):
        with pd.shard_subsamples(own_local_params=True, local_updates=local_updates):
            loss = svi.step(x)
        trace.append((time.perf_counter() - started, loss))
    traces = pd.current_engine().allgather_object(trace)
    locs = pd.gather_param("AutoNormal.locs.z")
    scales = pd.gather_param("AutoNormal.scales.z")
    mu = pyro.param("AutoNormal.locs.mu").detach()
    if pd.is_main():
        assert locs is not None and scales is not None
        prior_precision, obs_precision = 1.0, OBS_SCALE**-2
        # Given mu, each latent's posterior is Normal(exact_mean, exact_sd).
        exact_mean = (prior_precision * mu + obs_precision * x) / (prior_precision + obs_precision)
        exact_sd = (prior_precision + obs_precision) ** -0.5
        best = (TRUE_MU + obs_precision * x) / (prior_precision + obs_precision)
        record = {
            "local_updates": local_updates,
            "seconds": [t for t, _ in traces[0]],
            "loss": [sum(t[i][1] for t in traces) / len(traces) for i in range(steps)],
            "correlation": _correlation(locs, truth),
            "ceiling": _correlation(best, truth),
            "rms_to_exact": float((locs - exact_mean).pow(2).mean().sqrt()),
            "scale_error": float((scales - exact_sd).abs().mean()),
            "mu_error": float((mu - x.mean(0)).abs().max()),
        }
        out.write_text(json.dumps(record) + "\n")
    pd.shutdown()


def _correlation(a: Any, b: Any) -> float:
    import torch

    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def torchrun(args: list[str]) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True, timeout=1200)


def run_all(problems: list[str]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {problem: {} for problem in problems}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES if "random_effects" in problems else ():
            out = Path(tmp) / f"effects-{mode}.json"
            torchrun(
                [
                    str(ROOT / "examples" / "random_effects.py"),
                    *(f"--groups={GROUPS}", f"--batch={GROUP_BATCH}", f"--steps={GROUP_STEPS}"),
                    *("--local-updates", mode, "--trace-out", str(out)),
                ]
            )
            results["random_effects"][mode] = json.loads(out.read_text())
            print(f"random effects, {mode}: {_summary(results['random_effects'][mode])}")
        for mode in MODES if "local_latents" in problems else ():
            out = Path(tmp) / f"latents-{mode}.json"
            torchrun(
                [
                    str(Path(__file__).resolve()),
                    *("--worker", "--local-updates", mode, "--trace-out", str(out)),
                ]
            )
            results["local_latents"][mode] = json.loads(out.read_text())
            print(f"local latents, {mode}: {_summary(results['local_latents'][mode])}")
    return results


def _summary(record: dict[str, Any]) -> str:
    return (
        f"{record['seconds'][-1]:.1f} s, correlation {record['correlation']:.4f} "
        f"(ceiling {record['ceiling']:.4f}), RMS to exact {record['rms_to_exact']:.4f}"
    )


def smoothed(values: list[float], window: int) -> list[float]:
    """A running mean over ``window`` steps: one step's loss is a noisy estimate."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "random_effects": f"random effects, {GROUPS:,} groups",
        "local_latents": f"local latents (benchmark model), {POINTS:,} points",
    }
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, problem in zip(axes, titles, strict=True):
        runs = results[problem]
        for mode, style in zip(MODES, ("-", "--"), strict=True):
            run = runs[mode]
            elbo = [-v for v in smoothed(run["loss"], 100)]
            steps = len(run["loss"])
            label = (
                f"{mode}: {steps} steps, {run['seconds'][-1]:.0f} s, corr {run['correlation']:.3f}"
            )
            axis.plot(run["seconds"], elbo, style, label=label)
        values = [-v for mode in MODES for v in smoothed(runs[mode]["loss"], 100)]
        tail = sorted(values)[len(values) // 20 :]  # the first steps' ELBO is far below
        span = tail[-1] - tail[0]
        axis.set_ylim(tail[0] - 0.1 * span, tail[-1] + 0.1 * span)
        axis.set_xlabel("wall time (s), 2 workers")
        axis.set_ylabel("ELBO (running mean of 100 steps)")
        axis.set_title(titles[problem])
        axis.legend()
    figure.tight_layout()
    FIGURE.parent.mkdir(exist_ok=True)
    figure.savefig(FIGURE, dpi=110)


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Dense and sparse local steps: quality and wall time",
        "",
        "Two workers (torchrun, gloo) on a shared 2-core machine, one run each, "
        "`benchmarks/convergence_local.py`. Figure: "
        "[`docs/sparse_local_convergence.png`](../docs/sparse_local_convergence.png).",
        "",
        "| model | local steps | steps | wall time (s) | correlation with the truth (ceiling) "
        "| RMS to exact posterior means | other |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for problem, runs in results.items():
        for mode in MODES:
            run = runs[mode]
            other = (
                f"tau {run['tau']:.3f}, sigma {run['sigma']:.3f}"
                if problem == "random_effects"
                else f"mean abs scale error {run['scale_error']:.4f}"
            )
            lines.append(
                f"| {problem} | {mode} | {len(run['loss'])} | {run['seconds'][-1]:.1f} "
                f"| {run['correlation']:.4f} "
                f"({run['ceiling']:.4f}) | {run['rms_to_exact']:.4f} | {other} |"
            )
        dense, sparse = runs["dense"], runs["sparse"]
        reached = time_to_reach(sparse, dense)
        lines.append(
            f"| {problem} | sparse vs dense | | "
            f"{sparse['seconds'][-1] / dense['seconds'][-1]:.2f}x "
            f"| {sparse['correlation'] - dense['correlation']:+.4f} "
            f"| {sparse['rms_to_exact'] - dense['rms_to_exact']:+.4f} | |"
        )
        if reached is not None:
            lines.append(
                f"| {problem} | sparse reaches dense's final ELBO | | {reached:.1f} "
                f"({reached / dense['seconds'][-1]:.2f}x dense's time) | | | |"
            )
    lines += [
        "",
        "The ELBO is a running mean of 100 steps, averaged over the two workers. A "
        "correlation or RMS difference between one run of each mode includes the noise of "
        "one run (subsampling, guide samples), which these single runs do not measure.",
    ]
    return "\n".join(lines) + "\n"


def time_to_reach(run: dict[str, Any], reference: dict[str, Any]) -> float | None:
    """When ``run``'s smoothed ELBO first reaches ``reference``'s final one, in seconds."""
    target = -smoothed(reference["loss"], 100)[-1]
    for seconds, loss in zip(run["seconds"], smoothed(run["loss"], 100), strict=True):
        if -loss >= target:
            return float(seconds)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one worker (torchrun)")
    parser.add_argument("--local-updates", choices=MODES, default="dense")
    parser.add_argument("--trace-out", type=Path)
    parser.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    parser.add_argument(
        "--problems",
        nargs="+",
        choices=["random_effects", "local_latents"],
        default=["random_effects", "local_latents"],
        help="rerun these only; the others are kept from the saved JSON",
    )
    args = parser.parse_args()
    if args.worker:
        assert args.trace_out is not None
        steps = POINT_STEPS[args.local_updates]
        latent_worker(args.local_updates, POINTS, steps, args.trace_out)
        return
    saved = HERE / "convergence_local.json"
    if args.plot_only:
        results = json.loads(saved.read_text())
    else:
        results = json.loads(saved.read_text()) if saved.exists() else {}
        results.update(run_all(args.problems))
        # Rounded: the traces are thousands of points each.
        for runs in results.values():
            for run in runs.values():
                run["seconds"] = [round(v, 4) for v in run["seconds"]]
                run["loss"] = [float(f"{v:.6g}") for v in run["loss"]]
        saved.write_text(json.dumps(results) + "\n")
    plot(results)
    report = markdown(results)
    (HERE / "CONVERGENCE_LOCAL.md").write_text(report)
    print(report)
    assert all(math.isfinite(r["correlation"]) for runs in results.values() for r in runs.values())


if __name__ == "__main__":
    main()
