"""``Trainer(sync_batchnorm=True)`` under the strategy: applied where it works, refused elsewhere.

Lightning turns ``sync_batchnorm=True`` into a layer sync that
:class:`~pyro_distributed.integrations.lightning.PyroDistributedStrategy` would otherwise
drop with DDP's set-up. torch's ``SyncBatchNorm`` computes each forward's
batch statistics over every worker's batch, through a torch process group,
on CUDA tensors only. So it is applied on CUDA with the torch engine, and
refused with an error naming ``sync_batchnorm`` on CPU and on the Horovod
and MPI engines (no torch process group), never ignored.

Without it, the optimizer still averages every floating-point buffer
(BatchNorm's running statistics) after every step
(:mod:`pyro_distributed.optim.module_buffers`), so the workers' modules stay
identical; what ``sync_batchnorm`` adds is normalising each batch with the
statistics of all the workers' batches.
"""

from __future__ import annotations

from typing import Any

import torch

from ...engines import Engine
from ...errors import PyroDistributedError


def apply(
    layer_sync: Any, model: torch.nn.Module, device: torch.device, engine: Engine
) -> torch.nn.Module:
    """``model`` with Lightning's ``layer_sync`` applied, or ``model`` if there is none.

    :raises PyroDistributedError: where ``SyncBatchNorm`` cannot work: off
        CUDA, or on an engine without a torch process group.
    """
    if layer_sync is None:
        return model
    if device.type != "cuda":
        raise PyroDistributedError(
            f"Trainer(sync_batchnorm=True) with PyroDistributedStrategy needs CUDA devices: "
            f"torch's SyncBatchNorm runs on GPUs only, and this run is on {device.type!r}. "
            f"Leave sync_batchnorm off: the strategy's optimizers average BatchNorm's "
            f"running statistics across workers after every step"
        )
    if engine.name != "torch":
        raise PyroDistributedError(
            f"Trainer(sync_batchnorm=True) with PyroDistributedStrategy needs the torch "
            f"engine: SyncBatchNorm uses a torch process group, which engine={engine.name!r} "
            f"does not have. Leave sync_batchnorm off, or use engine='torch'"
        )
    synced: torch.nn.Module = layer_sync.apply(model)
    return synced
