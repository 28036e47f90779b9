"""cell2location, full batch, W=1 against W=2 replicated and W=2 with owned spots.

For each number of spots N the driver makes one synthetic Visium-like data
set (``examples/cell2location_spatial.py``'s generator), saves it, and runs
three configurations, each a fresh ``model.train()`` on CPU:

* ``W=1``: cell2location as shipped, one process;
* ``W=2 replicated``: ``PyroDistributedStrategy()``: every worker loads every
  spot and steps every spot's parameters (today's state without ownership);
* ``W=2 owned``: ``PyroDistributedStrategy(own_local_params=True)``: each
  worker loads and steps its N/2 spots; only per-gene parameters travel.

Each worker reports its peak resident memory (``ru_maxrss``), its resident
memory just before ``model.train()`` (the interpreter, the libraries and the
AnnData, which every worker holds whole) and the wall time of each epoch;
the table gives the median epoch after the first. Run::

    python benchmarks/bench_cell2location.py --spots 10000 100000

and it prints the table and writes ``benchmarks/cell2location.json``
(``--results`` elsewhere; ``--merge A.json B.json`` joins several runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIGS = {"W=1": (1, "single"), "W=2 owned": (2, "owned"), "W=2 replicated": (2, "replicated")}


def _example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "example", HERE.parent / "examples" / "cell2location_spatial.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: argparse.Namespace) -> None:
    """One configuration; every worker writes ``OUT.rank<r>.json``."""
    import anndata
    import lightning.pytorch as pl
    import pandas
    import scvi
    import torch
    from cell2location.models import Cell2location

    from pyro_distributed.lightning import PyroDistributedStrategy

    torch.set_num_threads(args.threads)
    scvi.settings.seed = 0
    saved = np.load(args.data)
    genes = [f"gene{g}" for g in range(saved["counts"].shape[1])]
    adata = anndata.AnnData(
        X=saved["counts"],
        obs=pandas.DataFrame(
            {"sample": "s1"}, index=[f"s{i}" for i in range(len(saved["counts"]))]
        ),
        var=pandas.DataFrame(index=genes),
    )
    signatures = pandas.DataFrame(saved["signatures"], index=genes)
    Cell2location.setup_anndata(adata, batch_key="sample")
    model = Cell2location(
        adata, cell_state_df=signatures, N_cells_per_location=8, detection_alpha=20
    )
    epochs: list[float] = []

    class Clock(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.started = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            epochs.append(time.perf_counter() - self.started)

    callbacks: list[Any] = [Clock()]
    options: dict[str, Any] = {}
    if args.devices > 1:
        options["strategy"] = PyroDistributedStrategy(own_local_params=args.mode == "owned")
    before = _rss_mb()
    model.train(
        max_epochs=args.epochs,
        batch_size=None,
        accelerator="cpu",
        device=args.devices,
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        **options,
    )
    rank = model.trainer.global_rank
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {"rank": rank, "peak_rss_mb": peak, "rss_before_train_mb": before, "epochs_s": epochs}
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report))


def drive(args: argparse.Namespace) -> None:
    example = _example()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for spots in args.spots:
        adata, signatures, _ = example.synthetic_visium(spots, args.genes, args.types, seed=0)
        data = workdir / f"data{spots}.npz"
        np.savez(data, counts=adata.X, signatures=signatures.to_numpy())
        del adata
        epochs = args.epochs
        for name, (devices, mode) in CONFIGS.items():
            out = workdir / f"{spots}_{mode}_{devices}"
            command = [sys.executable, __file__, "--worker", "--data", str(data), "--out", str(out)]
            command += ["--devices", str(devices), "--mode", mode, "--epochs", str(epochs)]
            command += ["--threads", str(args.threads)]
            env = {**os.environ, "PYTHONPATH": str(HERE.parent), "PYTHONWARNINGS": "ignore"}
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
            reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(devices)]
            results[f"{spots} {name}"] = _summary(reports)
            print(spots, name, results[f"{spots} {name}"], flush=True)
    target = Path(args.results) if args.results else HERE / "cell2location.json"
    target.write_text(json.dumps(results, indent=1))
    print(table(results))


def merge(paths: list[str]) -> None:
    """Join the results of several runs (``--results``) into one table."""
    results: dict[str, Any] = {}
    for path in paths:
        results.update(json.loads(Path(path).read_text()))
    (HERE / "cell2location.json").write_text(json.dumps(results, indent=1))
    print(table(results))


def _summary(reports: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reports),
        "rss_before_train_mb": max(r["rss_before_train_mb"] for r in reports),
        "epoch_s": statistics.median(
            max(r["epochs_s"][e] for r in reports) for e in range(1, len(reports[0]["epochs_s"]))
        ),
    }


def table(results: dict[str, Any]) -> str:
    """The Markdown table of ``results``, each row against W=1 at the same N."""
    lines = [
        "| spots | configuration | peak RSS per worker (MB) | x W=1 | RSS before train (MB) "
        "| training's own (MB) | x W=1 | time per epoch (s) | x W=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in results.items():
        spots, name = key.split(" ", 1)
        base = results[f"{spots} W=1"]
        own = row["peak_rss_mb"] - row["rss_before_train_mb"]
        base_own = base["peak_rss_mb"] - base["rss_before_train_mb"]
        lines.append(
            f"| {int(spots):,} | {name} | {row['peak_rss_mb']:.0f} | "
            f"{row['peak_rss_mb'] / base['peak_rss_mb']:.2f} | {row['rss_before_train_mb']:.0f} | "
            f"{own:.0f} | {own / base_own:.2f} | {row['epoch_s']:.2f} | "
            f"{row['epoch_s'] / base['epoch_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spots", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--genes", type=int, default=300)
    parser.add_argument("--types", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default="/tmp/bench_cell2location")
    parser.add_argument("--results", help="where the driver writes its JSON")
    parser.add_argument("--merge", nargs="+", help="print one table of these result files")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--mode", default="single")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge)
    elif args.worker:
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
