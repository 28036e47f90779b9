"""Lightning step time: PyroDistributedStrategy against Lightning's DDPStrategy.

The same LightningModule, data and batch size under both strategies, 2 CPU
workers started by Lightning's own launcher, interleaved repeats:

* ``global``: Bayesian regression with D weights (AutoNormal, 2 D floats of
  parameters), every parameter global.
* ``local``: N data points with an 8-float latent each (AutoNormal over a
  plate of N, 16 N floats of parameters). DDP replicates and all-reduces all
  of them every step; the strategy with ``own_local_params=True`` keeps N/W
  rows per worker and sends only the global ones.

    python benchmarks/bench_lightning.py                 # about 5 minutes here
    python benchmarks/bench_lightning.py --rows 100000 --repeats 1

Prints the median step time (forward, backward and optimizer step, timed on
worker 0 from ``on_train_batch_start`` to ``on_train_batch_end``) of each
configuration and writes ``benchmarks/lightning_results.json``.
"""

from __future__ import annotations

import argparse
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
    from pyro_distributed.lightning import IndexedDataset, PyroDistributedStrategy

    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    pyro.settings.set(module_local_params=True)
    local = args.workload == "local"
    n = args.rows if local else 20_000
    generator = torch.Generator().manual_seed(0)
    if local:
        dataset = IndexedDataset(TensorDataset(torch.randn(n, LATENT, generator=generator)))
    else:
        x = torch.randn(n, args.features, generator=generator)
        y = x @ torch.randn(args.features, generator=generator) + torch.randn(n)
        dataset = IndexedDataset(TensorDataset(x, y))

    class Model(PyroModule):
        def forward(self, indices: Any, x: Any, y: Any = None) -> None:
            if local:
                mu = pyro.sample("mu", dist.Normal(0.0, 5.0).expand([LATENT]).to_event(1))
                with pyro.plate("data", n, subsample=indices):
                    z = pyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
                    pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=x)
            else:
                w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
                with pyro.plate("data", n, subsample=indices):
                    pyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    model = Model()
    plates = (lambda indices, *_: pyro.plate("data", n, subsample=indices)) if local else None
    guide = AutoNormal(model, create_plates=plates)
    loss_fn = Trace_ELBO()(model, guide)
    owned = local and args.strategy == "ours"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.loss_fn = loss_fn
            self.times: list[float] = []

        def setup(self, stage: str) -> None:  # create the parameters once the workers met
            first = next(iter(pd.ShardSampler(dataset, by_block=owned, shuffle=False)))
            with pd.shard_subsamples(own_local_params=owned, by_block=owned):
                self.loss_fn(*dataset[torch.tensor([first])])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.loss_fn(*batch)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            self.times.append(time.perf_counter() - self._started)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.loss_fn.parameters(), lr=0.01)

    strategy: Any = PyroDistributedStrategy(own_local_params=owned)
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
    trainer.fit(module, DataLoader(dataset, batch_size=BATCH, shuffle=True))
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps(module.times[args.warmup :]))


def run_config(args: argparse.Namespace, workload: str, strategy: str) -> float:
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
        return statistics.median(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="N of the local workload")
    parser.add_argument("--features", type=int, default=1000, help="D of the global workload")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="global", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved: the machine's load hits both alike
        for workload in ("global", "local"):
            for strategy in ("ours", "ddp"):
                key = f"{workload}/{strategy}"
                results.setdefault(key, []).append(run_config(args, workload, strategy))
                print(f"{key}: {results[key][-1] * 1e3:.1f} ms", flush=True)
    medians = {key: statistics.median(times) for key, times in results.items()}
    print(f"\nmedian step time, 2 CPU workers, {BATCH} rows per worker per step")
    for workload, label in (("global", f"D = {args.features}"), ("local", f"N = {args.rows}")):
        ours, ddp = medians[f"{workload}/ours"], medians[f"{workload}/ddp"]
        print(
            f"{workload} ({label}): ours {ours * 1e3:.1f} ms, DDPStrategy {ddp * 1e3:.1f} ms, "
            f"ours / DDP = {ours / ddp:.2f}"
        )
    record = {"args": vars(args), "runs_s": results, "medians_s": medians}
    (HERE / "lightning_results.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
