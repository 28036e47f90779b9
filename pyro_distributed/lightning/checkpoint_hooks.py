"""The checkpoint hooks of :class:`~pyro_distributed.lightning.PyroDistributedStrategy`.

Lightning saves and restores through its strategy's hooks; these hand each
to :mod:`pyro_distributed.lightning.checkpoints`, which writes every worker's
RNG states and blocks of local parameters beside Lightning's file, and puts
them back on resume.

A resumed fit restores the RNG states where the resumed run first draws for
training: at its first batch (:meth:`CheckpointHooks._restore_rng_at_first_batch`,
from the strategy's ``on_train_batch_start``), not when the checkpoint is
loaded. Between the two, the resumed run does what the uninterrupted one did
not: it starts a new DataLoader iterator (at an epoch's start or mid-epoch)
and runs the hooks that start training (scvi-tools' guide warm-up draws
from the global RNG). Training loaders get a generator of their own
(:func:`~pyro_distributed.lightning.data.with_own_generator`), so an
iterator's base seed is never drawn from the global RNG, in either run.
Draws made in the hooks that Lightning calls before the strategy's
``on_train_batch_start`` (callbacks' and the module's, on that batch) are
not covered. Outside a fit (``validate``, ``predict``) the states are
restored when the checkpoint is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ..engines import Engine
from . import checkpoints, pyro_state

__all__ = ["CheckpointHooks"]


class CheckpointHooks(DDPStrategy):
    """DDP's strategy with checkpoints that hold every worker's part (a base class)."""

    _resumption: checkpoints.Resumption | None = None
    _resumed_rng: Mapping[str, Any] | None = None  # restored at the first training batch
    own_local_params: bool = False  # the strategy's

    @property
    def engine(self) -> Engine:
        raise NotImplementedError  # the strategy's

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

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        # Lightning 2.6 passes weights_only=; 2.4 and 2.5 pass the path alone.
        self._resumption = checkpoints.Resumption.of(checkpoint_path)  # where the blocks are
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

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
            self._resumed_rng = {checkpoints.KEY: checkpoint.get(checkpoints.KEY)}
        else:
            checkpoints.restore_rng(checkpoint, self.engine)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None and self._resumption is not None
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

    def _restore_rng_at_first_batch(self) -> None:
        """On the first training batch after a restore, the checkpoint's RNG states
        (see the module's docstring)."""
        if self._resumed_rng is not None:
            checkpoints.restore_rng(self._resumed_rng, self.engine)
            self._resumed_rng = None
