"""Every reach into Lightning's private names, in one place.

Read this file when Lightning is upgraded (it is pinned in the ``lightning``
extra); ``tests/lightning/test_internals.py`` fails, naming the installed
version, when one of these moves.

* The trainer's ``use_distributed_sampler`` flag: Lightning would otherwise
  wrap every loader in its own ``DistributedSampler`` before the strategy
  sees it, and a strategy cannot tell that sampler from one the user chose.
  The strategy turns the flag off and gives loaders its own samplers
  (:meth:`PyroDistributedStrategy.process_dataloader`).
* ``_update_dataloader``: Lightning's way to rebuild a user's DataLoader
  (including subclasses) with another sampler, which also keeps the index
  tracking that ``trainer.predict`` relies on.
* ``_IndexBatchSamplerWrapper``: the batch sampler through which
  ``trainer.predict`` records which rows each batch held. The strategy gives
  the plain batch sampler inside it another sampler (``BatchSampler.sampler``
  is public), since rebuilding the loader would lose the wrapper.
* ``_optimizers_to_device``: moves optimizer state to the strategy's device,
  as Lightning's own strategies do.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, Sampler

__all__ = ["disable_sampler_injection", "optimizers_to_device", "with_sampler"]


def disable_sampler_injection(trainer: Any) -> None:
    """Stop ``trainer`` from replacing loaders' samplers with ``DistributedSampler``."""
    trainer._accelerator_connector.use_distributed_sampler = False


def with_sampler(
    loader: DataLoader[Any], sampler: Sampler[int], stage: RunningStage | None
) -> DataLoader[Any]:
    """``loader`` rebuilt with ``sampler``, as Lightning rebuilds loaders (a
    prediction loader keeps its index-recording batch sampler)."""
    tracking = loader.batch_sampler
    if isinstance(tracking, _IndexBatchSamplerWrapper):
        inner = tracking._batch_sampler
        if not isinstance(inner, BatchSampler):
            raise TypeError(
                f"trainer.predict's loader has a batch sampler of type "
                f"{type(inner).__name__}; PyroDistributedStrategy splits only plain ones"
            )
        inner.sampler = sampler
        return loader
    rebuilt: DataLoader[Any] = _update_dataloader(loader, sampler, mode=stage)
    return rebuilt


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move every optimizer's state to ``device``."""
    _optimizers_to_device(optimizers, device)
