"""A LightningModule with a real BatchNorm1d trained by the strategy, for the buffer tests.

Run as ``python fit_batchnorm.py --out DIR --devices W``: Lightning's launcher
starts the other workers by re-running it. Every worker saves its module's
buffers and parameters to ``DIR/rank<r>.pt``. ``--sync-batchnorm`` asks the
Trainer for ``sync_batchnorm=True``; the error, if any, is saved instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_distributed as pd
from pyro_distributed.integrations.lightning import PyroDistributedStrategy


class WithBatchNorm(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--sync-batchnorm", action="store_true")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 3, generator=generator) * 2.0 + 1.0
    data = TensorDataset(x, x.sum(-1))
    torch.manual_seed(0)
    module = WithBatchNorm()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=PyroDistributedStrategy(),
        sync_batchnorm=args.sync_batchnorm,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        trainer.fit(module, DataLoader(data, batch_size=8))
    except pd.PyroDistributedError as error:
        torch.save({"error": str(error)}, args.out / f"rank{trainer.global_rank}.pt")
        return
    record = {
        "buffers": {name: b.clone() for name, b in module.named_buffers()},
        "params": {name: p.detach().clone() for name, p in module.named_parameters()},
    }
    torch.save(record, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
