"""Lightning step time: PyroDistributedStrategy against Lightning's DDPStrategy.

The same LightningModule, data and batch size under both strategies, 2 CPU
workers started by Lightning's own launcher, interleaved repeats:

* ``global``: Bayesian regression with D weights (AutoNormal, 2 D floats of
  parameters), every parameter global: a step of a few milliseconds, where
  per-step overhead shows.
* ``mlp``: a regression whose mean is a two-layer network (PyroModule
  ``nn.Linear`` layers, 100 -> 1024 -> 1024 -> 1, about 1.15 million point
  parameters) and a latent noise scale: the gradient is large enough for
  DDP's bucketed overlap to matter.
* ``local``: N data points with an 8-float latent each (AutoNormal over a
  plate of N, 16 N floats of parameters). DDP replicates and all-reduces all
  of them every step; the strategy with ``own_local_params=True`` keeps N/W
  rows per worker and sends only the global ones; ``ours-sparse`` adds
  ``local_updates="sparse"`` (only each batch's rows are stepped).

    python benchmarks/bench_lightning.py                 # about 15 minutes here
    python benchmarks/bench_lightning.py --rows 100000 --repeats 1

Prints, for each configuration, the median step time (forward, backward and
optimizer step, timed on worker 0 from ``on_train_batch_start`` to
``on_train_batch_end``) and the median iteration time (from one
``on_train_batch_end`` to the next: the step plus loading the batch), and
writes ``benchmarks/lightning_results.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCH, LATENT = 256, 8
MLP_INPUTS, MLP_HIDDEN = 100, 1024
WORKLOADS = ("global", "mlp", "local")
# "ours-sparse": owned local rows with local_updates="sparse" (O(batch) a step).
STRATEGIES = {
    "global": ("ours", "ddp"),
    "mlp": ("ours", "ddp"),
    "local": ("ours", "ours-sparse", "ddp"),
}


def worker(args: argparse.Namespace) -> None:
    """One Lightning run (this process and the one Lightning's launcher starts)."""
    import lightning.pytorch as pl
    import pyro
    import pyro.distributions as dist
    import torch
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoNormal
    from pyro.nn import PyroModule
    from torch.utils.data import DataLoader, TensorDataset

    import pyro_distributed as pd
    from pyro_distributed.integrations.lightning import IndexedDataset, PyroDistributedStrategy

    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    pyro.settings.set(module_local_params=True)
    local = args.workload == "local"
    n = args.rows if local else 20_000
    generator = torch.Generator().manual_seed(0)
    if local:
        dataset = IndexedDataset(TensorDataset(torch.randn(n, LATENT, generator=generator)))
    else:
        features = MLP_INPUTS if args.workload == "mlp" else args.features
        x = torch.randn(n, features, generator=generator)
        y = x @ torch.randn(features, generator=generator) + torch.randn(n, generator=generator)
        dataset = IndexedDataset(TensorDataset(x, y))

    class Model(PyroModule):
        def __init__(self) -> None:
            super().__init__()
            if args.workload == "mlp":
                self.net = PyroModule[torch.nn.Sequential](
                    torch.nn.Linear(MLP_INPUTS, MLP_HIDDEN),
                    torch.nn.ReLU(),
                    torch.nn.Linear(MLP_HIDDEN, MLP_HIDDEN),
                    torch.nn.ReLU(),
                    torch.nn.Linear(MLP_HIDDEN, 1),
                )

        def forward(self, indices: Any, x: Any, y: Any = None) -> None:
            if local:
                mu = pyro.sample("mu", dist.Normal(0.0, 5.0).expand([LATENT]).to_event(1))
                with pyro.plate("data", n, subsample=indices):
                    z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
                    pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=x)
            elif args.workload == "mlp":
                sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
                with pyro.plate("data", n, subsample=indices):
                    pyro.sample("y", dist.Normal(self.net(x).squeeze(-1), sigma), obs=y)
            else:
                w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
                with pyro.plate("data", n, subsample=indices):
                    pyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    model = Model()
    plates = (lambda indices, *_: pyro.plate("data", n, subsample=indices)) if local else None
    guide = AutoNormal(model, create_plates=plates)
    loss_fn = Trace_ELBO()(model, guide)
    owned = local and args.strategy.startswith("ours")
    local_updates = "sparse" if args.strategy == "ours-sparse" else "dense"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.loss_fn = loss_fn
            self.times: list[float] = []
            self.iterations: list[float] = []
            self.cpu_seconds: list[float] = []  # this process's CPU seconds per iteration
            self._ended: float | None = None
            self._cpu_ended = 0.0

        def setup(self, stage: str) -> None:  # create the parameters once the workers met
            first = next(iter(pd.ShardSampler(dataset, by_block=owned, shuffle=False)))
            with pd.shard_subsamples(own_local_params=owned, by_block=owned):
                self.loss_fn(*dataset[torch.tensor([first])])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.loss_fn(*batch)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            now = time.perf_counter()
            self.times.append(now - self._started)
            cpu = time.process_time()
            if self._ended is not None:
                self.iterations.append(now - self._ended)
                self.cpu_seconds.append(cpu - self._cpu_ended)
            self._ended, self._cpu_ended = now, cpu

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.loss_fn.parameters(), lr=0.01)

    strategy: Any = PyroDistributedStrategy(own_local_params=owned, local_updates=local_updates)
    if args.strategy == "ddp":
        strategy = "ddp"
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    # DDP gets Lightning's DistributedSampler; the strategy, its own ShardSampler.
    profile = cProfile.Profile() if args.profile else None
    if profile is not None:
        profile.enable()
    trainer.fit(module, DataLoader(dataset, batch_size=BATCH, shuffle=True))
    if profile is not None:
        profile.disable()
        if trainer.is_global_zero:
            profile.dump_stats(args.profile)
    # Leave together: a gloo group torn down while its peer's is still open can
    # abort the slower process at exit (plain DDP leaves that to the interpreter).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if trainer.is_global_zero:
        timed = {
            "step": module.times[args.warmup :],
            "iteration": module.iterations[args.warmup :],
            "cpu": module.cpu_seconds[args.warmup :],
        }
        Path(args.out).write_text(json.dumps(timed))


def run_config(args: argparse.Namespace, workload: str, strategy: str) -> dict[str, float]:
    """The median step and iteration time of one run, in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        command = [
            sys.executable, __file__, "--worker", "--workload", workload,
            "--strategy", strategy, "--rows", str(args.rows), "--features", str(args.features),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{workload}/{strategy} failed:\n{done.stderr[-4000:]}")
        timed = json.loads(out.read_text())
        return {kind: statistics.median(times) for kind, times in timed.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="N of the local workload")
    parser.add_argument("--features", type=int, default=1000, help="D of the global workload")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="global", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    # cProfile worker 0's whole fit into this file (with --worker; see README).
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # interleaved: the machine's load hits both alike
        for workload in args.workloads:
            for strategy in STRATEGIES[workload]:
                key = f"{workload}/{strategy}"
                runs.setdefault(key, []).append(run_config(args, workload, strategy))
                shown = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in runs[key][-1].items())
                print(f"{key}: {shown}", flush=True)
    medians = {
        key: {kind: statistics.median(run[kind] for run in done) for kind in done[0]}
        for key, done in runs.items()
    }
    labels = {
        "global": f"D = {args.features}",
        "mlp": "1.15 M weights",
        "local": f"N = {args.rows}",
    }
    print(f"\nmedians of {args.repeats} runs, 2 CPU workers, {BATCH} rows per worker per step")
    for workload in args.workloads:
        ddp = medians[f"{workload}/ddp"]
        for strategy in STRATEGIES[workload][:-1]:
            ours = medians[f"{workload}/{strategy}"]
            for kind in ("step", "iteration", "cpu"):
                print(
                    f"{workload} ({labels[workload]}), {strategy}, {kind}: "
                    f"{ours[kind] * 1e3:.2f} ms, DDPStrategy {ddp[kind] * 1e3:.2f} ms, "
                    f"{strategy} / DDP = {ours[kind] / ddp[kind]:.3f}"
                )
    record = {"args": vars(args), "runs_s": runs, "medians_s": medians}
    (HERE / "lightning_results.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
