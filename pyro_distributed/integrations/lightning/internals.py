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
* ``rank_zero_only.rank``: which process Lightning's ``rank_zero_*``
  helpers treat as worker 0. DDP sets it from its device count; under
  ``horovodrun`` the strategy sets it from Horovod's rank.
* ``_optimizers_to_device``: moves optimizer state to the strategy's device,
  as Lightning's own strategies do.
* ``_is_local_file_protocol``: whether a checkpoint path is on the local file
  system (and can have block files beside it) or an fsspec URL, as Lightning
  itself decides.
* ``_MultiProcessingLauncher``, ``_IS_INTERACTIVE``: Lightning's launcher of
  forked or spawned workers, the one that works in a Jupyter kernel, and its
  own test for a kernel. The strategy subclasses the launcher to carry what
  the workers trained back to the kernel (:mod:`.kernel`), and picks it where
  Lightning would refuse its script launcher. The subclass overrides the
  launcher's ``_wrapping_function`` (each worker's entry point),
  ``_collect_rank_zero_results`` and ``_recover_results_in_main_process``, and
  blanks the ``weights_path`` of the ``_WorkerOutput`` that worker 0 returns.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities import rank_zero as fabric_rank_zero
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero as pytorch_rank_zero
from lightning.pytorch.utilities.data import _update_dataloader
from lightning_utilities.core import rank_zero as utilities_rank_zero
from torch.utils.data import BatchSampler, DataLoader, Sampler


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


def set_rank_zero(rank: int) -> None:
    """Tell Lightning's ``rank_zero_only`` helpers this process's global rank."""
    for module in (utilities_rank_zero, fabric_rank_zero, pytorch_rank_zero):
        module.rank_zero_only.rank = rank


def is_local_path(path: Any) -> bool:
    """Whether ``path`` is on the local file system (not an fsspec URL such as ``s3://``)."""
    return bool(_is_local_file_protocol(path))


#: Lightning's launcher of forked or spawned workers (notebook-compatible).
MultiProcessingLauncher = _MultiProcessingLauncher


def in_a_kernel() -> bool:
    """Whether this process is an interactive interpreter (a Jupyter kernel), as
    Lightning decides it when it refuses a script launcher there."""
    return bool(_IS_INTERACTIVE)
