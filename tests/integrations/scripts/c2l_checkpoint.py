"""cell2location trained with owned spots, checkpointed through Lightning, resumed.

Run as a plain script (Lightning's launcher re-runs it for the second
worker). It trains ``examples/cell2location_spatial.py``'s model with
``PyroDistributedStrategy(own_local_params=True)``; ``--save-at E`` writes a
checkpoint at the end of epoch E (``trainer.save_checkpoint``, every worker),
``--ckpt-path`` resumes from one. Every worker then writes, to
``OUT/<tag>.rank<r>.pt``, every parameter's global row indices, values and
Pyro optimizer state (``--dump-at-save`` also at the save itself).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pyro
import scvi
import torch
from cell2location.models import Cell2location

import pyro_distributed as pd
from pyro_distributed.integrations.lightning import PyroDistributedStrategy

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location(
    "example", ROOT / "examples/cell2location_spatial.py"
)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def snapshot(plan: Any) -> dict[str, Any]:
    """Every parameter: the global indices of this worker's rows, their values,
    and the Pyro optimizer's state of it."""
    optim = plan.svi.optim
    # State handed back by a restore waits in the optimizer until each parameter's next step.
    waiting = getattr(getattr(optim, "wrapped", optim), "_state_waiting_to_be_consumed", {})
    optim_state = {**waiting, **optim.get_state()}
    taken = {}
    for name in pyro.get_param_store():
        indices, _ = pd.local_rows(name)
        # The unconstrained values are what is stored and restored: a constraint's
        # transform may round a row differently in a tensor of another length.
        unconstrained = pyro.get_param_store()[name].unconstrained()
        taken[name] = {
            "indices": indices,
            "value": unconstrained.detach().clone(),
            "optim": optim_state.get(name),
        }
    return taken


class SaveAt(pl.Callback):
    def __init__(self, epoch: int, directory: Path, dump: Path | None) -> None:
        self.epoch, self.directory, self.dump = epoch, directory, dump

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.directory / f"epoch{self.epoch}.ckpt")
            if self.dump is not None:
                torch.save(snapshot(module), f"{self.dump}.rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--spots", type=int, default=301)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    scvi.settings.seed = 0
    adata, signatures, _ = example.synthetic_visium(args.spots, 60, 6, seed=0)
    Cell2location.setup_anndata(adata, batch_key="sample")
    model = Cell2location(
        adata, cell_state_df=signatures, N_cells_per_location=8, detection_alpha=20
    )
    callbacks: list[Any] = []
    if args.save_at is not None:
        callbacks.append(SaveAt(args.save_at, out, out / f"{args.tag}-at-save"))
    model.train(
        max_epochs=args.epochs,
        batch_size=args.batch_size,
        accelerator="cpu",
        device=args.devices,
        strategy=PyroDistributedStrategy(own_local_params=True),
        callbacks=callbacks,
        ckpt_path=args.ckpt_path,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    rank = model.trainer.global_rank
    torch.save(snapshot(model.trainer.lightning_module), out / f"{args.tag}.rank{rank}.pt")


if __name__ == "__main__":
    main()
