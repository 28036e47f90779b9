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

    python benchmarks/profile_cell2location.py --spots 100000 --genes 300 [--ops]

and it prints one table, each part at W=1 and per worker at W=2 with owned
spots read by rows, and the ratio (0.50 is a part that halves with the
spots). ``--ops`` also records the second step of each worker with torch's
profiler (``profile_memory``, by op and input shapes, the spots' count
written ``N``) and prints the ops whose bytes allocated do not halve: twice
a W=2 worker's against W=1's, largest first. It needs three epochs.
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


def _allocations(profiler: Any, spots: int) -> dict[str, list[float]]:
    """Bytes allocated and calls, by op and input shapes (``spots`` written ``N``)."""
    table: dict[str, list[float]] = {}
    for event in profiler.key_averages(group_by_input_shape=True):
        if event.self_cpu_memory_usage <= 0:
            continue
        shapes = str(event.input_shapes).replace(str(spots), "N")
        entry = table.setdefault(f"{event.key} {shapes}", [0.0, 0])
        entry[0] += event.self_cpu_memory_usage
        entry[1] += event.count
    return table


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import pyro
    import scvi
    import torch

    from pyro_distributed.integrations.lightning import PyroDistributedStrategy

    torch.set_num_threads(1)
    scvi.settings.seed = 0
    adata, model = model_from_h5ad(args.data, by_rows=args.devices > 1)
    spots = adata.n_obs // args.devices  # this worker's (an even count of spots)
    report: dict[str, Any] = {}

    class Stages(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            report["training starts"] = rss_mb()
            copied = getattr(trainer.train_dataloader.dataset, "data", {})  # device-backed
            report["data tensors"] = _tensor_mb(copied)

        def on_train_batch_start(self, trainer: Any, module: Any, *rest: Any) -> None:
            if args.ops and "after the first step" in report and "ops" not in report:
                self.profiler = torch.profiler.profile(profile_memory=True, record_shapes=True)
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer: Any, module: Any, *rest: Any) -> None:
            if "after the first step" in report:
                if args.ops and "ops" not in report:
                    self.profiler.__exit__(None, None, None)
                    report["ops"] = _allocations(self.profiler, spots)
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
        command += ["--ops"] if args.ops else []
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
    if args.ops:
        print("\n".join(ops_table(reports[1].pop("ops"), reports[2].pop("ops"))))
    print(json.dumps(reports, indent=1))


def ops_table(one: dict[str, list[float]], two: dict[str, list[float]]) -> list[str]:
    """The ops of a step whose allocations do not halve at W=2: twice a W=2
    worker's bytes against W=1's, by op and shapes, the ten largest."""
    rows = []
    for key in one.keys() | two.keys():
        (bytes_one, calls_one), (bytes_two, calls_two) = one.get(key, [0, 0]), two.get(key, [0, 0])
        rows.append((2 * bytes_two - bytes_one, key, bytes_one, calls_one, bytes_two, calls_two))
    rows.sort(reverse=True)
    lines = [
        "",
        "| op and input shapes (N: the worker's spots) | W=1 MB (calls) "
        "| W=2 per worker MB (calls) | 2 x W=2 - W=1 (MB) |",
        "|---|---|---|---|",
    ]
    for extra, key, bytes_one, calls_one, bytes_two, calls_two in rows[:10]:
        lines.append(
            f"| `{key}` | {bytes_one / 2**20:.1f} ({calls_one:.0f}) "
            f"| {bytes_two / 2**20:.1f} ({calls_two:.0f}) | {extra / 2**20:.1f} |"
        )
    return lines


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
    parser.add_argument("--ops", action="store_true", help="allocations by op (module docstring)")
    drive_or_work = parser.parse_args(namespace=argparse.Namespace(umis_per_bin=None))
    (worker if drive_or_work.worker else drive)(drive_or_work)


if __name__ == "__main__":
    main()
