"""Train a real scvi-tools or cell2location model with its own ``model.train(...)``.

Run as a user would: ``python train_scvi.py --model lda --devices 2 --out DIR``.
With ``--devices 2`` Lightning's launcher starts the second worker by
running this script again; both build the same data and model (seeded) and
call ``model.train(..., accelerator="cpu", device=2,
strategy="pyro_distributed")``, nothing else. Each worker saves what it ended
with to ``DIR/rank<r>.pt``: every Pyro parameter, the rows it trained on in
each epoch (positions in the training set), the module's floating-point
buffers, the full-data loss and, for ``AmortizedLDA``, every cell's topic
proportions from ``model.get_latent_representation()``.

``--h5ad FILE`` reads the data set from ``FILE`` instead, through
``read_h5ad_by_rows``: each worker reads the rows it trains on only, and
records how many it read.

``--hidden-svi`` trains with a plan whose SVI the strategy cannot find (it
keeps it in a list and steps it itself): the run must stop with
``PyroDistributedError``, not end with workers that differ.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyro
import torch

SEED = 0


def synthetic(seed: int, n_obs: int, n_vars: int, n_labels: int) -> Any:
    """Counts with a few cell types, as cell2location's own tests make them."""
    import anndata
    import pandas as pd

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_labels, n_obs)
    profiles = rng.gamma(2.0, 1.0, (n_labels, n_vars))
    counts = rng.poisson(profiles[labels] * 3.0).astype(np.float32)
    adata = anndata.AnnData(counts)
    adata.obs_names = [f"cell{i}" for i in range(n_obs)]
    adata.var_names = [f"gene{j}" for j in range(n_vars)]
    adata.obs["labels"] = pd.Categorical([f"type{k}" for k in labels])
    adata.obs["batch"] = pd.Categorical(["batch0"] * n_obs)
    return adata


class RowsSeen(pl.Callback):
    """The positions in the training set that this worker's loader gives it, by epoch."""

    def __init__(self) -> None:
        self.epochs: list[list[int]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        self.epochs.append([int(row) for batch in loader.sampler for row in batch])


def hide_the_svi(plan_cls: Any) -> Any:
    """A plan that keeps a second SVI, with its own Pyro optimizer, where the
    strategy does not look (in a list), and steps that one."""
    from pyro.infer import SVI

    class HiddenSVIPlan(plan_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            optim = pyro.optim.Adam({"lr": 1e-2})
            self.hidden = [SVI(self.svi.model, self.svi.guide, optim, self.loss_fn)]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            args, kwargs = self.module._get_fn_args_from_batch(batch)
            loss = torch.tensor([self.hidden[0].step(*args, **kwargs)])
            self.optimizers().step()
            return {"loss": loss}

    return HiddenSVIPlan


def full_data_loss(model: Any) -> float:
    """The ELBO loss of the trained model and guide on every training row (20
    particles, seeded): the plates are sized for the training set."""
    from scvi.dataloaders import AnnDataLoader

    rows = model.train_indices
    loader = AnnDataLoader(model.adata_manager, indices=rows, shuffle=False, batch_size=len(rows))
    batch = next(iter(loader))
    args, kwargs = model.module._get_fn_args_from_batch(batch)
    # In training mode, BatchNorm layers (AmortizedLDA's encoder) normalise by
    # this batch's statistics, so the loss depends on the parameters alone, not
    # on running statistics, which each worker gathers from its own batches.
    model.module.train()
    pyro.set_rng_seed(1234)
    elbo = pyro.infer.Trace_ELBO(num_particles=20, vectorize_particles=False)
    with torch.no_grad():
        return float(elbo.loss(model.module.model, model.module.guide, *args, **kwargs))


def train(args: argparse.Namespace) -> dict[str, Any]:
    import scvi

    from pyro_distributed.integrations.lightning import PyroDistributedStrategy

    scvi.settings.seed = args.seed
    pyro.clear_param_store()
    adata = load(args)
    rows = RowsSeen()
    strategy: Any = "pyro_distributed" if args.devices > 1 else "auto"
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "device": args.devices,
        "strategy": strategy,
        "callbacks": [rows],
        "enable_progress_bar": False,
        "logger": False,
    }
    if args.devices > 1 and args.engine != "auto":
        common["strategy"] = PyroDistributedStrategy(engine=args.engine)
    if args.distributed_sampler:
        common["datasplitter_kwargs"] = {"distributed_sampler": True}
    if args.model == "lda":
        from scvi.model import AmortizedLDA

        AmortizedLDA.setup_anndata(adata)
        model = AmortizedLDA(adata, n_topics=4, n_hidden=16)
        if args.hidden_svi:
            model._training_plan_cls = hide_the_svi(model._training_plan_cls)
        start_counting(adata)
        model.train(max_epochs=args.epochs, batch_size=args.batch_size, lr=1e-2, **common)
    elif args.model == "regression":
        from cell2location.models import RegressionModel

        RegressionModel.setup_anndata(adata, labels_key="labels", batch_key="batch")
        model = RegressionModel(adata)
        start_counting(adata)
        model.train(max_epochs=args.epochs, batch_size=args.batch_size, lr=1e-2, **common)
    else:
        from cell2location.models import Cell2location, RegressionModel

        RegressionModel.setup_anndata(adata, labels_key="labels", batch_key="batch")
        signatures = np.random.default_rng(SEED).gamma(2.0, 1.0, (args.genes, 5))
        import pandas as pd

        cell_state = pd.DataFrame(
            signatures, index=adata.var_names, columns=[f"type{k}" for k in range(5)]
        )
        Cell2location.setup_anndata(adata, batch_key="batch")
        model = Cell2location(adata, cell_state_df=cell_state, N_cells_per_location=5)
        batch_size = None if args.batch_size == 0 else args.batch_size
        start_counting(adata)
        model.train(max_epochs=args.epochs, batch_size=batch_size, lr=1e-2, **common)
    trainer = model.trainer
    reads = None
    if hasattr(adata.X, "rows_read"):  # read by rows: what this worker read while training
        reads = {"rows": adata.X.rows_read, "span": adata.X.row_span}
    store = pyro.get_param_store()
    # The module's floating-point buffers (AmortizedLDA's encoder BatchNorm
    # statistics), which the strategy averages after every step.
    buffers = {
        f"buffer:{name}": value.detach().clone()
        for name, value in model.module.named_buffers()
        if value.is_floating_point()
    }
    latent = model.get_latent_representation() if args.model == "lda" else None
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "params": {name: store.get_state()["params"][name].detach().clone() for name in store},
        "buffers": buffers,
        "latent": None if latent is None else torch.as_tensor(np.asarray(latent)),
        "obs_names": list(adata.obs_names),
        "latent_index": None if latent is None else list(latent.index),
        "rows": rows.epochs,
        "n_train": len(model.train_indices),
        "loss": full_data_loss(model),
        "reads": reads,
    }


def load(args: argparse.Namespace) -> Any:
    """The synthetic data set, made here or read by rows from ``--h5ad``."""
    if args.h5ad is None:
        return synthetic(SEED, args.cells, args.genes, 5)
    from pyro_distributed.integrations.scvi import read_h5ad_by_rows

    return read_h5ad_by_rows(args.h5ad)


def start_counting(adata: Any) -> None:
    """Count the reads of training only (set-up peeks at the first rows)."""
    if hasattr(adata.X, "reset_counts"):
        adata.X.reset_counts()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["lda", "regression", "cell2location"], default="lda")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cells", type=int, default=400)
    parser.add_argument("--genes", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64, help="0: full batch (cell2location)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--distributed-sampler", action="store_true")
    parser.add_argument("--hidden-svi", action="store_true")
    parser.add_argument("--h5ad", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    record = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out / f"rank{record['rank']}.pt")
    if os.environ.get("PD_VERBOSE"):
        print(record["rank"], record["loss"], flush=True)


if __name__ == "__main__":
    main()
