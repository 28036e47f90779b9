"""The guide of an scvi-tools Pyro plan, set up on this worker's block of observations.

An scvi-tools Pyro module (``PyroBaseModuleClass``: ``module.guide``, run on
the arguments a batch gives) creates its guide's parameters lazily, at the
guide's first call. With owned observations that call must cut the local
parameters to this worker's block, and it must come before Lightning
restores a checkpoint or the launching process loads what the workers
trained. The strategy calls these at those moments:

* :func:`create_guide_params` as a worker sets up, before Lightning restores
  a checkpoint into the module;
* :func:`shard_guide_warmups` on scvi-tools' warm-up callbacks, whose guide
  call starts training;
* :func:`set_up_trained_guide` in the process that launched the workers,
  once their parameters are in its param store, without a process group.
"""

from __future__ import annotations

import weakref
from typing import Any

from ...data.subsample import shard_subsamples
from . import internals

# The warm-up callbacks already run under shard_subsamples.
_SHARDED: weakref.WeakSet[Any] = weakref.WeakSet()


def create_guide_params(plan: Any, datamodule: Any) -> None:
    """Run the guide of an scvi-tools Pyro plan on its first training batch, under
    ``shard_subsamples(own_local_params=True)``: every parameter exists, local
    ones cut to this worker's block, and the module holds the cut tensors."""
    module = getattr(plan, "module", None)
    guide = getattr(module, "guide", None)
    if guide is None or not internals.has_batch_args(module) or datamodule is None:
        return
    batch = next(iter(datamodule.train_dataloader()))
    args, kwargs = internals.batch_args(module, _to(batch, plan.device))
    with shard_subsamples(own_local_params=True):
        guide(*args, **kwargs)  # creates the parameters and cuts the local ones
        guide(*args, **kwargs)  # a PyroModule takes the cut tensors from the param store


def shard_guide_warmups(callbacks: list[Any]) -> None:
    """Run scvi-tools' guide warm-up callbacks (``PyroJitGuideWarmup``, which
    calls the guide on one training batch as training starts) under
    ``shard_subsamples(own_local_params=True)``: the batch is from this worker's
    block, and local parameters, once cut, exist only as the block's rows."""
    for callback in callbacks:
        if not type(callback).__module__.startswith("scvi.") or callback in _SHARDED:
            continue
        hook = callback.on_train_start

        def on_train_start(trainer: Any, module: Any, hook: Any = hook) -> None:
            with shard_subsamples(own_local_params=True):
                hook(trainer, module)

        callback.on_train_start = on_train_start
        _SHARDED.add(callback)


def set_up_trained_guide(plan: Any, datamodule: Any) -> None:
    """An scvi-tools Pyro plan's guide, set up here on one training batch: it takes
    the trained values from the param store. Its first call was in the workers,
    and ``export_posterior`` needs it set up."""
    module = getattr(plan, "module", None)
    guide = getattr(module, "guide", None)
    if datamodule is None or guide is None or not internals.has_batch_args(module):
        return
    if getattr(guide, "prototype_trace", 0) is not None:
        return  # set up already (or no autoguide)
    # The workers' process group is gone: a copy of the splitter that needs none
    # (scvi-tools' distributed_sampler=True would), set up here.
    splitter = internals.without_distributed_sampler(datamodule)
    splitter.setup("fit")
    batch = next(iter(splitter.train_dataloader()))
    args, kwargs = internals.batch_args(module, _to(batch, plan.device))
    guide(*args, **kwargs)  # every parameter exists in the store: none is drawn anew


def _to(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    return {key: value.to(device) for key, value in batch.items()}
