"""cell2location, W=1 against W=2 with owned spots (in memory, and read by rows) and replicated.

For each number of spots N the driver makes one synthetic Visium-HD-like
data set (``examples/cell2location_spatial.py``'s ``synthetic_visium_hd``:
sparse negative-binomial counts, 30 cell types, a few hundred counts a bin),
writes it as an ``.h5ad`` with CSR counts, and runs each configuration, a
fresh ``model.train()`` on CPU:

* ``W=1``: cell2location as shipped, one process, the AnnData in memory;
* ``W=2 owned``: ``PyroDistributedStrategy(own_local_params=True)``: each
  worker loads and steps its N/2 spots, but holds the whole AnnData, as
  every worker that runs the user's script with ``anndata.read_h5ad`` does;
* ``W=2 owned, by rows``: the same, the AnnData opened with
  ``read_h5ad_by_rows``: each worker reads its own spots' counts only;
* ``W=2 replicated``: ``PyroDistributedStrategy()``: every worker steps
  every spot's parameters, each on half the data (for reference);
* ``W=2 owned, by rows, global batch`` (with ``--batch-size B``): each
  worker takes B/2 of its spots a step, so that a step covers B spots, as at
  W=1 (Lightning's batch size is per worker: the other configurations take B
  each, 2B a step).

Each worker reports its peak resident memory (``ru_maxrss``), its resident
memory just before ``model.train()`` (the interpreter, the libraries, the
AnnData and the model) and the wall time of each epoch; the table gives the
largest worker's memory and the median epoch after the first (the slowest
worker's). ``--batch-size`` trains in mini-batches instead of full batch.
Run::

    python benchmarks/bench_cell2location.py --spots 10000 100000
    python benchmarks/bench_cell2location.py --spots 300000 --genes 2000 --batch-size 10000

and it prints the table and writes ``benchmarks/cell2location.json``
(``--results`` elsewhere; ``--merge A.json B.json`` joins several runs, into
``--results`` if given).
``--steps N`` stops each run after N steps and reports the median step after
the first two (the slowest worker's) and the epoch that makes, the step
times the steps an epoch; ``--local-updates sparse`` steps only a batch's
rows of the owned spots' parameters; ``W=4 owned, by rows, global batch``
runs four workers. ``--types`` and ``--umis-per-bin`` shape the data (the
large runs: 50 types and 523 counts a bin, the mean of a Visium HD 8 um
bin); the generator streams it to the file, and says what it took.
``--address-space-mb MB`` caps each worker's address space, so that an
allocation larger than the machine raises an error that names its size
and where it was made (the report keeps both) instead of the kernel's OOM
killer ending the process.
``--memory-cap MB`` runs every worker under a memory cgroup of that size
(``benchmarks/memory_cap.py``, root only): a worker that outgrows it is
killed, and the table says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
# name: (workers, the strategy's mode, how each worker opens the .h5ad)
CONFIGS = {
    "W=1": (1, "single", "memory"),
    "W=2 owned": (2, "owned", "memory"),
    "W=2 owned, by rows": (2, "owned", "by-rows"),
    "W=2 owned, by rows, global batch": (2, "owned", "by-rows"),
    "W=2 replicated": (2, "replicated", "memory"),
    "W=4 owned, by rows, global batch": (4, "owned", "by-rows"),
}
#: Configurations whose workers each take --batch-size / W spots a step, so
#: that a step covers as many spots as W=1's (the others take --batch-size
#: each, as Lightning's batch size is per worker).
GLOBAL_BATCH = {"W=2 owned, by rows, global batch", "W=4 owned, by rows, global batch"}
#: Steps at the start of a ``--steps`` run left out of its step time: the
#: first builds the guide's parameters, the second still warms the allocator.
WARMUP_STEPS = 2


def load_example() -> Any:
    """``examples/cell2location_spatial.py`` as a module (its data generators)."""
    spec = importlib.util.spec_from_file_location(
        "example", HERE.parent / "examples" / "cell2location_spatial.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def relative(a: np.ndarray, b: np.ndarray) -> float:
    """Root-mean-square difference, relative to the reference ``b``'s root mean square."""
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: argparse.Namespace) -> None:
    """One configuration; every worker writes ``OUT.rank<r>.json``."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for the others
    group = None
    if args.memory_cap:
        from memory_cap import cap_this_process

        group = cap_this_process(args.memory_cap, f"{os.getpid()}-rank{rank}")
    import lightning.pytorch as pl
    import scvi
    import torch

    from pyro_distributed.integrations.lightning import PyroDistributedStrategy
    from pyro_distributed.integrations.scvi import owned_posterior

    torch.set_num_threads(args.threads)
    scvi.settings.seed = args.seed
    adata, model = model_from_h5ad(args.data, by_rows=args.read == "by-rows")
    epochs: list[float] = []
    steps: list[float] = []

    class Clock(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.started = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            epochs.append(time.perf_counter() - self.started)

        def on_train_batch_start(self, trainer: Any, module: Any, *_: Any) -> None:
            self.step_started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, *_: Any) -> None:
            steps.append(time.perf_counter() - self.step_started)

    options: dict[str, Any] = {}
    if args.devices > 1:
        options["strategy"] = PyroDistributedStrategy(
            own_local_params=args.mode == "owned",
            **({"local_updates": args.local_updates} if args.mode == "owned" else {}),
        )
    if args.steps:
        options["max_steps"] = args.steps
    if hasattr(adata.X, "reset_counts"):
        adata.X.reset_counts()
    before = rss_mb()
    report: dict[str, Any] = {"rank": rank, "rss_before_train_mb": before}
    if args.address_space_mb:  # an allocation past it raises, rather than the OOM killer
        limit = args.address_space_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        model.train(
            max_epochs=args.epochs,
            batch_size=args.batch_size,
            accelerator="cpu",
            device=args.devices,
            callbacks=[Clock()],
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            **options,
        )
    except (MemoryError, RuntimeError) as error:  # what the failing allocation asked for
        report["failed"] = f"{type(error).__name__}: {error}"[:500]
        report["where"] = [f"{f.filename}:{f.lineno} {f.name}" for f in _frames(error)][-6:]
        report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report))
        return
    rank = model.trainer.global_rank
    report["rank"] = rank
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report["epochs_s"], report["steps_s"] = epochs, steps
    if group is not None:
        from memory_cap import peak_megabytes

        report["charged_peak_mb"] = peak_megabytes(group)
    if hasattr(adata.X, "rows_read"):
        report["rows_read"], report["row_span"] = adata.X.rows_read, adata.X.row_span
    if args.abundance:  # the cell abundances (median), every spot's on worker 0
        if args.mode == "owned":
            with owned_posterior(model):
                model.export_posterior(adata, use_quantiles=True, add_to_obsm=["q50"])
        else:
            model.export_posterior(adata, use_quantiles=True, add_to_obsm=["q50"])
        if rank == 0:
            np.save(f"{args.out}.abundance.npy", adata.obsm["q50_cell_abundance_w_sf"].to_numpy())
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report))


def _frames(error: BaseException) -> list[Any]:
    import traceback

    return list(traceback.extract_tb(error.__traceback__))


def model_from_h5ad(path: str | Path, *, by_rows: bool) -> tuple[Any, Any]:
    """The AnnData of ``path`` (read whole, or by rows) and cell2location's
    model of it, with the signatures that ``write_data`` saved."""
    from cell2location.models import Cell2location

    adata, signatures = load_example().read_h5ad(path, by_rows=by_rows)
    Cell2location.setup_anndata(adata, batch_key="sample")
    model = Cell2location(
        adata, cell_state_df=signatures, N_cells_per_location=8, detection_alpha=20
    )
    return adata, model


def data_path(args: argparse.Namespace, spots: int) -> Path:
    """Where the data set of ``spots`` spots is made once and reused."""
    name = f"data{spots}x{args.genes}"
    if args.types != 30 or args.umis_per_bin:
        name += f"x{args.types}_{args.umis_per_bin or 'default'}umi"
    return Path(args.workdir) / f"{name}.h5ad"


def write_data(path: Path, args: argparse.Namespace, spots: int) -> dict[str, float]:
    """The data set as an ``.h5ad``: CSR counts, the signatures in ``varm``,
    streamed to the file a block of spots at a time (``write_visium_hd``).
    What it took (seconds, bytes, stored counts, peak RSS) goes beside it
    in ``PATH.json``."""
    partial = path.with_suffix(".part")
    # Blocks interleave the draws, so the block size is part of the data:
    # 20,000 bins made the default data sets, 10,000 those of a given density.
    made = load_example().write_visium_hd(
        partial,
        spots,
        args.genes,
        args.types,
        seed=0,
        block=10_000 if args.umis_per_bin else 20_000,
        umis_per_bin=args.umis_per_bin,
    )
    partial.replace(path)
    made["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    path.with_suffix(".json").write_text(json.dumps(made))
    print(f"wrote {path}: {made}", flush=True)
    return made


def run(
    args: argparse.Namespace, data: Path, out: Path, config: str, seed: int = 0
) -> list[dict[str, Any]] | None:
    """One configuration; every worker's report, or ``None`` if a worker was
    killed (by the memory cap's OOM killer)."""
    devices, mode, read = CONFIGS[config]
    command = [sys.executable, __file__, "--worker", "--data", str(data), "--out", str(out)]
    command += ["--devices", str(devices), "--mode", mode, "--read", read]
    command += ["--epochs", str(args.epochs), "--threads", str(args.threads), "--seed", str(seed)]
    command += ["--local-updates", args.local_updates]
    command += ["--steps", str(args.steps)] if args.steps else []
    if args.address_space_mb:
        command += ["--address-space-mb", str(args.address_space_mb)]
    if args.batch_size:
        per_worker = args.batch_size // devices if config in GLOBAL_BATCH else args.batch_size
        command += ["--batch-size", str(per_worker)]
    command += ["--memory-cap", str(args.memory_cap)] if args.memory_cap else []
    command += ["--abundance"] if args.abundance else []
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE}", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if args.memory_cap:
        from memory_cap import remove_caps

        remove_caps()
    paths = [Path(f"{out}.rank{r}.json") for r in range(devices)]
    if done.returncode != 0 or not all(path.exists() for path in paths):
        if not args.memory_cap:
            raise RuntimeError(f"{config} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return None
    return [json.loads(path.read_text()) for path in paths]


def drive(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for spots in args.spots:
        data = data_path(args, spots)
        if not data.exists():
            write_data(data, args, spots)
        for config in args.configs:
            size = f"{spots}x{args.genes}"
            out = workdir / f"{size}_{config.replace(' ', '_').replace(',', '')}"
            reports = run(args, data, out, config)
            summary = _summary(reports, args, spots, config) if reports else {"killed": True}
            summary["data"] = (
                json.loads(data.with_suffix(".json").read_text())
                if (data.with_suffix(".json").exists())
                else None
            )
            results[result_key(spots, args, config)] = summary
            print(size, config, summary, flush=True)
    target = Path(args.results) if args.results else HERE / "cell2location.json"
    target.write_text(json.dumps(results, indent=1))
    print(table(results))


def merge(paths: list[str], target: str | None) -> None:
    """Join the results of several runs (``--results``) into one table, written
    to ``target`` (``benchmarks/cell2location.json`` by default)."""
    results: dict[str, Any] = {}
    for path in paths:
        results.update(json.loads(Path(path).read_text()))
    (Path(target) if target else HERE / "cell2location.json").write_text(
        json.dumps(results, indent=1)
    )
    print(table(results))


def _summary(
    reports: list[dict[str, Any]], args: argparse.Namespace, spots: int, config: str
) -> dict[str, Any]:
    """The largest worker's memory; the slowest worker's median epoch after
    the first, or with ``--steps`` its median step after ``WARMUP_STEPS``
    and the epoch that makes: steps an epoch x the step, where a worker
    takes ceil(its spots / its batch) steps an epoch."""
    summary: dict[str, Any] = {
        "rows_read": [r.get("rows_read") for r in reports],
        "peak_rss_mb": [r["peak_rss_mb"] for r in reports],
        "rss_before_train_mb": [r["rss_before_train_mb"] for r in reports],
        "local_updates": args.local_updates,
    }
    failed = [r for r in reports if "failed" in r]
    if failed:
        summary["failed"], summary["where"] = failed[0]["failed"], failed[0]["where"]
        return summary
    if args.steps:
        workers = CONFIGS[config][0]
        batch = args.batch_size or 0
        batch = batch // workers if config in GLOBAL_BATCH else batch
        batch = batch or math.ceil(spots / workers)  # full batch: one step an epoch
        per_step = [
            max(r["steps_s"][s] for r in reports) for s in range(len(reports[0]["steps_s"]))
        ]
        summary["step_s"] = statistics.median(per_step[WARMUP_STEPS:])
        summary["steps_per_epoch"] = math.ceil(math.ceil(spots / workers) / batch)
        summary["epoch_s"] = summary["step_s"] * summary["steps_per_epoch"]
        summary["first_step_s"] = per_step[0]
    else:
        summary["epoch_s"] = statistics.median(
            max(r["epochs_s"][e] for r in reports) for e in range(1, len(reports[0]["epochs_s"]))
        )
    return summary


def table(results: dict[str, Any]) -> str:
    """The Markdown table of ``results``, each row against W=1 at the same
    size and batch (none where that W=1 failed or was killed)."""
    lines = [
        "| spots x genes | batch | local updates | configuration | peak RSS per worker (MB) "
        "| x W=1 | RSS before train (MB) | training's own (MB) | x W=1 | time per step (s) "
        "| time per epoch (s) | x W=1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in results.items():
        size, batch, updates, name = _key_parts(key)
        spots, genes = (int(n) for n in size.split("x"))
        head = f"| {spots:,} x {genes:,} | {batch} | {updates} | {name} |"
        if row.get("killed"):
            lines.append(f"{head} killed at the cap | | | | | | | |")
            continue
        if row.get("failed"):
            lines.append(
                f"{head} {_largest(row['peak_rss_mb']):.0f} | | | | | failed: "
                f"{row['failed'][:160]} | | |"
            )
            continue
        base = _reference(results, size, batch)
        peak, before = _largest(row["peak_rss_mb"]), _largest(row["rss_before_train_mb"])
        own = peak - before
        step = f"{row['step_s']:.2f}" if "step_s" in row else ""
        if base is None:
            lines.append(
                f"{head} {peak:.0f} | | {before:.0f} | {own:.0f} | | {step} | "
                f"{row['epoch_s']:.1f} | |"
            )
            continue
        base_peak = _largest(base["peak_rss_mb"])
        base_own = base_peak - _largest(base["rss_before_train_mb"])
        lines.append(
            f"{head} {peak:.0f} | {peak / base_peak:.2f} | {before:.0f} | {own:.0f} | "
            f"{own / base_own:.2f} | {step} | {row['epoch_s']:.1f} | "
            f"{row['epoch_s'] / base['epoch_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def result_key(spots: int, args: argparse.Namespace, config: str) -> str:
    return f"{spots}x{args.genes}|{args.batch_size or 'full'}|{args.local_updates}|{config}"


def _key_parts(key: str) -> tuple[str, str, str, str]:
    if "|" in key:
        size, batch, updates, name = key.split("|")
        return size, batch, updates, name
    size, name = key.split(" ", 1)  # results written before batch and updates were keys
    return size, "", "dense", name


def _reference(results: dict[str, Any], size: str, batch: str) -> dict[str, Any] | None:
    for key, row in results.items():
        k_size, k_batch, _, name = _key_parts(key)
        usable = not (row.get("failed") or row.get("killed"))
        if (k_size, k_batch, name) == (size, batch, "W=1") and usable:
            return row
    return None


def _largest(value: Any) -> float:
    """A worker's figure: the largest of a list, or the one figure older results hold."""
    return float(max(value)) if isinstance(value, list) else float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spots", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--genes", type=int, default=300)
    parser.add_argument("--types", type=int, default=30)
    parser.add_argument(
        "--umis-per-bin",
        type=float,
        default=None,
        help="expected counts a bin (default: a few hundred)",
    )
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--local-updates", choices=["dense", "sparse"], default="dense")
    parser.add_argument(
        "--address-space-mb", type=int, default=None, help="cap each worker's address space"
    )
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
    parser.add_argument("--read", choices=["memory", "by-rows"], default="memory")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=None, help="default: full batch")
    parser.add_argument("--memory-cap", type=int, default=None, help="MB per worker (root)")
    parser.add_argument("--abundance", action="store_true", help="export the abundances too")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.results)
    elif args.worker:
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
