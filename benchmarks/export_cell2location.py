"""cell2location's posterior for every spot, written by the workers that own them.

W workers (Lightning's launcher) open ``--data`` by rows
(``read_h5ad_by_rows``), train cell2location ``--steps`` steps in
mini-batches with owned spots, save a Lightning checkpoint, and export the
5%, 50% and 95% quantiles of the cell abundances (``w_sf``) as
cell2location's ``export_posterior(use_quantiles=True)`` computes them: each
worker summarises its own spots (``owned_posterior(model, to="owners")``, in
batches of ``QUANTILE_ROWS`` spots) and ``write_owned_obsm`` puts every
worker's rows into one ``.h5ad``, no worker holding more than its own block
and one other. Then one worker restores that checkpoint (no step left to
take) and exports the same quantiles into another file, and the driver
compares the two files' ``obsm`` bitwise. Run::

    python benchmarks/export_cell2location.py --data FILE.h5ad --devices 2

Each worker reports its resident memory before the export and its peak
during it (``VmRSS`` sampled every 10 ms), and the export's wall time;
results go to ``benchmarks/cell2location_export.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
QUANTILES = {"q05": 0.05, "q50": 0.5, "q95": 0.95}


class PeakRss:
    """The largest ``VmRSS`` seen while it runs, sampled every ``every`` seconds."""

    def __init__(self, every: float = 0.01) -> None:
        self.every, self.peak_mb = every, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        from bench_cell2location import rss_mb

        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, rss_mb())
            self._stop.wait(self.every)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def worker(args: argparse.Namespace) -> None:
    """Train (or restore) and export; every worker writes ``OUT.rank<r>.json``."""
    import lightning.pytorch as pl
    import scvi
    import torch
    from bench_cell2location import model_from_h5ad, rss_mb

    from pyro_distributed.integrations.lightning import PyroDistributedStrategy
    from pyro_distributed.integrations.scvi import owned_posterior, write_owned_obsm

    torch.set_num_threads(1)
    scvi.settings.seed = 0
    _, model = model_from_h5ad(args.data, by_rows=True)
    checkpoint = Path(args.checkpoint)

    class SaveAtTheEnd(pl.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            trainer.save_checkpoint(checkpoint)

    restore = args.devices == 1
    model.train(
        max_epochs=1,
        max_steps=args.steps,
        batch_size=args.batch_size // args.devices,
        accelerator="cpu",
        device=args.devices,
        strategy=PyroDistributedStrategy(own_local_params=True),
        ckpt_path=str(checkpoint) if restore else None,
        callbacks=[] if restore else [SaveAtTheEnd()],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    rank = model.trainer.global_rank
    before = rss_mb()
    started = time.perf_counter()
    with PeakRss() as peak:
        quantiles = {}
        with owned_posterior(model, to="owners"):
            for name, q in QUANTILES.items():  # export_posterior's calls, this worker's spots
                quantiles[f"{name}_cell_abundance_w_sf"] = model.posterior_quantile(q=q)["w_sf"]
        write_owned_obsm(args.out_h5ad, quantiles, obs_names=model.adata.obs_names)
    report = {"rank": rank, "rss_before_export_mb": before, "export_peak_rss_mb": peak.peak_mb}
    report["export_s"] = time.perf_counter() - started
    report["spots"] = {name: int(np.shape(value)[0]) for name, value in quantiles.items()}
    Path(f"{args.out_h5ad}.rank{rank}.json").write_text(json.dumps(report))


def run(args: argparse.Namespace, devices: int, out: Path) -> list[dict[str, Any]]:
    command = [sys.executable, __file__, "--worker", "--data", args.data]
    command += ["--devices", str(devices), "--steps", str(args.steps)]
    command += ["--batch-size", str(args.batch_size), "--checkpoint", args.checkpoint]
    command += ["--out-h5ad", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE}", "PYTHONWARNINGS": "ignore"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise RuntimeError(f"W={devices} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(devices)]


def same_obsm(first: Path, second: Path) -> dict[str, bool]:
    """Whether each key of ``first``'s ``obsm`` equals ``second``'s bitwise."""
    import h5py

    with h5py.File(first, "r") as one, h5py.File(second, "r") as other:
        keys = sorted(one["obsm"])
        same = {
            key: bool(np.array_equal(one["obsm"][key][:], other["obsm"][key][:])) for key in keys
        }
        same["obs_names"] = bool(np.array_equal(one["obs"]["_index"][:], other["obs"]["_index"][:]))
    return same


def drive(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    args.checkpoint = str(workdir / "trained.ckpt")
    results: dict[str, Any] = {"data": args.data, "steps": args.steps}
    owners, restored = workdir / f"w{args.devices}.h5ad", workdir / "w1.h5ad"
    for path in (owners, restored):
        path.unlink(missing_ok=True)
    results[f"W={args.devices}"] = run(args, args.devices, owners)
    results["W=1 restored"] = run(args, 1, restored)
    results["equal"] = same_obsm(owners, restored)
    results["file_bytes"] = owners.stat().st_size
    target = Path(args.results) if args.results else HERE / "cell2location_export.json"
    target.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="an .h5ad bench_cell2location.py wrote")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=10_000, help="spots a step, all workers")
    parser.add_argument("--workdir", default="/tmp/export_cell2location")
    parser.add_argument("--results", help="where the driver writes its JSON")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--checkpoint")
    parser.add_argument("--out-h5ad")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
