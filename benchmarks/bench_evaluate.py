"""How long the VAE example's held-out ELBO takes, split across workers or repeated on each.

The example evaluates the ELBO of its 297 held-out images with 10
(vectorised) particles.
Before ``pd.evaluate_loss``, every worker evaluated all 297 images and the
results were averaged; now each worker evaluates its own block. This script
times both ways in one process (interleaved, ``--repeats`` calls each), as
one plain process and as two workers under ``torchrun``, and prints the
medians:

    python benchmarks/bench_evaluate.py            # about a minute

Run it from the repository root with the project's environment active.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTICLES = 10


def worker(repeats: int) -> None:
    """One process of the measurement; worker 0 prints a JSON line of medians."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import vae_digits

    import pyro_distributed as pd

    torch.set_num_threads(1)
    pd.init()
    _, held_out = vae_digits.load_images()
    torch.manual_seed(0)
    vae = vae_digits.VAE(held_out.shape[1], 128, 4)
    pd.set_rng_seed(0)
    indices = torch.arange(len(held_out))

    def repeated() -> float:
        # The example's former way: every worker evaluates every image.
        with torch.no_grad():
            loss = vae_digits.evaluation_elbo(PARTICLES).loss(
                vae.model, vae.guide, held_out, indices, len(held_out)
            )
        return pd.all_mean(loss)

    def split() -> float:
        return vae_digits.held_out_elbo(vae, held_out, PARTICLES)

    times: dict[str, list[float]] = {"repeated": [], "split": []}
    for _ in range(repeats + 1):  # the first round warms up
        for name, evaluate in (("repeated", repeated), ("split", split)):
            pd.barrier()
            started = time.perf_counter()
            evaluate()
            times[name].append(time.perf_counter() - started)
    if pd.is_main():
        medians = {name: 1e3 * statistics.median(values[1:]) for name, values in times.items()}
        print(json.dumps({"workers": pd.world_size(), **medians}))
    pd.shutdown()


def launch(workers: int, repeats: int) -> dict[str, float]:
    script = [str(Path(__file__).resolve()), "--worker", f"--repeats={repeats}"]
    if workers == 1:
        command = [sys.executable, *script]
    else:
        torchrun = Path(sys.executable).parent / "torchrun"
        command = [str(torchrun), "--standalone", f"--nproc-per-node={workers}", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, env=env, cwd=ROOT, timeout=300
    )
    line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
    result: dict[str, float] = json.loads(line)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each way")
    parser.add_argument("--launches", type=int, default=3, help="process launches per W")
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats)
        return
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for _ in range(args.launches):
        for workers in runs:  # interleaved: W=1, W=2, W=1, ...
            runs[workers].append(launch(workers, args.repeats))
    print(f"held-out ELBO of 297 images, {PARTICLES} particles: median ms per evaluation")
    print("| workers | repeated on every worker | split across workers | ratio |")
    print("|---:|---:|---:|---:|")
    for workers, results in runs.items():
        repeated = statistics.median(r["repeated"] for r in results)
        split = statistics.median(r["split"] for r in results)
        print(f"| {workers} | {repeated:.1f} | {split:.1f} | {repeated / split:.2f}x |")


if __name__ == "__main__":
    main()
