"""The checkpoint hooks of :class:`~pyro_distributed.lightning.PyroDistributedStrategy`.

Lightning saves and restores through its strategy's hooks; these hand each
to :mod:`pyro_distributed.lightning.checkpoints`, which writes every worker's
RNG states and blocks of local parameters beside Lightning's file, and puts
them back on resume.

The RNG states are restored twice on a resumed run. First when the module is
restored (:meth:`CheckpointHooks.load_model_state_dict`), for what draws
before the first batch: at an epoch's end, the next epoch's DataLoader
iterator takes its base seed from the global RNG, in the resumed run as in
the uninterrupted one. Then, if the run resumes mid-epoch, again at the
first resumed batch (:meth:`CheckpointHooks._restore_rng_mid_epoch`, from the
strategy's ``on_train_batch_start``): the states were saved at the end of
the batch before, and since then the resumed run made a new iterator, which
drew from them, where the uninterrupted run went on with its old one. Draws
made in the hooks that Lightning calls before the strategy's
``on_train_batch_start`` (callbacks' and the module's) are not covered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from ..engines import Engine
from . import checkpoints

__all__ = ["CheckpointHooks"]


class CheckpointHooks(DDPStrategy):
    """DDP's strategy with checkpoints that hold every worker's part (a base class)."""

    _resumption: checkpoints.Resumption | None = None
    _resumed_rng: Mapping[str, Any] | None = None  # restored again mid-epoch

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
        assert self.lightning_module is not None
        state = checkpoints.module_state(checkpoint, self._resumption, self.lightning_module)
        super().load_model_state_dict({**checkpoint, "state_dict": state}, strict=strict)
        checkpoints.restore_rng(checkpoint, self.engine)
        self._resumed_rng = {checkpoints.KEY: checkpoint.get(checkpoints.KEY)}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoints.optimizer_states(checkpoint, self._resumption)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})
        checkpoints.restore_counts(checkpoint, self.optimizers)

    def _restore_rng_mid_epoch(self, batch_idx: int) -> None:
        """On the first batch after a restore, the checkpoint's RNG states again if
        the run resumed mid-epoch (``batch_idx > 0``; see the module's docstring)."""
        if self._resumed_rng is not None:
            if batch_idx > 0:
                checkpoints.restore_rng(self._resumed_rng, self.engine)
            self._resumed_rng = None
