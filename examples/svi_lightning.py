"""Bayesian linear regression trained by PyTorch Lightning on several workers.

Pyro's Lightning example trains an ELBO module inside a LightningModule; this
is that model, made data-parallel by one argument to the Trainer:
``strategy=PyroDistributedStrategy(...)``. Lightning starts the workers
(``--devices 2`` here, or torchrun); gradients are averaged by this
library's optimizer, not by DDP, and each worker reads its own share of rows.

``--local`` adds a per-data-point latent offset ``z_i`` whose variational
parameters live only on the worker that owns row i
(``own_local_params=True``): each worker stores N/W of them. ``--sparse``
steps only the rows of each batch (``local_updates="sparse"``): O(batch) a
step instead of O(N/W).

    python examples/svi_lightning.py --devices 2
    python examples/svi_lightning.py --devices 2 --local
    python examples/svi_lightning.py --devices 2 --local --sparse
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import lightning.pytorch as pl
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule
from torch.utils.data import DataLoader, TensorDataset

import pyro_distributed as pd
from pyro_distributed.integrations.lightning import IndexedDataset, PyroDistributedStrategy

TRUE_W = (2.0, -1.0, 0.5)


class Regression(PyroModule):
    def __init__(self, size: int, local: bool) -> None:
        super().__init__()
        self.size, self.local = size, local

    def forward(self, indices: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        w = pyro.sample("w", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with pyro.plate("data", self.size, subsample=indices):
            mean = x @ w
            if self.local:  # one latent offset per row, its parameters owned by its worker
                mean = mean + pyro.sample("z", dist.Normal(0.0, 0.5))
            return pyro.sample("y", dist.Normal(mean, 0.3), obs=y)


class PyroLightningModule(pl.LightningModule):
    def __init__(self, loss_fn: Any, dataset: IndexedDataset, lr: float, local: bool) -> None:
        super().__init__()
        self.loss_fn, self.dataset, self.lr, self.local = loss_fn, dataset, lr, local

    def setup(self, stage: str) -> None:
        # AutoNormal creates its parameters at its first call. Make that call
        # here, once the workers have met, on rows of this worker's block:
        # with ownership, each worker then creates only its own rows of z's.
        first = next(iter(pd.ShardSampler(self.dataset, by_block=True, shuffle=False)))
        with pd.shard_subsamples(own_local_params=self.local, by_block=self.local):
            self.loss_fn(*self.dataset[torch.tensor([first])])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.loss_fn(*batch)
        self.log("elbo_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.loss_fn.parameters(), lr=self.lr)


def make_data(n: int, local: bool) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)  # the same data in every process
    x = torch.randn(n, 3, generator=generator)
    y = x @ torch.tensor(TRUE_W) + 0.3 * torch.randn(n, generator=generator)
    if local:
        y = y + 0.5 * torch.randn(n, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--size", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=100, help="rows per worker per step")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--local", action="store_true", help="add a per-row latent variable")
    parser.add_argument(
        "--sparse", action="store_true", help="with --local: step only each batch's rows"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    pyro.set_rng_seed(0)
    pyro.settings.set(module_local_params=True)
    dataset = IndexedDataset(make_data(args.size, args.local))
    model = Regression(args.size, args.local)
    guide = AutoNormal(
        model, create_plates=lambda idx, *_: pyro.plate("data", args.size, subsample=idx)
    )
    loss_fn = Trace_ELBO()(model, guide)
    module = PyroLightningModule(loss_fn, dataset, lr=0.05, local=args.local)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=PyroDistributedStrategy(
            own_local_params=args.local, local_updates="sparse" if args.sparse else "dense"
        ),
        max_epochs=args.epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=args.batch_size, shuffle=True))

    w = guide.locs.w.detach()
    if args.local:
        rows = len(guide.locs.z)
        # A sparse step hands the batch's rows out as a small tensor of their
        # own: the block's own .grad is never filled.
        dense_gradient = guide.locs.z_unconstrained.grad is not None
        stepped = "all its rows" if dense_gradient else "only each batch's rows"
        # One write per line: both workers print to the same terminal, and
        # print() writes a line's text and its newline separately.
        sys.stdout.write(
            f"worker {pd.rank()}: holds {rows} of {args.size} rows of z's parameters, "
            f"stepped {stepped}\n"
        )
    if trainer.is_global_zero:
        weights = ", ".join(f"{v:.3f}" for v in w.tolist())
        sys.stdout.write(f"trained on {trainer.world_size} worker(s)\nweights: [{weights}]\n")


if __name__ == "__main__":
    main()
