"""PyroDistributedStrategy: Lightning's DDP launch, this library's gradient exchange.

It subclasses Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`
and keeps everything that starts the workers: the launcher (``devices=N``
on CPU with gloo or on GPUs with NCCL, ``num_nodes``, or an outside launcher
such as ``torchrun`` or ``mpiexec``), the cluster environments and the process
group; with ``engine="horovod"`` or ``engine="mpi"`` the outside launcher's
workers meet on that transport instead, without a torch process group. What
it changes is what DDP does with gradients and data:

* The module is not wrapped in ``DistributedDataParallel``. Every optimizer
  that ``configure_optimizers`` returns is wrapped in
  :class:`~pyro_distributed.DistributedOptimizer` instead, so the
  gradients are averaged at ``optimizer.step()`` by the same exchange that
  ``pyro.infer.SVI`` uses. Under manual optimization, a
  ``pd.DistributedOptimizer(PyroOptim)`` inside ``SVI.step`` (the pattern of
  scvi-tools' ``PyroTrainingPlan``) binds to the same engine at its first step.
* Training steps run inside :func:`~pyro_distributed.shard_subsamples`, with
  local parameters owned by their worker when ``own_local_params=True``.
* Loaders get this library's samplers (:mod:`pyro_distributed.lightning.data`).
* ``self.log(..., sync_dist=True)``, ``reduce``, ``broadcast``, ``all_gather``
  and ``barrier`` run on the engine, and so does ``EarlyStopping``'s decision.
  ``trainer.predict`` returns every worker's predictions, in the data's
  order, on worker 0 (:mod:`pyro_distributed.lightning.collectives`).
* Checkpoints are complete: every worker's RNG states, and local
  parameters as one block file per worker beside Lightning's file, written all
  or nothing (:mod:`pyro_distributed.lightning.checkpoints`).
  ``trainer.fit(..., ckpt_path=...)`` at the same world size continues
  bitwise; at another, the blocks are re-partitioned.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.utils.data import DataLoader

from .. import runtime
from ..checks import check_bool
from ..data.shards import ShardSampler
from ..data.subsample import shard_subsamples
from ..engines import ENGINE_NAMES, Engine
from ..errors import PyroDistributedError
from ..local.sparse import check_local_updates
from ..optim.torch_optimizer import DistributedTorchOptimizer
from . import anndata, checkpoints, collectives, internals, pyro_state
from .data import EvaluationSampler, is_plain_sampler, with_own_generator

__all__ = ["PyroDistributedStrategy"]

# Engines whose launcher (horovodrun, mpiexec) starts every worker and that
# need no torch process group.
_OWN_WORKERS = ("horovod", "mpi")


class PyroDistributedStrategy(DDPStrategy):
    """Train a LightningModule data-parallel with this library's optimizers.

    :param engine: ``"auto"`` (default: the process group that Lightning or
        the outside launcher made, also under ``mpiexec``, where Lightning's
        ``MPIEnvironment`` makes it), ``"torch"``, ``"horovod"`` (under
        ``horovodrun``, ``devices=1`` per process) or ``"mpi"`` (under
        ``mpiexec``/``mpirun``, ``devices`` x ``num_nodes`` = its ``-n``):
        those two launchers start every worker, and every collective runs on
        Horovod or MPI, with no torch process group.
    :param own_local_params: keep each per-data-point parameter's rows only
        on the worker that owns them (README, "Local parameters owned by
        their worker"); the training loader then gives each worker its block.
    :param local_updates: with ``own_local_params=True``, ``"dense"``
        (default) steps every owned row each step; ``"sparse"`` only the
        rows of the step's batch, at O(batch) a step, with the lazy rules of
        ``torch.optim.SparseAdam`` (README, "Sparse local steps").
    :param shuffle: whether the training loader's order changes each epoch.
    :param seed: the seed of the shared order.
    :param optimizer_options: keyword arguments for every
        :class:`~pyro_distributed.DistributedOptimizer` the strategy makes
        (``bucket_cap_mb``, ``compression``, ``overlap``, ...).

    The other arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s.

    Example::

        import lightning.pytorch as pl
        from pyro_distributed.lightning import PyroDistributedStrategy

        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=PyroDistributedStrategy())
        trainer.fit(module, loader)

    .. warning::
        Every worker must take the same number of optimizer steps: each is
        a collective. The training loader's sampler gives every worker the
        same number of batches; a loader with a sampler of your own (left
        alone) must do the same.

    .. warning::
        Every worker must build the same optimizers, over the same
        parameters in the same order. The first step gives every parameter
        worker 0's value; the module's parameters and buffers are also set
        to worker 0's when training starts.

    .. warning::
        Gradients are averaged in ``optimizer.step()``. ``gradient_clip_val``
        and any change to ``.grad`` before it act on this worker's own
        gradient; clip in ``configure_gradient_clipping`` after calling
        ``optimizer.synchronize()`` to clip the average.

    .. warning::
        With ``own_local_params=True``, the model's plate over the data must
        take its subsample from the batch: ``pyro.plate(name, N,
        subsample=indices)``, with ``indices`` from
        :class:`~pyro_distributed.lightning.IndexedDataset`. Create a lazily
        built guide's parameters after the workers have met, in the
        LightningModule's ``setup()`` and inside
        ``pd.shard_subsamples(own_local_params=True, by_block=True)``, on
        indices from this worker's block: a parameter that a forward pass
        used with all its rows cannot be cut afterwards. Lightning calls
        ``setup()`` before it restores a checkpoint, so a resumed run's local
        parameters are then cut to this worker's block, as a checkpoint's
        blocks are restored only into parameters that are local already.

    .. warning::
        A checkpoint of local parameters is Lightning's file and, beside it in
        a directory every worker sees, one ``<file>.<token>.block<r>of<W>``
        per worker: copy them together, restore them through the Trainer
        (``ckpt_path=``; ``load_from_checkpoint`` sees the global parameters
        only), and trust them (block files are unpickled).
    """

    strategy_name = "pyro_distributed"

    def __init__(
        self,
        *,
        engine: str = "auto",
        own_local_params: bool = False,
        local_updates: str = "dense",
        shuffle: bool = True,
        seed: int = 0,
        optimizer_options: Mapping[str, Any] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if engine not in ("auto", *ENGINE_NAMES) or engine == "local":
            raise ValueError(
                f"PyroDistributedStrategy(engine={engine!r}): choose 'auto', 'torch', "
                f"'horovod' or 'mpi'"
            )
        check_bool("own_local_params", own_local_params)
        self.local_updates = check_local_updates(
            local_updates, own_local_params, "PyroDistributedStrategy"
        )
        check_bool("shuffle", shuffle)
        options = dict(optimizer_options or {})
        if "engine" in options:
            raise TypeError("optimizer_options cannot hold 'engine'; pass engine= to the strategy")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._engine_name = engine
        self._engine: Engine | None = None
        self._resumption: checkpoints.Resumption | None = None
        self._observations: int | None = None  # of an scvi-tools splitter taken over
        self._pending_rng: Mapping[str, Any] | None = None  # a resumed run's, until its first step
        self.own_local_params = own_local_params
        self.shuffle, self.seed = shuffle, seed
        self._optimizer_options = options

    # -- the workers and the engine

    @property
    def engine(self) -> Engine:
        """The engine every collective of this strategy runs on (after set-up)."""
        if self._engine is None:
            raise PyroDistributedError(
                "PyroDistributedStrategy has no engine yet: it starts one when the "
                "Trainer sets up its processes (trainer.fit, validate, test or predict)"
            )
        return self._engine

    def _configure_launcher(self) -> None:
        if self._engine_name in _OWN_WORKERS:
            self._launcher = None  # horovodrun or mpiexec started every worker itself
        else:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        """The device, then the workers: DDP's process group and the engine on it,
        or, with ``engine="horovod"`` or ``"mpi"``, the launcher's workers on
        that engine and no torch process group. With ``own_local_params``, an
        scvi-tools data splitter then keeps this worker's block of observations
        (:func:`anndata.take_over_splitter`)."""
        self._setup_workers()
        if self.own_local_params and self.lightning_module is not None:
            datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
            self._observations = anndata.take_over_splitter(datamodule)

    def _setup_workers(self) -> None:
        assert self.cluster_environment is not None
        if self._engine_name not in _OWN_WORKERS:
            if self.cluster_environment.creates_processes_externally:
                self._check_devices(self.cluster_environment.world_size())
            super().setup_environment()  # calls setup_distributed()
            return
        self._engine = runtime.init(self._engine_name)
        if self._engine_name == "mpi":  # Horovod's convention is devices=1 per process
            self._check_devices(self._engine.world_size)
        super(DDPStrategy, self).setup_environment()  # the device alone
        self.cluster_environment.set_world_size(self._engine.world_size)
        self.cluster_environment.set_global_rank(self._engine.rank)
        internals.set_rank_zero(self._engine.rank)
        self._check_world_size()

    def setup_distributed(self) -> None:
        """Lightning's process group (made by DDP's set-up), then the engine on it."""
        super().setup_distributed()
        self._engine = runtime.init(self._engine_name)
        self._check_world_size()
        atexit.register(collectives.leave_together, self._engine)

    def _check_devices(self, workers: int) -> None:
        """Refuse Trainer arguments that count other workers than the outside launcher started."""
        if self.num_nodes * self.num_processes != workers:
            raise PyroDistributedError(
                f"PyroDistributedStrategy: the launcher started {workers} worker(s) but the "
                f"Trainer counts devices={self.num_processes} x num_nodes={self.num_nodes}; "
                f"give it devices= (workers per machine) and num_nodes= that match"
            )

    def _check_world_size(self) -> None:
        assert self._engine is not None
        if self._engine.world_size != self.world_size:
            raise PyroDistributedError(
                f"PyroDistributedStrategy: Lightning counts {self.world_size} worker(s) "
                f"(devices x num_nodes) but the {self._engine.name!r} engine has "
                f"{self._engine.world_size}; give the Trainer devices= and num_nodes= "
                f"that match the launcher"
            )

    # -- the module and the optimizers: no DDP wrapper

    def setup(self, trainer: Any) -> None:
        """DDP's set-up without the ``DistributedDataParallel`` wrapper."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        collectives.broadcast_module(self.engine, self.model)
        internals.disable_sampler_injection(trainer)
        if self.own_local_params:
            pyro_state.shard_guide_warmups(trainer.callbacks)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            internals.optimizers_to_device(self.optimizers, self.root_device)

    def configure_ddp(self) -> None:
        """Nothing to wrap: gradients are averaged by the optimizers."""

    def setup_optimizers(self, trainer: Any) -> None:
        """``configure_optimizers``' optimizers, each wrapped to average gradients."""
        super().setup_optimizers(trainer)
        self.optimizers = [self._distributed(optimizer) for optimizer in self.optimizers]

    def _distributed(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, DistributedTorchOptimizer):
            wrapped = optimizer
        else:
            wrapped = DistributedTorchOptimizer(
                optimizer, engine=self.engine, **self._optimizer_options
            )
        wrapped.engine  # noqa: B018 (bind now, before Lightning wraps it in a LightningOptimizer)
        return wrapped

    # -- steps: subsampling sharded, local parameters owned

    @contextmanager
    def _sharded(self) -> Iterator[None]:
        with shard_subsamples(
            by_block=self.own_local_params,
            own_local_params=self.own_local_params,
            local_updates=self.local_updates,
        ):
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._sharded():
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.own_local_params:  # local rows are read by their block's global indices
            return super().validation_step(*args, **kwargs)
        with self._sharded():
            return super().validation_step(*args, **kwargs)

    # -- data: this library's samplers

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader with :class:`~pyro_distributed.ShardSampler`,
        evaluation and prediction loaders with
        :class:`~pyro_distributed.lightning.data.EvaluationSampler`; loaders
        whose sampler is already distributed (or custom) are left alone."""
        if not isinstance(dataloader, DataLoader):
            return dataloader
        stage = self.lightning_module.trainer.state.stage if self.lightning_module else None
        processed = self._with_samplers(dataloader, stage)
        if stage == RunningStage.TRAINING:
            with_own_generator(processed, self.seed)
        return processed

    def _with_samplers(self, dataloader: DataLoader[Any], stage: Any) -> DataLoader[Any]:
        if self.engine.world_size == 1:
            return dataloader
        owned = self.own_local_params and stage != RunningStage.PREDICTING
        if owned and anndata.is_batch_sampler_loader(dataloader):  # scvi-tools' loaders
            return anndata.owned_loader(
                dataloader, self.engine, size=self._observations, seed=self.seed
            )
        if not is_plain_sampler(dataloader.sampler):
            return dataloader
        dataset = dataloader.dataset
        if stage == RunningStage.TRAINING:
            sampler: Any = ShardSampler(
                dataset,  # type: ignore[arg-type]
                shuffle=self.shuffle,
                seed=self.seed,
                by_block=self.own_local_params,
            )
        else:
            sampler = EvaluationSampler(dataset)  # type: ignore[arg-type]
        return internals.with_sampler(dataloader, sampler, stage)

    # -- collectives on the engine: lightning/collectives.py

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """``tensor`` reduced across workers (``"mean"``, ``"sum"``, ``"max"``,
        ``"min"``); anything but a tensor is returned as it is."""
        if not isinstance(tensor, Tensor):
            return tensor
        return collectives.reduce(self.engine, tensor, group, reduce_op)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Worker ``src``'s ``obj`` (picklable) on every worker."""
        return collectives.broadcast(self._engine, obj, src)

    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        """Every worker's ``tensor``, stacked along a new first dimension."""
        return collectives.all_gather(self.engine, tensor, group, sync_grads)

    def barrier(self, name: str | None = None) -> None:
        collectives.barrier(self._engine)

    def on_predict_end(self) -> None:
        """Put every worker's predictions, in the data's order, on worker 0
        (:func:`collectives.gather_predictions`); other workers keep an empty list."""
        super().on_predict_end()
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if trainer is not None:
            collectives.gather_predictions(self.engine, trainer.predict_loop)

    # -- checkpoints, local blocks included: lightning/checkpoints.py

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Lightning's checkpoint with every worker's RNG states and blocks of local
        parameters, all or nothing (a collective; see :func:`checkpoints.save`)."""
        assert self.lightning_module is not None
        checkpoints.save(
            checkpoint, filepath, engine=self.engine, module=self.lightning_module,
            optimizers=self.optimizers, checkpoint_io=self.checkpoint_io,
            storage_options=storage_options,
        )  # fmt: skip

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoints.remove(filepath, self.checkpoint_io)  # the file, then its blocks

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        self._resumption = checkpoints.Resumption.of(checkpoint_path)  # where the blocks are
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The module, this worker's rows of local parameters re-partitioned for
        this world size, and its RNG states if the world size is the saved one."""
        module = self.lightning_module
        assert module is not None
        if self.own_local_params:  # a Pyro plan's lazily built guide: its parameters, cut
            pyro_state.create_guide_params(module, getattr(module.trainer, "datamodule", None))
        state = checkpoints.module_state(checkpoint, self._resumption, module)
        super().load_model_state_dict({**checkpoint, "state_dict": state}, strict=strict)
        if module.trainer.state.fn == TrainerFn.FITTING:  # where the resumed run first draws
            self._pending_rng = checkpoint
        else:
            checkpoints.restore_rng(checkpoint, self.engine)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """A resumed run's RNG states, restored where it first draws (README,
        "Checkpoints"): after the hooks that start training, before its first step."""
        if self._pending_rng is not None:
            checkpoints.restore_rng(self._pending_rng, self.engine)
            self._pending_rng = None

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None and self._resumption is not None
        saved = checkpoint.get(checkpoints.KEY) or {}
        pyro_state.restore_pyro_optimizer(
            self.lightning_module,
            saved.get("pyro_optim") or {},
            self._resumption.rows,
            saved.get("pyro_optim_steps"),
        )
        states = checkpoints.optimizer_states(checkpoint, self._resumption)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})
        checkpoints.restore_counts(checkpoint, self.optimizers)

    # -- registration

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="data-parallel training with pyro_distributed's optimizers, no DDP wrapper",
        )


if PyroDistributedStrategy.strategy_name not in StrategyRegistry:
    PyroDistributedStrategy.register_strategies(StrategyRegistry)
