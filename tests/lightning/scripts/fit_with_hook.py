"""A regression with a 20x16 weight, trained through LowRankHook, checkpointed and resumed.

Each worker holds 32 rows, 4 steps per epoch at any ``--devices`` (2 by
default). ``--hook`` trains through
``LowRankHook(rank=2, warmup_steps=2)`` (passed in the strategy's
``optimizer_options``): AutoNormal's location and scale of the weight are
20x16 matrices, which it compresses from step 3 on; ``--no-overlap`` passes
``overlap=False`` too (bitwise from three workers on). ``--diloco`` trains
under ``DiLoCo(period=5)`` instead (sync points after steps 1 and 6);
``--svi`` trains through an ``SVI`` the module holds, with a ``pyro.optim``
Adam and the param store, as scvi-tools' Pyro plans do (the strategy wraps
that optimizer). ``--save-every 2``
writes ``step=<s>.ckpt`` every two steps; ``--resume FILE`` continues from
one. Each worker saves its parameters after step 8, its losses, its final
``global_step`` and its hook's state at the end to ``OUT/rank<r>.pt``.
(Lightning before 2.5 trains one step more after a resume,
Lightning-AI/pytorch-lightning#19403: the parameters are taken at step 8 so
that the runs can still be compared.)
"""

from __future__ import annotations

import argparse
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
from pyro_distributed.integrations.lightning import OptimizerOptions, PyroDistributedStrategy

ROWS_PER_WORKER, BATCH, IN, OUT, SIGMA = 32, 8, 20, 16, 0.5
STEPS = 8  # the straight run's: 2 epochs of 4 steps


def make_data(rows: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, IN, generator=generator)
    w = torch.randn(IN, OUT, generator=generator)
    return TensorDataset(x, x @ w + SIGMA * torch.randn(rows, OUT, generator=generator))


class Regression(PyroModule):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([IN, OUT]).to_event(2))
        with pyro.plate("data", self.rows, subsample=torch.arange(len(x))):
            pyro.sample("y", dist.Normal(x @ w, SIGMA).to_event(1), obs=y)


class Plan(pl.LightningModule):
    def __init__(self, rows: int) -> None:
        super().__init__()
        model = Regression(rows)
        self.loss_fn = Trace_ELBO()(model, AutoNormal(model))
        self.losses: list[float] = []
        self.params_at_last_step: dict[str, torch.Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.loss_fn(*batch)  # draws w from the guide
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == STEPS:
            self.params_at_last_step = {
                name: value.detach().clone() for name, value in self.loss_fn.named_parameters()
            }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.loss_fn.parameters(), lr=0.05)


class SVIPlan(Plan):
    """The same model as scvi-tools' Pyro plans train it: manual optimization,
    ``SVI.step`` in ``training_step``, the parameters in Pyro's param store."""

    def __init__(self, rows: int) -> None:
        super().__init__(rows)
        self.automatic_optimization = False
        self.model = Regression(rows)
        self.guide = AutoNormal(self.model)
        self.svi = SVI(self.model, self.guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        self.shim = torch.nn.Parameter(torch.zeros(1))  # gives Lightning something to wrap

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.svi.step(*batch)
        self.optimizers().step()  # counts Lightning's steps; the shim has no gradient
        self.losses.append(loss)
        return torch.tensor(loss)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == STEPS:
            self.params_at_last_step = {
                name: value.detach().clone() for name, value in pyro.get_param_store().items()
            }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.shim], lr=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hook", action="store_true", help="LowRankHook(rank=2, warmup_steps=2)")
    parser.add_argument("--diloco", action="store_true", help="step_policy=DiLoCo(period=5)")
    parser.add_argument("--svi", action="store_true", help="through an SVI the module holds")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--no-overlap", action="store_true", help="overlap=False")
    parser.add_argument("--save-every", type=int, help="ModelCheckpoint(every_n_train_steps=)")
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    pyro.settings.set(module_local_params=not args.svi)
    rows = ROWS_PER_WORKER * args.devices
    data = make_data(rows)
    plan = SVIPlan(rows) if args.svi else Plan(rows)
    if args.svi:
        plan.guide(*data[:2])
    else:
        plan.loss_fn(*data[:2])  # AutoNormal creates its parameters here
    options: OptimizerOptions = {}
    if args.hook:
        options["comm_hook"] = pd.LowRankHook(rank=2, warmup_steps=2)
    if args.diloco:
        options["step_policy"] = pd.DiLoCo(period=5)
    if args.no_overlap:
        options["overlap"] = False
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
        strategy=PyroDistributedStrategy(optimizer_options=options or None),
        max_epochs=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=args.save_every is not None,
    )
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    trainer.fit(plan, loader, ckpt_path=args.resume)
    distributed = plan.svi.optim if args.svi else trainer.strategy.optimizers[0]
    record = {
        "global_step": trainer.global_step,
        "params": plan.params_at_last_step,
        "losses": plan.losses,
        "hook_state": distributed.extension_state()["comm_hook"],
        "in_sync": distributed.in_sync,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
