"""Dense against sparse local steps: the same fit, in less wall time.

    python benchmarks/convergence_local.py        # about 20 minutes on 2 cores

Trains two models on two workers (torchrun, gloo), with
``shard_subsamples(own_local_params=True)`` (dense local steps) and with
``local_updates="sparse"``, and compares the results:

* ``examples/random_effects.py``: per-group effects, scored by their
  correlation with the true effects and their RMS distance to the exact
  posterior means of this conjugate model;
* the local-rows benchmark model (``svi_worker.local_latents``: one
  8-dimensional latent per data point, AutoNormal with ``create_plates``),
  here on data drawn from the model, scored by the locations' correlation
  with the true latents and their RMS distance to the exact posterior means,
  and the scales against the exact posterior standard deviation.

Each pair runs with two values of Adam's ``beta1``: 0.9 (the default) and
0.5. A lazy step updates a row's moments only when the row is in a batch,
so its momentum averages over the row's last visits, epochs apart, where a
dense step's averages over the last steps; with rows visited about once per
epoch, ``beta1 = 0.9`` makes the lazy step lag by about ten epochs. Two run
seeds (subsampling and guide noise; the same data) at ``beta1 = 0.5`` give
the run-to-run noise that "within noise" is measured against.

It writes ``convergence_local.json``, ``CONVERGENCE_LOCAL.md`` and the figure
``docs/sparse_local_convergence.png`` (the ELBO against wall time, smoothed).
With ``--worker`` it is one worker of the second model (torchrun starts it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
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
PROBLEMS = ("random_effects", "local_latents")

# Random effects at 100,000 groups, 1,000 per worker per step: 60 epochs in
# 3,000 steps, in both modes. The latent model at 100,000 points, 256 per
# worker per step: 100 epochs dense, 120 sparse (a sparse step costs about
# half a dense one here, and the lazy step needs a few more visits per row
# for the same fit). Every row is visited about once an epoch.
GROUPS, GROUP_BATCH, GROUP_STEPS = 100_000, 1000, 3000
POINTS, POINT_EPOCHS = 100_000, {"dense": 100, "sparse": 120}
TRUE_MU, OBS_SCALE = 1.0, 0.5
# (beta1, run seed): the default beta1 once, the lower one twice for the noise.
RUNS = ((0.9, 0), (0.5, 0), (0.5, 1))
SMOOTHING, TRACE_POINTS = 200, 1500


def run_name(mode: str, beta1: float, seed: int) -> str:
    return f"{mode}, beta1 {beta1}, seed {seed}"


def latent_worker(local_updates: str, beta1: float, seed: int, out: Path) -> None:
    """One worker: fit the benchmark's local-latent model on data drawn from it."""
    import pyro
    import torch
    from pyro.infer import SVI, Trace_ELBO

    import pyro_distributed as pd

    sys.path.insert(0, str(HERE))
    from svi_worker import LOCAL_BATCH, LOCAL_DIM, local_latents

    torch.set_num_threads(1)
    pd.init()
    pd.set_rng_seed(seed)
    generator = torch.Generator().manual_seed(1)  # the same data on every worker
    truth = TRUE_MU + torch.randn(POINTS, LOCAL_DIM, generator=generator)
    x = truth + OBS_SCALE * torch.randn(POINTS, LOCAL_DIM, generator=generator)
    workload = local_latents(POINTS, generator)
    steps = POINT_EPOCHS[local_updates] * POINTS // (LOCAL_BATCH * pd.world_size())
    # lr decays 100-fold over the run, so that each row settles at the end.
    settings = {"lr": 0.05, "lrd": 0.01 ** (1 / steps), "betas": (beta1, 0.999)}
    optim = pd.DistributedOptimizer(pyro.optim.ClippedAdam(settings))
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
    subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True, timeout=1800)


def run_one(problem: str, mode: str, beta1: float, seed: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{problem}-{mode}-{beta1}-{seed}.json"
    common = ["--local-updates", mode, "--trace-out", str(out)]
    if problem == "random_effects":
        script = [str(ROOT / "examples" / "random_effects.py")]
        options = [f"--groups={GROUPS}", f"--batch={GROUP_BATCH}", f"--steps={GROUP_STEPS}"]
        options += [f"--beta1={beta1}", f"--run-seed={seed}"]
    else:
        script = [str(Path(__file__).resolve()), "--worker"]
        options = [f"--beta1={beta1}", f"--seed={seed}"]
    torchrun([*script, *options, *common])
    record: dict[str, Any] = json.loads(out.read_text())
    seconds, loss = record.pop("seconds"), record.pop("loss")
    # Kept: the smoothed loss at most TRACE_POINTS times (the runs are long).
    stride = max(1, len(loss) // TRACE_POINTS)
    record.update(
        mode=mode,
        beta1=beta1,
        seed=seed,
        steps=len(loss),
        wall=seconds[-1],
        trace_seconds=[round(t, 3) for t in seconds[stride - 1 :: stride]],
        trace_loss=[float(f"{v:.6g}") for v in smoothed(loss, SMOOTHING)[stride - 1 :: stride]],
    )
    return record


def run_all(problems: list[str]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {problem: {} for problem in problems}
    with tempfile.TemporaryDirectory() as tmp:
        for problem in problems:
            for beta1, seed in RUNS:
                for mode in MODES:  # interleaved: the machine's load hits both alike
                    record = run_one(problem, mode, beta1, seed, Path(tmp))
                    results[problem][run_name(mode, beta1, seed)] = record
                    print(f"{problem}, {run_name(mode, beta1, seed)}: {_summary(record)}")
    return results


def _summary(record: dict[str, Any]) -> str:
    return (
        f"{record['wall']:.1f} s, correlation {record['correlation']:.4f} "
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
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, problem in zip(axes, PROBLEMS, strict=True):
        runs = results[problem]
        shown = []
        for beta1, colour in ((0.5, "tab:blue"), (0.9, "tab:orange")):
            for mode, style in zip(MODES, ("-", "--"), strict=True):
                run = runs[run_name(mode, beta1, 0)]
                elbo = [-v for v in run["trace_loss"]]
                shown += elbo
                label = (
                    f"{mode}, beta1 {beta1}: {run['wall']:.0f} s, "
                    f"corr {run['correlation']:.4f}, RMS {run['rms_to_exact']:.4f}"
                )
                axis.plot(run["trace_seconds"], elbo, style, color=colour, label=label, lw=1)
        tail = sorted(shown)[len(shown) // 10 :]  # the first steps' ELBO is far below
        span = tail[-1] - tail[0]
        axis.set_ylim(tail[0] - 0.1 * span, tail[-1] + 0.1 * span)
        axis.set_xlabel("wall time (s), 2 workers")
        axis.set_ylabel(f"ELBO (running mean of {SMOOTHING} steps)")
        axis.set_title(titles[problem])
        axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    FIGURE.parent.mkdir(exist_ok=True)
    figure.savefig(FIGURE, dpi=110)


def comparison(runs: dict[str, Any], beta1: float) -> dict[str, float]:
    """Sparse against dense at one beta1, over the seeds run at it, and the noise:
    the largest difference between two seeds of the same mode."""
    seeds = [seed for b, seed in RUNS if b == beta1]

    def metric(mode: str, key: str) -> list[float]:
        return [float(runs[run_name(mode, beta1, seed)][key]) for seed in seeds]

    def wall(mode: str) -> list[float]:
        return [runs[run_name(mode, beta1, seed)]["wall"] for seed in seeds]

    found = {"seeds": float(len(seeds))}
    for key in ("correlation", "rms_to_exact"):
        dense, sparse = metric("dense", key), metric("sparse", key)
        found[key] = statistics.median(sparse) - statistics.median(dense)
        found[f"{key}_noise"] = max(max(v) - min(v) for v in (dense, sparse))
    found["wall"] = statistics.median(wall("sparse")) / statistics.median(wall("dense"))
    return found


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Dense and sparse local steps: quality and wall time",
        "",
        "Two workers (torchrun, gloo) on the shared 2-core machine, "
        "`benchmarks/convergence_local.py`. Random effects: the same steps in both modes; "
        f"local latents: {POINT_EPOCHS['dense']} epochs dense, {POINT_EPOCHS['sparse']} sparse. "
        "Figure: [`docs/sparse_local_convergence.png`](../docs/sparse_local_convergence.png).",
        "",
        "| model | run | steps | wall time (s) | correlation with the truth (ceiling) "
        "| RMS to exact posterior means | other |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for problem in PROBLEMS:
        for name, run in results[problem].items():
            other = (
                f"tau {run['tau']:.3f}, sigma {run['sigma']:.3f}"
                if problem == "random_effects"
                else f"mean abs scale error {run['scale_error']:.4f}"
            )
            lines.append(
                f"| {problem} | {name} | {run['steps']} | {run['wall']:.1f} "
                f"| {run['correlation']:.4f} ({run['ceiling']:.4f}) "
                f"| {run['rms_to_exact']:.4f} | {other} |"
            )
    lines += [
        "",
        "Sparse against dense, medians over the seeds; the noise is the largest "
        "difference between two seeds of one mode (one seed at beta1 0.9: no noise "
        "estimate there).",
        "",
        "| model | beta1 | correlation, sparse - dense (noise) "
        "| RMS to exact, sparse - dense (noise) | wall time, sparse / dense "
        "| sparse reaches dense's final ELBO (seed 0) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for problem in PROBLEMS:
        for beta1 in sorted({b for b, _ in RUNS}):
            found = comparison(results[problem], beta1)
            noisy = found["seeds"] > 1
            lines.append(
                f"| {problem} | {beta1} | {found['correlation']:+.4f}"
                + (f" ({found['correlation_noise']:.4f})" if noisy else "")
                + f" | {found['rms_to_exact']:+.4f}"
                + (f" ({found['rms_to_exact_noise']:.4f})" if noisy else "")
                + f" | {found['wall']:.2f}x | {reached_at(results[problem], beta1)} |"
            )
    lines += [
        "",
        f"The ELBO is a running mean of {SMOOTHING} steps, averaged over the two workers.",
    ]
    return "\n".join(lines) + "\n"


def reached_at(runs: dict[str, Any], beta1: float) -> str:
    """When seed 0's sparse run first reaches its dense run's final (smoothed)
    ELBO, in seconds and as a share of the dense run's time; "never" if it does not."""
    dense, sparse = (runs[run_name(mode, beta1, 0)] for mode in MODES)
    target = dense["trace_loss"][-1]
    for seconds, loss in zip(sparse["trace_seconds"], sparse["trace_loss"], strict=True):
        if loss <= target:
            return f"{seconds:.0f} s ({seconds / dense['wall']:.2f}x)"
    return "never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one worker (torchrun)")
    parser.add_argument("--local-updates", choices=MODES, default="dense")
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-out", type=Path)
    parser.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    parser.add_argument(
        "--problems",
        nargs="+",
        choices=PROBLEMS,
        default=list(PROBLEMS),
        help="rerun these only; the others are kept from the saved JSON",
    )
    args = parser.parse_args()
    if args.worker:
        assert args.trace_out is not None
        latent_worker(args.local_updates, args.beta1, args.seed, args.trace_out)
        return
    saved = HERE / "convergence_local.json"
    if args.plot_only:
        results = json.loads(saved.read_text())
    else:
        results = json.loads(saved.read_text()) if saved.exists() else {}
        results.update(run_all(args.problems))
        saved.write_text(json.dumps(results) + "\n")
    plot(results)
    report = markdown(results)
    (HERE / "CONVERGENCE_LOCAL.md").write_text(report)
    print(report)
    assert all(math.isfinite(r["correlation"]) for runs in results.values() for r in runs.values())


if __name__ == "__main__":
    main()
