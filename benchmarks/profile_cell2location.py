"""Where a full-batch cell2location step's memory goes, part by part: W=1 against W=2 owned.

Each worker reports its resident memory (RSS) at four points and the bytes
of what it holds between them:

* ``before train()``: the interpreter, the libraries, the AnnData and the
  model (``read_h5ad_by_rows`` at W=2: no counts; ``anndata.read_h5ad`` at
  W=1: every spot's, CSR);
* ``training starts``: after Lightning's and the strategy's set-up and the
  device-backed splitter's copy of the worker's spots (``data tensors``: the
  bytes of that copy);
* ``after the first step``: the guide's parameters and Adam's moments exist
  (``parameters and moments``: their bytes, global and per spot);
* ``peak``: the largest RSS of the run (``ru_maxrss``); what is above the
  first step's level is the step's intermediate tensors (the autograd graph's
  saved tensors and gradients) and what the allocator keeps of them.

Run::

    python benchmarks/profile_cell2location.py --spots 100000 --genes 300

and it prints one table, each part at W=1 and per worker at W=2 with owned
spots read by rows, and the ratio (0.50 is a part that halves with the
spots).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_cell2location import model_from_h5ad, rss_mb, write_data

HERE = Path(__file__).resolve().parent


def _tensor_mb(value: Any) -> float:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() / 2**20
    if isinstance(value, dict):
        return sum(_tensor_mb(item) for item in value.values())
    return 0.0


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import pyro
    import scvi
    import torch

    from pyro_distributed.lightning import PyroDistributedStrategy

    torch.set_num_threads(1)
    scvi.settings.seed = 0
    _, model = model_from_h5ad(args.data, by_rows=args.devices > 1)
    report: dict[str, Any] = {}

    class Stages(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            report["training starts"] = rss_mb()
            copied = getattr(trainer.train_dataloader.dataset, "data", {})  # device-backed
            report["data tensors"] = _tensor_mb(copied)

        def on_train_batch_end(self, trainer: Any, module: Any, *rest: Any) -> None:
            if "after the first step" in report:
                return
            report["after the first step"] = rss_mb()
            store = pyro.get_param_store()
            report["parameters"] = sum(_tensor_mb(store.get_param(name)) for name in store)
            moments = 0.0
            for optimizer in getattr(module.svi.optim, "optim_objs", {}).values():
                for state in optimizer.state.values():
                    moments += _tensor_mb(dict(state))
            report["moments"] = moments

    options: dict[str, Any] = {}
    if args.devices > 1:
        options["strategy"] = PyroDistributedStrategy(own_local_params=True)
    report["before train()"] = rss_mb()
    model.train(
        max_epochs=args.epochs,
        batch_size=None,
        accelerator="cpu",
        device=args.devices,
        callbacks=[Stages()],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        **options,
    )
    report["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rank = model.trainer.global_rank
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report))


PARTS = [
    ("before train()", lambda r: r["before train()"]),
    ("set-up and data copy", lambda r: r["training starts"] - r["before train()"]),
    ("  of which data tensors", lambda r: r["data tensors"]),
    ("first step's state", lambda r: r["after the first step"] - r["training starts"]),
    ("  of which parameters and moments", lambda r: r["parameters"] + r["moments"]),
    ("step intermediates (peak above it)", lambda r: r["peak"] - r["after the first step"]),
    ("peak", lambda r: r["peak"]),
]


def drive(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / f"data{args.spots}x{args.genes}.h5ad"
    if not data.exists():
        write_data(data, args, args.spots)
    reports = {}
    for devices in (1, 2):
        out = workdir / f"profile{devices}"
        command = [sys.executable, __file__, "--worker", "--data", str(data), "--out", str(out)]
        command += ["--devices", str(devices), "--epochs", str(args.epochs)]
        env = {**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE}", "PYTHONWARNINGS": "ignore"}
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(devices)]
        reports[devices] = max(ranks, key=lambda report: report["peak"])
    lines = ["| part (MB) | W=1 | W=2 owned, by rows, per worker | x W=1 |", "|---|---|---|---|"]
    for name, part in PARTS:
        one, two = part(reports[1]), part(reports[2])
        ratio = f"{two / one:.2f}" if abs(one) > 1 else ""
        lines.append(f"| {name} | {one:.0f} | {two:.0f} | {ratio} |")
    print("\n".join(lines))
    print(json.dumps(reports, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spots", type=int, default=100_000)
    parser.add_argument("--genes", type=int, default=300)
    parser.add_argument("--types", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/bench_cell2location")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--devices", type=int, default=1)
    drive_or_work = parser.parse_args()
    (worker if drive_or_work.worker else drive)(drive_or_work)


if __name__ == "__main__":
    main()
