"""cell2location on synthetic Visium-like data, each worker owning its block of spots.

cell2location keeps variational parameters per spot (cell abundances ``w_sf``
and a few more). With ``PyroDistributedStrategy(own_local_params=True)``
each of W workers loads its N/W spots only, keeps their parameters only, and
averages the per-gene parameters' gradients with the others; cell2location's
own ``model.train()`` and ``export_posterior`` are used unchanged.

Run it as a plain script: it trains at W=1 with two seeds (the noise between
two equally good answers), at W=2 with owned spots, compares the cell
abundances, and draws ``docs/cell2location_w1_vs_w2.png``::

    python examples/cell2location_spatial.py --spots 2000 --epochs 400

``--run`` trains one configuration (Lightning's launcher re-runs the script
once per extra worker) and writes its abundances to ``--out``.
``--write-h5ad FILE`` writes the data set to an ``.h5ad`` (CSR counts); with
``--h5ad FILE`` a run reads it back through ``read_h5ad_by_rows``, each
worker reading its own spots' counts only (``--in-memory``: all of it).
With ``--results FILE`` the owners write the abundances into ``FILE`` (an
``.h5ad``) block by block instead of joining them for ``export_posterior``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def synthetic_visium(
    n_spots: int, n_genes: int, n_types: int, seed: int = 0
) -> tuple[Any, Any, np.ndarray]:
    """Counts of ``n_spots`` spots on a grid, each a mix of a few cell types whose
    abundances vary smoothly in space, with per-type signatures of ``n_genes``.

    Returns ``(adata, signatures, true_abundance)``: the AnnData (counts in
    ``X``, one sample ``"s1"`` in ``obs["sample"]``), the signatures (genes x
    types, a DataFrame as cell2location takes them) and the true abundance of
    each type in each spot.
    """
    import anndata
    import pandas

    rng = np.random.default_rng(seed)
    side = int(np.ceil(np.sqrt(n_spots)))
    grid = np.stack(np.divmod(np.arange(n_spots), side), axis=1) / side
    # Each type lives around a few centres; a spot holds the nearby types.
    centres = rng.uniform(size=(n_types, 3, 2))
    distance = np.linalg.norm(grid[:, None, None, :] - centres[None], axis=-1).min(axis=2)
    density = np.exp(-((distance / 0.15) ** 2)) * rng.gamma(2.0, 1.5, size=(1, n_types))
    abundance = density * (rng.uniform(size=density.shape) < 0.8)
    signatures = _signatures(rng, n_genes, n_types)
    detection = rng.gamma(20.0, 0.05 / 20.0, size=(n_spots, 1))  # ~5% of molecules seen
    gene_scale = rng.gamma(5.0, 0.2, size=(1, n_genes))
    mean = detection * gene_scale * (abundance @ signatures.T)
    counts = rng.poisson(rng.gamma(20.0, mean / 20.0 + 1e-12)).astype(np.float32)
    genes = [f"gene{g}" for g in range(n_genes)]
    adata = anndata.AnnData(
        X=counts,
        obs=pandas.DataFrame({"sample": "s1"}, index=[f"spot{s}" for s in range(n_spots)]),
        var=pandas.DataFrame(index=genes),
    )
    adata.obsm["spatial"] = grid
    frame = pandas.DataFrame(signatures, index=genes, columns=[f"type{f}" for f in range(n_types)])
    return adata, frame, abundance


def _signatures(rng: np.random.Generator, n_genes: int, n_types: int) -> np.ndarray:
    """Each type's expression: a background plus markers, about 1,500 counts per cell."""
    signatures = rng.gamma(0.3, 1.0, size=(n_genes, n_types))
    markers = rng.integers(0, n_genes, size=(n_types, max(n_genes // n_types, 3)))
    for cell_type, genes in enumerate(markers):
        signatures[genes, cell_type] += rng.gamma(3.0, 3.0, size=len(genes))
    return signatures * (1500.0 / signatures.sum(axis=0, keepdims=True))


def synthetic_visium_hd(
    n_spots: int,
    n_genes: int,
    n_types: int,
    seed: int = 0,
    block: int = 20_000,
    umis_per_bin: float | None = None,
) -> tuple[Any, Any]:
    """Sparse counts at Visium HD's sizes, in memory: the blocks of
    :func:`visium_hd_blocks` stacked into one AnnData. Returns ``(adata,
    signatures)``, the counts CSR float32. :func:`write_visium_hd` writes
    the same counts to a file without ever holding them all.
    """
    import anndata
    import scipy.sparse

    signatures, blocks = visium_hd_blocks(n_spots, n_genes, n_types, seed, block, umis_per_bin)
    adata = anndata.AnnData(
        X=scipy.sparse.vstack(list(blocks), format="csr"),
        obs=_bins(n_spots),
        var=signatures.iloc[:, :0],
    )
    return adata, signatures


def visium_hd_blocks(
    n_spots: int,
    n_genes: int,
    n_types: int,
    seed: int = 0,
    block: int = 20_000,
    umis_per_bin: float | None = None,
) -> tuple[Any, Iterator[Any]]:
    """The signatures and the counts, ``block`` spots at a time.

    The generative story of :func:`synthetic_visium` (types around centres in
    space, signatures with markers, gamma-Poisson, that is negative-binomial,
    counts), drawn block by block so that no dense spots x genes array is
    ever made: at most ``block`` x ``n_genes``. Bins are smaller than spots:
    about one to three cells each. By default a bin holds a few hundred
    counts; ``umis_per_bin`` sets each bin's expected total instead (before
    the per-bin detection noise), for a density taken from a real platform.
    Returns ``(signatures, blocks)``: a DataFrame (genes x types) and an
    iterator of CSR float32 blocks, in order.
    """
    import pandas
    import scipy.sparse

    rng = np.random.default_rng(seed)
    side = int(np.ceil(np.sqrt(n_spots)))
    centres = rng.uniform(size=(n_types, 3, 2))
    scale = rng.gamma(2.0, 0.3, size=(1, n_types))  # ~2 cells per bin in all
    signatures = _signatures(rng, n_genes, n_types)
    gene_scale = rng.gamma(5.0, 0.2, size=(1, n_genes))
    genes = [f"gene{g}" for g in range(n_genes)]
    frame = pandas.DataFrame(signatures, index=genes, columns=[f"type{f}" for f in range(n_types)])

    def blocks() -> Iterator[Any]:
        for start in range(0, n_spots, block):
            spots = np.arange(start, min(start + block, n_spots))
            grid = np.stack(np.divmod(spots, side), axis=1) / side
            distance = np.linalg.norm(grid[:, None, None, :] - centres[None], axis=-1).min(axis=2)
            density = np.exp(-((distance / 0.15) ** 2)) * scale
            abundance = density * (rng.uniform(size=density.shape) < 0.8)
            detection = rng.gamma(20.0, 0.1 / 20.0, size=(len(spots), 1))
            # Each branch multiplies in the order that made the data sets of
            # benchmarks/CELL2LOCATION.md, so that they come out bitwise again.
            if umis_per_bin is None:
                mean = (detection * gene_scale * (abundance @ signatures.T)).astype(np.float32)
            else:  # the same noise, around the expected total asked for
                expression = gene_scale * (abundance @ signatures.T)
                total = expression.sum(axis=1, keepdims=True)
                detection *= umis_per_bin / 0.1 / np.maximum(total, 1e-12)
                mean = (detection * expression).astype(np.float32)
            counts = rng.poisson(rng.gamma(20.0, mean / 20.0 + 1e-12)).astype(np.float32)
            yield scipy.sparse.csr_matrix(counts)

    return frame, blocks()


def write_visium_hd(
    path: str | Path,
    n_spots: int,
    n_genes: int,
    n_types: int,
    seed: int = 0,
    block: int = 20_000,
    umis_per_bin: float | None = None,
) -> dict[str, float]:
    """Write :func:`synthetic_visium_hd`'s data set to ``path``, an ``.h5ad``
    that :func:`read_h5ad` reads (CSR counts, the signatures in
    ``varm["signatures"]``), streaming: the counts go to the file block by
    block, and the most held at once is one block. Returns what it took:
    ``seconds``, ``bytes`` (the file) and ``nonzero`` (stored counts)."""
    import anndata
    import h5py

    started = time.perf_counter()
    signatures, blocks = visium_hd_blocks(n_spots, n_genes, n_types, seed, block, umis_per_bin)
    annotations = anndata.AnnData(
        obs=_bins(n_spots), var=signatures.iloc[:, :0], varm={"signatures": signatures.to_numpy()}
    )
    annotations.write_h5ad(path)  # obs, var, varm and the rest; X is added below
    nonzero = 0
    with h5py.File(path, "r+") as file:
        if "X" in file:
            del file["X"]
        for number, counts in enumerate(blocks):
            nonzero += counts.nnz
            if number == 0:
                anndata.io.write_elem(file, "X", counts)  # resizable: appended to
                matrix = anndata.io.sparse_dataset(file["X"])
            else:
                matrix.append(counts)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes": float(Path(path).stat().st_size), "nonzero": nonzero}


def _bins(n_spots: int) -> Any:
    import pandas

    return pandas.DataFrame({"sample": "s1"}, index=[f"bin{s}" for s in range(n_spots)])


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train one configuration; return what worker 0 reports."""
    import scvi
    import torch
    from cell2location.models import Cell2location

    from pyro_distributed.integrations.lightning import PyroDistributedStrategy
    from pyro_distributed.integrations.scvi import owned_posterior

    torch.set_num_threads(args.threads)
    scvi.settings.seed = args.seed
    adata, signatures = load(args)
    Cell2location.setup_anndata(adata, batch_key="sample")
    guide: dict[str, Any] = {}
    if args.guide != "AutoNormal":
        from pyro.infer import autoguide

        guide = {"create_autoguide_kwargs": {"guide_class": getattr(autoguide, args.guide)}}
    model = Cell2location(
        adata, cell_state_df=signatures, N_cells_per_location=8, detection_alpha=20, **guide
    )
    reads = {"setup": _reads(adata)}
    options: dict[str, Any] = {}
    if args.devices > 1 or args.mode != "single":
        owned = args.mode == "owned"
        options["strategy"] = PyroDistributedStrategy(
            own_local_params=owned,
            local_updates=args.local_updates if owned else "dense",
            seed=args.seed,
        )
    started = time.perf_counter()
    model.train(
        max_epochs=args.epochs,
        batch_size=args.batch_size,
        accelerator="cpu",
        device=args.devices,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        **options,
    )
    seconds = time.perf_counter() - started
    reads["train"] = _reads(adata)
    held = _spots_held(model)
    # cell2location's own batch size for its exports; None: one batch a worker
    batches = {"batch_size": args.export_batch} if args.export_batch else {}
    if args.mode == "owned" and args.results:  # summarised and written by the owners
        abundance = write_by_owners(model, args.results, **batches)
    elif args.mode == "owned":  # each worker summarises its own spots
        with owned_posterior(model):
            model.export_posterior(
                adata, use_quantiles=True, add_to_obsm=["q50"], sample_kwargs=batches
            )
        abundance = adata.obsm["q50_cell_abundance_w_sf"].to_numpy()
    else:
        model.export_posterior(adata, use_quantiles=True, add_to_obsm=["q50"])
        abundance = adata.obsm["q50_cell_abundance_w_sf"].to_numpy()
    reads["export"] = _reads(adata)
    return {"abundance": abundance, "seconds": seconds, "spots_held": held, "reads": reads}


def write_by_owners(model: Any, path: str, **quantile_kwargs: Any) -> np.ndarray:
    """The median abundances, each worker's spots summarised and written into
    ``path`` (an ``.h5ad``) by their owner, without joining them anywhere;
    read back whole (for the comparison only)."""
    import anndata

    from pyro_distributed.integrations.scvi import owned_posterior, write_owned_obsm

    with owned_posterior(model, to="owners"):
        # export_posterior's call; this worker's spots
        median = model.posterior_quantile(q=0.5, **quantile_kwargs)
    key = "q50_cell_abundance_w_sf"
    write_owned_obsm(path, {key: median["w_sf"]}, obs_names=model.adata.obs_names)
    return np.asarray(anndata.read_h5ad(path).obsm[key])


def write_h5ad(args: argparse.Namespace) -> None:
    """The synthetic data set as an ``.h5ad`` file (:func:`save_h5ad`)."""
    adata, signatures, _ = synthetic_visium(args.spots, args.genes, args.types, seed=args.data_seed)
    save_h5ad(adata, signatures, args.write_h5ad)


def save_h5ad(adata: Any, signatures: Any, path: str | Path) -> None:
    """``adata`` with CSR counts and the signatures in ``varm["signatures"]``
    (genes x types), as :func:`read_h5ad` reads them back."""
    import scipy.sparse

    adata.X = scipy.sparse.csr_matrix(adata.X)
    adata.varm["signatures"] = signatures.to_numpy()
    adata.write_h5ad(path)


def read_h5ad(path: str | Path, *, by_rows: bool) -> tuple[Any, Any]:
    """The AnnData and signatures of a file :func:`save_h5ad` wrote: read
    whole, or by rows (each worker reads its own spots' counts only)."""
    import pandas

    if by_rows:
        from pyro_distributed.integrations.scvi import read_h5ad_by_rows

        adata = read_h5ad_by_rows(path)
    else:
        import anndata

        adata = anndata.read_h5ad(path)
    table = np.asarray(adata.varm["signatures"])
    columns = [f"type{f}" for f in range(table.shape[1])]
    return adata, pandas.DataFrame(table, index=adata.var_names, columns=columns)


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The AnnData and signatures: made in memory, or read from ``--h5ad``."""
    if args.h5ad is None:
        adata, signatures, _ = synthetic_visium(
            args.spots, args.genes, args.types, seed=args.data_seed
        )
        return adata, signatures
    return read_h5ad(args.h5ad, by_rows=not args.in_memory)


def _reads(adata: Any) -> dict[str, Any] | None:
    """What this worker has read of the counts on disk since the last call."""
    counts = adata.X
    if not hasattr(counts, "rows_read"):
        return None
    reads = {"rows": counts.rows_read, "bytes": counts.bytes_read, "span": counts.row_span}
    reads["streamed"], reads["largest"] = counts.rows_streamed, counts.largest_read
    counts.reset_counts()
    return reads


def _spots_held(model: Any) -> int:
    """How many spots' abundance parameters this worker holds."""
    import pyro

    store = pyro.get_param_store()
    name = next(name for name in store if "w_sf" in name and "loc" in name)
    return int(store[name].shape[-2])


def run_one(args: argparse.Namespace) -> None:
    result = train(args)
    import torch.distributed

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    held = result["spots_held"]
    if rank == 0:
        np.savez(args.out, abundance=result["abundance"], seconds=result["seconds"], held=held)
    Path(f"{args.out}.held{rank}").write_text(str(held))
    Path(f"{args.out}.reads{rank}").write_text(json.dumps(result["reads"]))
    print(f"worker {rank}: holds {held} spots' parameters of {args.spots}", flush=True)


def compare(args: argparse.Namespace) -> dict[str, float]:
    """Train W=1 (two seeds) and W=2 (owned spots); compare and draw the figure."""
    out = Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    runs = {"w1_seed0": (1, 0), "w1_seed1": (1, 1), "w2_owned": (2, 0)}
    results = {}
    for name, (devices, seed) in runs.items():
        command = [
            sys.executable,
            __file__,
            "--run",
            "--devices",
            str(devices),
            "--seed",
            str(seed),
        ]
        command += [
            "--mode",
            "owned" if devices > 1 else "single",
            "--out",
            str(out / f"{name}.npz"),
        ]
        command += _shared(args)
        subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        results[name] = np.load(out / f"{name}.npz")
    reference = results["w1_seed0"]["abundance"]
    noise = _relative(results["w1_seed1"]["abundance"], reference)
    distributed = _relative(results["w2_owned"]["abundance"], reference)
    truth = synthetic_visium(args.spots, args.genes, args.types, seed=args.data_seed)[2]
    summary = {
        "seed_noise": noise,
        "w2_vs_w1": distributed,
        "correlation_w1_truth": float(np.corrcoef(reference.ravel(), truth.ravel())[0, 1]),
        "correlation_w2_w1": float(
            np.corrcoef(results["w2_owned"]["abundance"].ravel(), reference.ravel())[0, 1]
        ),
    }
    print(json.dumps(summary, indent=1))
    if args.figure:
        _figure(reference, results["w2_owned"]["abundance"], results["w1_seed1"]["abundance"], args)
    return summary


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """Root-mean-square difference relative to the reference's root mean square."""
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def _figure(w1: np.ndarray, w2: np.ndarray, w1_other: np.ndarray, args: argparse.Namespace) -> None:
    draw_against_w1(
        w1,
        [(w1_other, "W=1, another seed (the noise)"), (w2, "W=2, spots owned by their worker")],
        xlabel="cell abundance, W=1 (median)",
        title=f"cell2location, {args.spots} spots x {args.genes} genes x {args.types} types",
        target=HERE.parent / "docs" / "cell2location_w1_vs_w2.png",
    )


def draw_against_w1(
    w1: np.ndarray, others: list[tuple[np.ndarray, str]], *, xlabel: str, title: str, target: Path
) -> None:
    """One panel per ``(abundances, title)`` of ``others``, each against W=1's
    abundances ``w1`` with the diagonal, saved to ``target``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(others), figsize=(9, 4.2), sharex=True, sharey=True)
    for axis, (other, panel) in zip(axes, others, strict=True):
        axis.scatter(w1.ravel(), other.ravel(), s=2, alpha=0.3)
        top = float(max(w1.max(), other.max()))
        axis.plot([0, top], [0, top], color="black", linewidth=0.8)
        axis.set_title(panel, fontsize=10)
        axis.set_xlabel(xlabel)
    axes[0].set_ylabel("cell abundance (median)")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(target, dpi=110)
    print(f"wrote {target}")


def _shared(args: argparse.Namespace) -> list[str]:
    shared = ["--spots", str(args.spots), "--genes", str(args.genes), "--types", str(args.types)]
    shared += ["--epochs", str(args.epochs), "--data-seed", str(args.data_seed)]
    shared += ["--threads", str(args.threads)]
    return shared + (["--batch-size", str(args.batch_size)] if args.batch_size else [])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spots", type=int, default=2000)
    parser.add_argument("--genes", type=int, default=200)
    parser.add_argument("--types", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=None, help="default: full batch")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default="c2l_runs")
    parser.add_argument(
        "--figure", action="store_true", help="write docs/cell2location_w1_vs_w2.png"
    )
    parser.add_argument("--run", action="store_true", help="train one configuration")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=["single", "owned", "replicated"], default="single")
    parser.add_argument("--out", default="run.npz")
    parser.add_argument("--guide", default="AutoNormal", help="or AutoNormalMessenger, ...")
    parser.add_argument("--local-updates", choices=["dense", "sparse"], default="dense")
    parser.add_argument("--h5ad", default=None, help="train on this file, read by rows")
    parser.add_argument("--in-memory", action="store_true", help="read --h5ad whole instead")
    parser.add_argument("--write-h5ad", default=None, help="write the data set here and stop")
    parser.add_argument(
        "--results", default=None, help="owned: the owners write the abundances into this .h5ad"
    )
    parser.add_argument("--export-batch", type=int, default=None, help="spots a posterior batch")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    if arguments.write_h5ad:
        write_h5ad(arguments)
    elif arguments.run:
        run_one(arguments)
    else:
        compare(arguments)
