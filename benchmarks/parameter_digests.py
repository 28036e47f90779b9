"""Each worker's SHA-256 of all of its parameters after training, to compare two commits.

    torchrun --nproc-per-node W benchmarks/parameter_digests.py [--steps 60]

Trains, through ``svi_worker.prepare``, the VAE with each front end (``ours``:
SVI with ``DistributedOptimizer``; ``torch-ours``: the module loop with
``DistributedTorchOptimizer``) and ``local10000`` with owned local rows
(``ours-owned``, ``torch-ours-owned``), overlap on as by default, and prints
one line per worker and configuration: the configuration, the worker and the
SHA-256 of every parameter it holds (its own block of local rows included),
by name. The same command on two commits prints the same lines when their
training is bitwise the same.
"""

from __future__ import annotations

import argparse
import hashlib

import pyro
from svi_worker import prepare

import pyro_distributed

RUNS = (
    ("vae", "ours"),
    ("vae", "torch-ours"),
    ("local10000", "ours-owned"),
    ("local10000", "torch-ours-owned"),
)


def digest_after(workload: str, optim: str, steps: int) -> str:
    pyro.clear_param_store()
    training = prepare(workload, optim, {})
    for _ in range(steps):
        training.step()
    digest = hashlib.sha256()
    for name, value in training.parameters():
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    lines = []
    for workload, optim in RUNS:
        pyro.settings.set(module_local_params=False)
        lines.append(
            f"{workload} {optim} W={pyro_distributed.world_size()} "
            f"worker {pyro_distributed.rank()}: {digest_after(workload, optim, args.steps)}"
        )
    for line in pyro_distributed.current_engine().allgather_object("\n".join(lines)):
        if pyro_distributed.is_main():
            print(line, flush=True)
    pyro_distributed.shutdown()


if __name__ == "__main__":
    main()
