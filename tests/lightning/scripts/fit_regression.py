"""Bayesian linear regression trained by a Lightning Trainer, for the strategy's tests.

Run as a plain script: Lightning's own launcher re-runs it once per extra
device, and torchrun runs it once per worker. Every worker writes what it
ends with to ``OUT/rank{r}.pt``; the tests compare the workers and the answer.

``--plan auto``: a LightningModule over Pyro's ELBO module with a torch
optimizer (automatic optimization). ``--plan manual``: the pattern of
scvi-tools' ``PyroTrainingPlan``: manual optimization, ``SVI.step`` inside
``training_step`` with ``pd.DistributedOptimizer(PyroOptim)`` built before
the Trainer starts its processes, and a stand-in torch optimizer that
Lightning steps to count steps.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule
from torch.utils.data import DataLoader, TensorDataset

import pyro_distributed as pd
from pyro_distributed.lightning import IndexedDataset, PyroDistributedStrategy

N, N_VAL, TRUE_W, SIGMA = 1000, 101, (2.0, -1.0, 0.5), 0.3


def make_data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator)
    y = x @ torch.tensor(TRUE_W) + SIGMA * torch.randn(n, generator=generator)
    return TensorDataset(x, y)


class Regression(PyroModule):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, indices: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        w = pyro.sample("w", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with pyro.plate("data", self.size, subsample=indices):
            return pyro.sample("y", dist.Normal(x @ w, SIGMA), obs=y)


class Recorder(pl.LightningModule):
    """What both plans share: validation, prediction, and a record of what each
    worker saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.val_seen: list[int] = []

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path is None:  # a resumed run has its RNG states back
            pd.set_rng_seed(1)  # independent guide noise on each worker, now that they have met

    def on_train_epoch_end(self) -> None:
        # Each worker's own signal, not synchronised: worker 1's stops improving
        # after epoch 1, worker 0's never does. EarlyStopping must stop both.
        epoch = float(self.current_epoch)
        signal = -epoch if self.global_rank == 0 else min(epoch, 1.0)
        self.log("signal", signal, rank_zero_only=False)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        indices = batch[0]
        self.val_seen.extend(indices.tolist())
        self.log("val_rows", float(len(indices)), reduce_fx="sum", sync_dist=True, on_epoch=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0]  # the indices: their order is the order of the results


class AutomaticPlan(Recorder):
    def __init__(self, lr: float) -> None:
        super().__init__()
        model = Regression(N)
        self.loss_fn = Trace_ELBO()(model, AutoNormal(model))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch[0].tolist())
        loss: torch.Tensor = self.loss_fn(*batch)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.loss_fn.parameters(), lr=self.lr)

    def posterior(self) -> dict[str, torch.Tensor]:
        guide = self.loss_fn.guide
        return {"loc": guide.locs.w.detach().clone(), "scale": guide.scales.w.detach().clone()}


class ManualPlan(Recorder):
    """scvi-tools' pattern, in miniature."""

    def __init__(self, optim: Any) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = Regression(N)
        self.guide = AutoNormal(self.model)
        self.svi = SVI(self.model, self.guide, optim, Trace_ELBO())
        self.shim = torch.nn.Parameter(torch.zeros(1))  # gives Lightning something to wrap

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch[0].tolist())
        loss = torch.tensor(self.svi.step(*batch))
        self.optimizers().step()  # counts Lightning's steps; the shim has no gradient
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.shim], lr=0.0)

    def posterior(self) -> dict[str, torch.Tensor]:
        store = pyro.get_param_store()
        return {
            "loc": store["AutoNormal.locs.w"].detach().clone(),
            "scale": store["AutoNormal.scales.w"].detach().clone(),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", choices=["auto", "manual"], default="auto")
    parser.add_argument("--strategy", choices=["ours", "ddp"], default="ours")
    parser.add_argument("--engine", default="auto", help="PyroDistributedStrategy(engine=...)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=100, help="rows per worker per step")
    parser.add_argument("--lr", type=float, default=0.05, help="the automatic plan's Adam")
    parser.add_argument("--early-stop", action="store_true", help="EarlyStopping on 'signal'")
    parser.add_argument("--val-every", type=int, help="epochs between validations (default: last)")
    parser.add_argument("--checkpoint-dir", type=Path, help="ModelCheckpoint(save_last=True)")
    parser.add_argument("--resume", type=Path, help="trainer.fit(ckpt_path=...)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    pyro.set_rng_seed(0)  # the same initial values in every process
    pyro.clear_param_store()
    train, val = IndexedDataset(make_data(N, 0)), IndexedDataset(make_data(N_VAL, 1))
    plan: Recorder
    built_alone = None
    if args.plan == "auto":
        pyro.settings.set(module_local_params=True)
        plan = AutomaticPlan(lr=args.lr)
        plan.loss_fn(*train[:2])  # AutoNormal creates its parameters here
    else:
        optim = pd.DistributedOptimizer(pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.995}))
        built_alone = pd.world_size()  # before Lightning's process group: one worker here
        plan = ManualPlan(optim)
    strategy: Any = (
        PyroDistributedStrategy(engine=args.engine) if args.strategy == "ours" else "ddp"
    )
    callbacks = []
    if args.early_stop:
        callbacks.append(
            pl.callbacks.EarlyStopping(
                monitor="signal", patience=1, mode="min", check_on_train_epoch_end=True
            )
        )
    if args.checkpoint_dir is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.checkpoint_dir, save_last=True, save_on_train_epoch_end=True
            )
        )
    trainer = pl.Trainer(
        callbacks=callbacks,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=args.checkpoint_dir is not None,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=args.val_every or args.epochs,
    )
    loader = DataLoader(train, batch_size=args.batch, shuffle=True)
    val_loader = DataLoader(val, batch_size=16)
    if args.strategy == "ddp":  # plain DDP: each worker its half, by Lightning's sampler
        trainer.fit(plan, loader)
    else:
        trainer.fit(plan, loader, val_loader, ckpt_path=args.resume)
    rank = trainer.global_rank
    record: dict[str, Any] = {
        "rank": rank,
        "world_size": trainer.world_size,
        "built_alone": built_alone,
        "engine_world_size": pd.world_size(),
        "posterior": plan.posterior(),
        "seen": plan.seen,
        "val_seen": plan.val_seen,
        "global_step": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    if args.strategy == "ours":
        strategy = trainer.strategy
        mine = torch.tensor(float(rank + 1))
        record["reduce_sum"] = float(strategy.reduce(mine, reduce_op="sum"))
        record["reduce_min"] = float(strategy.reduce(mine, reduce_op="min"))
        record["broadcast"] = strategy.broadcast(f"from {rank}", src=1)
        predictions = trainer.predict(plan, DataLoader(val, batch_size=16))
        record["predictions"] = torch.cat(predictions).tolist() if predictions else []
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out / f"rank{rank}.pt")
    if os.environ.get("PYRO_DISTRIBUTED_VERBOSE"):
        print(record["metrics"])


if __name__ == "__main__":
    main()
