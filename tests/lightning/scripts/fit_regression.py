"""Bayesian linear regression trained by a Lightning Trainer, for the strategy's tests.

Run as a plain script: Lightning's own launcher re-runs it once per extra
device, and torchrun runs it once per worker. Every worker writes what it
ends with to ``OUT/rank{r}.pt``; the tests compare the workers and the answer.

``--plan auto``: a LightningModule over Pyro's ELBO module with a torch
optimizer (automatic optimization). ``--plan local``: the same with a latent
offset per row whose parameters are owned by their worker
(``own_local_params=True``), created in ``setup()`` as the strategy's rule
says. ``--plan manual``: the pattern of scvi-tools' ``PyroTrainingPlan``:
manual optimization, ``SVI.step`` inside ``training_step`` with
``pd.DistributedOptimizer(PyroOptim)`` built before the Trainer starts its
processes, and a stand-in torch optimizer that Lightning steps to count steps.

``--fail-save-at-epoch E`` makes the checkpoint save at the end of epoch E
fail for real on one worker (``--failing-worker``): from that epoch's start,
it may not write a file larger than ``--file-limit`` bytes (``RLIMIT_FSIZE``),
so the strategy's own write of its block, or of Lightning's file, raises
``OSError`` (EFBIG). Worker 0 first records the checkpoint directory as it is
(names and SHA-256), for the test to compare with what the failure leaves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import socket
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
from pyro_distributed.integrations.lightning import IndexedDataset, PyroDistributedStrategy

N, N_VAL, N_TEST, TRUE_W, SIGMA = 1000, 101, 57, (2.0, -1.0, 0.5), 0.3


def make_data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator)
    y = x @ torch.tensor(TRUE_W) + SIGMA * torch.randn(n, generator=generator)
    return TensorDataset(x, y)


class Regression(PyroModule):
    """Bayesian linear regression; with ``local=True``, a latent offset per row
    whose variational parameters are local."""

    def __init__(self, size: int, local: bool = False) -> None:
        super().__init__()
        self.size, self.local = size, local

    def forward(self, indices: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        w = pyro.sample("w", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        with pyro.plate("data", self.size, subsample=indices):
            mean = x @ w
            if self.local:
                mean = mean + pyro.sample("z", dist.Normal(0.0, 0.5))
            return pyro.sample("y", dist.Normal(mean, SIGMA), obs=y)


def snapshot(module: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Every parameter: the global indices of the rows this worker holds (all of
    a global one's), its values, and its optimizer state."""
    taken = {}
    for name, param in module.named_parameters():
        indices, value = pd.local_rows(name, module=module)
        state = {k: v.clone() for k, v in optimizer.state.get(param, {}).items()}
        taken[name] = {"indices": indices, "value": value.clone(), "state": state}
    return taken


class Recorder(pl.LightningModule):
    """What both plans share: validation, testing, prediction, and a record of
    what each worker saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.val_seen: list[int] = []
        self.test_seen: list[int] = []

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path is None:  # a resumed run has its RNG states back
            pd.set_rng_seed(1)  # independent guide noise on each worker, now that they have met
        else:  # what the checkpoint restored, before any step
            self.restored = snapshot(self, self.trainer.strategy.optimizers[0])

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

    def test_step(self, batch: Any, batch_idx: int) -> None:
        indices = batch[0]
        self.test_seen.extend(indices.tolist())
        self.log("test_rows", float(len(indices)), reduce_fx="sum", sync_dist=True)

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


class LocalPlan(AutomaticPlan):
    """Per-row latents owned by their worker, created in setup() on this worker's block."""

    def __init__(self, lr: float, train: IndexedDataset) -> None:
        Recorder.__init__(self)
        model = Regression(N, local=True)
        guide = AutoNormal(
            model, create_plates=lambda idx, *_: pyro.plate("data", N, subsample=idx)
        )
        self.loss_fn = Trace_ELBO()(model, guide)
        self.lr, self.dataset = lr, train

    def setup(self, stage: str) -> None:
        first = next(iter(pd.ShardSampler(self.dataset, by_block=True, shuffle=False)))
        with pd.shard_subsamples(own_local_params=True, by_block=True):
            self.loss_fn(*self.dataset[torch.tensor([first])])


class FailSave(pl.Callback):
    """From epoch ``epoch``'s start, worker ``rank`` cannot write files over ``limit`` bytes."""

    def __init__(self, epoch: int, rank: int, limit: int, out: Path, directory: Path) -> None:
        self.epoch, self.rank, self.limit = epoch, rank, limit
        self.out, self.directory = out, directory

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.epoch:
            return
        if trainer.global_rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            torch.save(listing(self.directory), self.out / "before_failure.pt")
        if trainer.global_rank == self.rank:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, do not kill
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, hard))


def listing(directory: Path) -> dict[str, str]:
    """Every entry of ``directory``: a symlink's target, or a file's SHA-256."""
    return {
        path.name: f"-> {os.readlink(path)}"
        if path.is_symlink()
        else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


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
    parser.add_argument("--plan", choices=["auto", "local", "manual"], default="auto")
    parser.add_argument("--strategy", choices=["ours", "ddp"], default="ours")
    parser.add_argument("--engine", default="auto", help="PyroDistributedStrategy(engine=...)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...)")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=100, help="rows per worker per step")
    parser.add_argument("--lr", type=float, default=0.05, help="the automatic plan's Adam")
    parser.add_argument("--early-stop", action="store_true", help="EarlyStopping on 'signal'")
    parser.add_argument("--val-every", type=int, help="epochs between validations (default: last)")
    parser.add_argument("--checkpoint-dir", type=Path, help="ModelCheckpoint(save_last=True)")
    parser.add_argument("--resume", type=Path, help="trainer.fit(ckpt_path=...)")
    parser.add_argument("--fail-save-at-epoch", type=int, help="a worker's save fails then")
    parser.add_argument("--failing-worker", type=int, default=1)
    parser.add_argument("--file-limit", type=int, default=2048, help="bytes, for that worker")
    parser.add_argument(
        "--optimizer-options", type=json.loads, help="PyroDistributedStrategy(optimizer_options=)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    pyro.set_rng_seed(0)  # the same initial values in every process
    pyro.clear_param_store()
    train, val = IndexedDataset(make_data(N, 0)), IndexedDataset(make_data(N_VAL, 1))
    test = IndexedDataset(make_data(N_TEST, 2))
    plan: Recorder
    built_alone = None
    if args.plan == "auto":
        pyro.settings.set(module_local_params=True)
        plan = AutomaticPlan(lr=args.lr)
        plan.loss_fn(*train[:2])  # AutoNormal creates its parameters here
    elif args.plan == "local":
        pyro.settings.set(module_local_params=True)
        plan = LocalPlan(lr=args.lr, train=train)  # AutoNormal's parameters: in setup()
    else:
        optim = pd.DistributedOptimizer(pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.995}))
        built_alone = pd.world_size()  # before Lightning's process group: one worker here
        plan = ManualPlan(optim)
    strategy: Any = "ddp"
    if args.strategy == "ours":
        strategy = PyroDistributedStrategy(
            engine=args.engine,
            own_local_params=args.plan == "local",
            optimizer_options=args.optimizer_options,
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
    if args.fail_save_at_epoch is not None:
        callbacks.append(
            FailSave(
                args.fail_save_at_epoch,
                args.failing_worker,
                args.file_limit,
                args.out,
                args.checkpoint_dir,
            )
        )
    trainer = pl.Trainer(
        callbacks=callbacks,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
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
    elif args.fail_save_at_epoch is None:
        trainer.fit(plan, loader, val_loader, ckpt_path=args.resume)
    else:
        try:
            trainer.fit(plan, loader, val_loader, ckpt_path=args.resume)
        except pd.PyroDistributedError as error:  # recorded on every worker, then re-raised
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the record may be written
            args.out.mkdir(parents=True, exist_ok=True)
            failure = {"rank": trainer.global_rank, "error": str(error)}
            torch.save(failure, args.out / f"rank{trainer.global_rank}.pt")
            raise
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
        "engine": pd.current_engine().name,
        "host": socket.gethostname(),
        "params": snapshot(plan, trainer.strategy.optimizers[0]),
        "restored": getattr(plan, "restored", None),
        "check_every": getattr(trainer.strategy.optimizers[0], "check_every", None),
    }
    if args.strategy == "ours":
        strategy = trainer.strategy
        mine = torch.tensor(float(rank + 1))
        record["reduce_sum"] = float(strategy.reduce(mine, reduce_op="sum"))
        record["reduce_min"] = float(strategy.reduce(mine, reduce_op="min"))
        record["broadcast"] = strategy.broadcast(f"from {rank}", src=1)
        (tested,) = trainer.test(plan, DataLoader(test, batch_size=16), verbose=False)
        record["test_seen"] = plan.test_seen
        record["test_metrics"] = {k: float(v) for k, v in tested.items()}
        predictions = trainer.predict(plan, DataLoader(val, batch_size=16))
        record["predictions"] = torch.cat(predictions).tolist() if predictions else []
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out / f"rank{rank}.pt")
    if os.environ.get("PYRO_DISTRIBUTED_VERBOSE"):
        print(record["metrics"])


if __name__ == "__main__":
    main()
