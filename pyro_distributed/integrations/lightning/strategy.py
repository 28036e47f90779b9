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
* Loaders get this library's samplers, also a ``BatchSampler`` passed as
  the ``sampler`` (scvi-tools' loaders; :mod:`pyro_distributed.integrations.lightning.data`).
* An ``SVI`` that the LightningModule steps itself (scvi-tools'
  ``PyroTrainingPlan``) gets its optimizer wrapped too, and the workers'
  parameters are compared after the first step and at the end of training
  (:mod:`pyro_distributed.integrations.lightning.plans`).
* ``self.log(..., sync_dist=True)``, ``reduce``, ``broadcast``, ``all_gather``
  and ``barrier`` run on the engine, and so does ``EarlyStopping``'s decision.
  ``trainer.predict`` returns every worker's predictions, in the data's
  order, on worker 0 (:mod:`pyro_distributed.integrations.lightning.collectives`).
* Checkpoints are complete: every worker's RNG states, and local
  parameters as one block file per worker beside Lightning's file, written all
  or nothing (:mod:`pyro_distributed.integrations.lightning.checkpoints`).
  ``trainer.fit(..., ckpt_path=...)`` at the same world size continues
  bitwise; at another, the blocks are re-partitioned.
* ``devices`` x ``num_nodes`` counts the workers under every launcher
  (:mod:`pyro_distributed.integrations.lightning.launch`).
"""

from __future__ import annotations

import atexit
import copy
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from ... import runtime
from ...checks import check_bool, check_int
from ...data.subsample import shard_subsamples
from ...engines import Engine, check_engine_name, engine_class
from ...errors import PyroDistributedError
from ...local.sparse import check_local_updates
from ...optim.front_end import FrontEnd
from ...optim.options import OptimizerOptions, check_optimizer_options
from ...optim.torch_optimizer import DistributedTorchOptimizer
from ..scvi import anndata, guides
from . import (
    checkpoints,
    collectives,
    data,
    internals,
    kernel,
    launch,
    layer_sync,
    plans,
    pyro_state,
)


class PyroDistributedStrategy(DDPStrategy):
    """Train a LightningModule data-parallel with this library's optimizers.

    :param engine: ``"auto"`` (default: the process group that Lightning or
        the outside launcher made, also under ``mpiexec``, where Lightning's
        ``MPIEnvironment`` makes it; under ``horovodrun``, ``"horovod"``),
        ``"torch"``, ``"horovod"`` (under ``horovodrun``) or ``"mpi"``
        (under ``mpiexec``/``mpirun``): those two launchers start every
        worker, and every collective runs on Horovod or MPI, with no torch
        process group. Under every launcher, ``devices`` x ``num_nodes``
        must be the number of workers it started.
    :param own_local_params: keep each per-data-point parameter's rows only
        on the worker that owns them (the user guide's page "Local parameters
        owned by their worker", ``docs/guide/local-parameters.md``); the
        training loader then gives each worker its block.
    :param local_updates: with ``own_local_params=True``, ``"dense"``
        (default) steps every owned row each step; ``"sparse"`` only the
        rows of the step's batch, at O(batch) a step, with the lazy rules of
        ``torch.optim.SparseAdam`` (``docs/guide/local-parameters.md``,
        "Sparse local steps").
    :param shuffle: whether the training loader's order changes each epoch;
        ``None`` (default) keeps the loader's own choice, as Lightning's DDP
        does (``DataLoader(shuffle=True)`` shuffles, ``shuffle=False`` keeps
        the data's order, split between the workers).
    :param seed: the seed of the shared order.
    :param optimizer_options: options for every optimizer the strategy
        wraps (``bucket_cap_mb``, ``compression``, ``overlap``, ...; the keys of
        :class:`~pyro_distributed.integrations.lightning.OptimizerOptions`), checked here.
        Each optimizer gets its own copy of ``comm_hook``: a hook keeps its
        state for one optimizer (read it from ``strategy.optimizers``).
    :param start_method: how Lightning starts the workers: ``None`` (default)
        is ``"fork"`` in a Jupyter kernel and ``"popen"`` (a script's own
        launcher) elsewhere. With ``"fork"``, ``"spawn"`` or ``"forkserver"``,
        what the workers trained comes back to the launching process when
        fitting ends: the module's parameters, the param store, and every
        worker's owned local rows, joined.

    The other arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s.

    Example::

        import lightning.pytorch as pl
        from pyro_distributed.integrations.lightning import PyroDistributedStrategy

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
        :class:`~pyro_distributed.integrations.lightning.IndexedDataset`. Create a lazily
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
        only).

    .. warning::
        In a Jupyter kernel (forked workers), what the workers trained comes
        back to the kernel's own objects: parameters the workers created in
        the module's ``setup()`` are created in the kernel by running
        ``setup("fit")`` there (once, after training, without the workers'
        process group) before their values are loaded. A parameter first
        created inside a training step cannot come back: ``fit`` raises,
        naming it. If loading fails, the folder holding what the workers
        trained is kept and the error names it; :meth:`load_trained` loads it.

    .. warning::
        Forked workers run torch on one thread each (as torch's DataLoader
        workers do): GNU OpenMP's thread pool does not survive ``fork()``, and
        a worker of a kernel that has run a multi-threaded op would hang at its
        first. For more threads per worker, ``start_method="spawn"`` with the
        module importable from a file.
    """

    strategy_name = "pyro_distributed"

    def __init__(
        self,
        *,
        engine: str = "auto",
        own_local_params: bool = False,
        local_updates: str = "dense",
        shuffle: bool | None = None,
        seed: int = 0,
        optimizer_options: OptimizerOptions | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] | None = None,
    ) -> None:
        check_engine_name(engine, "PyroDistributedStrategy", local=False)
        check_bool("own_local_params", own_local_params)
        self.local_updates = check_local_updates(
            local_updates, own_local_params, "PyroDistributedStrategy"
        )
        check_bool("shuffle", shuffle, optional=True)
        check_int("seed", seed)
        options = check_optimizer_options(optimizer_options, "PyroDistributedStrategy")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            # In a kernel, forked workers (Lightning refuses its script launcher there).
            start_method=start_method or ("fork" if internals.in_a_kernel() else "popen"),
        )
        self._engine_name = launch.resolve_engine(engine)
        self._engine: Engine | None = None
        self._steps_checked = 0  # training steps so far, until the first sync check
        self._observations: int | None = None  # of an scvi-tools splitter taken over
        self.own_local_params = own_local_params
        # Training steps run inside it: one messenger, re-entered at every step.
        self._shards = shard_subsamples(
            by_block=own_local_params,
            own_local_params=own_local_params,
            local_updates=self.local_updates,
        )
        self.shuffle, self.seed = shuffle, seed
        self._optimizer_options = options
        self._resumption: checkpoints.Resumption | None = None  # the checkpoint being loaded
        self._resumed_rng: Mapping[str, Any] | None = None  # restored at the first batch
        #: What a checkpoint holds for a Pyro plan's optimizer, handed to it once
        #: on_train_start has wrapped it; and the file, for messages.
        self._pyro_resumption: tuple[Mapping[str, Any], str] | None = None

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

    @property
    def _launcher_starts_workers(self) -> bool:  # horovodrun, mpiexec: no torch process group
        return self._engine_name != "auto" and engine_class(self._engine_name).launches_own_workers

    def _configure_launcher(self) -> None:
        if self._launcher_starts_workers:
            self._launcher = None  # horovodrun or mpiexec started every worker itself
            return
        super()._configure_launcher()
        if isinstance(self._launcher, internals.MultiProcessingLauncher):
            # Forked or spawned workers: what they train comes back to this process.
            self._launcher = kernel.KernelLauncher(self, self._start_method)

    def setup_environment(self) -> None:
        """The device, then the workers (DDP's set-up calls :meth:`setup_distributed`
        once the device is chosen). An scvi-tools data splitter then leaves the
        split to the strategy (:func:`anndata.split_by_the_strategy`) and, with
        ``own_local_params``, keeps this worker's block of observations
        (:func:`anndata.take_over_splitter`)."""
        assert self.cluster_environment is not None
        if self._launcher_starts_workers:  # horovodrun, mpiexec: the engine has the ranks
            self._engine = runtime.init(self._engine_name)
            launcher = engine_class(self._engine_name).launcher
            workers = self._engine.world_size
            launch.check_devices(self.num_nodes, self.num_processes, workers, launcher)
            # Ranks from the engine, so that each worker takes its own device.
            self.cluster_environment = launch.LauncherEnvironment(self._engine, self.num_processes)
        elif self.cluster_environment.creates_processes_externally:  # torchrun, srun
            workers = self.cluster_environment.world_size()
            launch.check_devices(self.num_nodes, self.num_processes, workers, "the launcher")
        super().setup_environment()
        if self.lightning_module is not None:
            datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
            anndata.split_by_the_strategy(datamodule, own_local_params=self.own_local_params)
            if self.own_local_params:
                self._observations = anndata.take_over_splitter(datamodule)

    def setup_distributed(self) -> None:
        """The workers, once the device is chosen. With ``engine="horovod"`` or
        ``"mpi"`` the engine that :meth:`setup_environment` started, and no torch
        process group; otherwise Lightning's process group (made by DDP's
        set-up, over an interface the other hosts reach:
        :func:`launch.reach_other_hosts`), then the engine on it."""
        if self._launcher_starts_workers:
            assert self._engine is not None  # started by setup_environment
            internals.set_rank_zero(self._engine.rank)
            self._check_world_size()
            return
        launch.reach_other_hosts(self.cluster_environment, self.num_nodes)
        super().setup_distributed()
        self._engine = runtime.init(self._engine_name)
        self._check_world_size()
        atexit.register(collectives.leave_together, self._engine)

    def _check_world_size(self) -> None:
        assert self._engine is not None
        launch.check_world_size(self._engine, self.world_size)

    # -- the module and the optimizers: no DDP wrapper

    def setup(self, trainer: Any) -> None:
        """DDP's set-up without the ``DistributedDataParallel`` wrapper."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        wanted = self._layer_sync if fitting else None  # sync_batchnorm: applied, or refused
        self.model = layer_sync.apply(wanted, self.model, self.root_device, self.engine)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        collectives.broadcast_module(self.engine, self.model)
        internals.disable_sampler_injection(trainer)
        if self.own_local_params:
            guides.shard_guide_warmups(trainer.callbacks)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            internals.optimizers_to_device(self.optimizers, self.root_device)

    def on_train_start(self) -> None:
        """Wrap the optimizer of every ``SVI`` the module holds (:mod:`.plans`)."""
        super().on_train_start()
        assert self.lightning_module is not None
        plans.distribute_svi_optimizers(self.lightning_module, self.engine, self._optimizer_options)
        self._steps_checked = 0
        pending, self._pyro_resumption = self._pyro_resumption, None
        pyro_optim = pyro_state.pyro_optimizer(self.lightning_module)
        if pending is not None and isinstance(pyro_optim, FrontEnd):
            # Wrapped just now: its step count, hook and step policy from the file.
            entries, shown = pending
            checkpoints.check_extensions(entries, [], self.engine, shown, pyro_optim)
            checkpoints.restore_extensions(entries, [], self.engine, shown, pyro_optim)
            steps = (entries.get(checkpoints.KEY) or {}).get("pyro_optim_steps")
            if steps is not None:
                pyro_optim.num_steps = steps

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """After the first step, check that the workers' parameters agree; on the
        first batch of a resumed run, restore the checkpoint's RNG states."""
        super().on_train_batch_start(batch, batch_idx)
        self._restore_rng_at_first_batch()
        self._steps_checked += 1
        if self._steps_checked == 2:
            self._check_in_sync("after the first training step")

    def on_train_end(self) -> None:
        super().on_train_end()
        self._check_in_sync("when training ended")

    def _check_in_sync(self, when: str) -> None:
        assert self.lightning_module is not None
        if not plans.at_a_sync_point(self.lightning_module, self.optimizers):
            return  # a step policy's workers differ between its sync points, by design
        plans.check_in_sync(self.lightning_module, self.engine, when)

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
            # multi_tensor is for pyro.optim optimizers: torch's step theirs together.
            options: dict[str, Any] = dict(self._optimizer_options)
            options.pop("multi_tensor", None)
            # A hook that keeps state serves one optimizer: each gets a copy.
            options["comm_hook"] = copy.deepcopy(options.get("comm_hook"))
            # So does a step policy (DiLoCo keeps each optimizer's period start).
            options["step_policy"] = copy.deepcopy(options.get("step_policy"))
            wrapped = DistributedTorchOptimizer(optimizer, engine=self.engine, **options)
        wrapped.engine  # noqa: B018 (bind now, before Lightning wraps it in a LightningOptimizer)
        return wrapped

    # -- steps: subsampling sharded, local parameters owned

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._shards:
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.own_local_params:  # local rows are read by their block's global indices
            return super().validation_step(*args, **kwargs)
        with self._shards:
            return super().validation_step(*args, **kwargs)

    # -- data: this library's samplers

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader with :class:`~pyro_distributed.ShardSampler`,
        evaluation and prediction loaders with
        :class:`~pyro_distributed.integrations.lightning.data.EvaluationSampler`
        (:func:`.data.shard_loader`); with ``own_local_params``, scvi-tools'
        loaders keep this worker's block
        (:func:`~pyro_distributed.integrations.scvi.anndata.owned_loader`). A
        training loader gets a generator of its own (see the checkpoint hooks)."""
        stage = self.lightning_module.trainer.state.stage if self.lightning_module else None
        return data.prepare_loader(
            dataloader, self.engine, stage, shuffle=self.shuffle, seed=self.seed,
            own_local_params=self.own_local_params, observations=self._observations,
        )  # fmt: skip

    # -- checkpoints, every worker's part included: lightning/checkpoints.py
    #
    # A resumed fit restores the RNG states where the resumed run first draws
    # for training: at its first batch (on_train_batch_start), not when the
    # checkpoint is loaded. Between the two the resumed run does what the
    # uninterrupted one did not: it starts a new DataLoader iterator and runs
    # the hooks that start training (scvi-tools' guide warm-up draws from the
    # global RNG). Training loaders get a generator of their own
    # (data.with_own_generator), so an iterator's base seed is never drawn
    # from the global RNG, in either run. Draws made in hooks that Lightning
    # calls before the strategy's on_train_batch_start (callbacks' and the
    # module's, on that batch) are not covered. Outside a fit (validate,
    # predict) the states are restored when the checkpoint is loaded.

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

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        # Lightning 2.6 passes weights_only=; 2.4 and 2.5 pass the path alone.
        weights_only = kwargs.get("weights_only", args[0] if args else None)
        # Where the blocks are, and whether they may be unpickled in full.
        self._resumption = checkpoints.Resumption.of(checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The module, this worker's rows of local parameters re-partitioned for
        this world size, and its RNG states if the world size is the saved one."""
        module = self.lightning_module
        assert module is not None
        if self.own_local_params:  # a Pyro plan's lazily built guide: its parameters, cut
            guides.create_guide_params(module, getattr(module.trainer, "datamodule", None))
        state = checkpoints.module_state(checkpoint, self._resumption, module, self.engine)
        super().load_model_state_dict({**checkpoint, "state_dict": state}, strict=strict)
        if module.trainer.state.fn == TrainerFn.FITTING:  # where the resumed run first draws
            self._resumed_rng = {checkpoints.KEY: checkpoint.get(checkpoints.KEY)}
        else:
            checkpoints.restore_rng(checkpoint, self.engine)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None and self._resumption is not None
        where = self._resumption.where
        shown = "Lightning's checkpoint" if where is None else repr(str(where))
        found = pyro_state.pyro_optimizer(self.lightning_module)
        # A Pyro plan's optimizer is wrapped when training starts (on_train_start,
        # after this): what the file holds for it is handed over then.
        pyro_optim = found if isinstance(found, FrontEnd) else None
        if found is not None and pyro_optim is None:
            self._pyro_resumption = ({checkpoints.KEY: checkpoint.get(checkpoints.KEY)}, shown)
        checkpoints.check_extensions(checkpoint, self.optimizers, self.engine, shown, pyro_optim)
        saved = checkpoint.get(checkpoints.KEY) or {}
        pyro_state.restore_pyro_optimizer(  # a Pyro plan's optimizer (scvi-tools')
            self.lightning_module,
            saved.get("pyro_optim") or {},
            self._resumption.rows,
            saved.get("pyro_optim_steps"),
        )
        states = checkpoints.optimizer_states(checkpoint, self._resumption)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})
        checkpoints.restore_counts(checkpoint, self.optimizers)
        checkpoints.restore_extensions(checkpoint, self.optimizers, self.engine, shown, pyro_optim)

    def _restore_rng_at_first_batch(self) -> None:
        """On the first training batch after a restore, the checkpoint's RNG states
        (see the comment that opens the checkpoint hooks)."""
        if self._resumed_rng is not None:
            checkpoints.restore_rng(self._resumed_rng, self.engine)
            self._resumed_rng = None

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

    # -- what forked workers trained, loaded by hand

    @staticmethod
    def load_trained(folder: str | os.PathLike[str], module: torch.nn.Module | None) -> None:
        """Load what workers forked from a kernel trained, from the folder that a
        failed load kept (the error names it): the param store with every owned
        row, and, with ``module``, its parameters, buffers and every owned local
        row (for an scvi-tools model, ``None``: its Pyro parameters are in the
        param store). The module must have every trained parameter already.

        :raises PyroDistributedError: naming the parameters ``module`` lacks.
        """
        kernel.load_trained(folder, module)

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
