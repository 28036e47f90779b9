"""A model that samples, trained, checkpointed every two steps and resumed, for the resume tests.

Every row of the data is the same, so which rows a batch holds does not
matter: what a resumed run draws from the RNG is all that can make it differ
from a straight one. (Lightning restarts a plain loader's epoch from its
first batch after a mid-epoch resume, with a warning that this script
silences; with identical rows that is harmless here.)

``--save-every 2`` writes ``step=<s>.ckpt`` every two steps (4 steps per
epoch at 2 workers); ``--resume FILE`` continues from one. Each worker saves
its parameters after step 8 (the straight run's last), its losses and its
final ``global_step`` to ``OUT/rank<r>.pt``. (Lightning before 2.5 trains one
step more after a resume, Lightning-AI/pytorch-lightning#19403: the parameters
are taken at step 8 so that the runs can still be compared.)
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule
from torch.utils.data import DataLoader, TensorDataset

from pyro_distributed.integrations.lightning import PyroDistributedStrategy

ROWS, BATCH = 64, 8
STEPS = 8  # the straight run's: 2 epochs of 4 steps at 2 workers


class Mean(PyroModule):
    def forward(self, y: torch.Tensor) -> None:
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("data", ROWS, subsample=torch.arange(len(y))):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


class Plan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        model = Mean()
        self.loss_fn = Trace_ELBO()(model, AutoNormal(model))
        self.losses: list[float] = []
        self.params_at_last_step: dict[str, torch.Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.loss_fn(batch[0])  # draws mu from the guide
        self.losses.append(float(loss))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == STEPS:
            self.params_at_last_step = {
                name: value.detach().clone() for name, value in self.loss_fn.named_parameters()
            }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.loss_fn.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", type=int, help="ModelCheckpoint(every_n_train_steps=)")
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*checkpoint that ended before the epoch ended")
    pyro.set_rng_seed(0)
    pyro.settings.set(module_local_params=True)
    plan = Plan()
    plan.loss_fn(torch.ones(2))  # AutoNormal creates its parameters here
    callbacks = []
    if args.save_every is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.checkpoint_dir,
                filename="{step}",
                every_n_train_steps=args.save_every,
                save_top_k=-1,
            )
        )
    trainer = pl.Trainer(
        callbacks=callbacks,
        accelerator="cpu",
        devices=args.devices,
        strategy=PyroDistributedStrategy(),
        max_epochs=args.epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=args.save_every is not None,
    )
    loader = DataLoader(TensorDataset(torch.full((ROWS,), 3.0)), batch_size=BATCH, shuffle=True)
    trainer.fit(plan, loader, ckpt_path=args.resume)
    record = {
        "global_step": trainer.global_step,
        "params": plan.params_at_last_step,
        "losses": plan.losses,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
