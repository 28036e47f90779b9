"""Every reach into scvi-tools' (and cell2location's) private names, in one place.

scvi-tools is never imported here: each function takes the object a user's
model hands over (a model, its Pyro module) and calls the private method on
it. ``tests/integrations/test_scvi_internals.py`` fails, naming the
installed versions, when an upgrade of scvi-tools or cell2location moves
one of them; read this file when upgrading.

* ``PyroBaseModuleClass._get_fn_args_from_batch``: a loader's batch (a dict
  of tensors) as the ``(args, kwargs)`` of the module's model and guide.
* ``PyroSampleMixin._get_obs_plate_sites``: the sites of the observation
  plate, with the plate's axis.
* cell2location's ``QuantileMixin._posterior_quantile``: a posterior's
  quantiles, computed on the observations that ``data_loader_indices`` picks.
* ``BaseModelClass._make_data_loader``: a loader over chosen observations.
* ``DataSplitter.data_loader_kwargs``: the keyword arguments a splitter hands
  its loaders, where ``distributed_sampler=True`` asks for a sampler that
  reads the torch process group.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np


def has_batch_args(module: Any) -> bool:
    """Whether ``module`` (an scvi-tools Pyro module) turns a batch into its model's arguments."""
    return callable(getattr(module, "_get_fn_args_from_batch", None))


def batch_args(module: Any, batch: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``(args, kwargs)`` of ``module``'s model and guide for one loader's ``batch``."""
    args, kwargs = module._get_fn_args_from_batch(batch)
    return tuple(args), dict(kwargs)


def obs_plate_sites(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
    """Each site of ``model``'s observation plate, with the plate's axis in its values."""
    sites: dict[str, int] = model._get_obs_plate_sites(args, kwargs, return_observed=True)
    return sites


def has_posterior_quantile(model: Any) -> bool:
    """Whether ``model`` computes quantiles of its posterior (cell2location's models do)."""
    return callable(getattr(model, "_posterior_quantile", None))


def posterior_quantile(model: Any, indices: np.ndarray, **kwargs: Any) -> dict[str, Any]:
    """``model``'s posterior quantiles, computed on the observations at ``indices`` in one batch."""
    values: dict[str, Any] = model._posterior_quantile(
        batch_size=len(indices), data_loader_indices=indices, **kwargs
    )
    return values


def data_loader(model: Any, indices: np.ndarray) -> Any:
    """A loader over ``model``'s AnnData at ``indices``, in order, in one batch."""
    return model._make_data_loader(
        adata=model.adata, indices=indices, shuffle=False, batch_size=len(indices)
    )


def without_distributed_sampler(splitter: Any) -> Any:
    """``splitter`` (an scvi-tools data splitter), or a shallow copy of it whose
    loaders take no distributed sampler: scvi-tools' ``BatchDistributedSampler``
    asks the torch process group for its world size, and a process without one
    (a kernel whose workers are gone) gets an error instead of a loader."""
    if not takes_distributed_sampler(splitter):
        return splitter
    alone = copy.copy(splitter)
    drop_distributed_sampler(alone)
    return alone


def takes_distributed_sampler(splitter: Any) -> bool:
    """Whether ``splitter`` hands its loaders ``distributed_sampler=True``."""
    kwargs = getattr(splitter, "data_loader_kwargs", None)
    return isinstance(kwargs, dict) and bool(kwargs.get("distributed_sampler"))


def drop_distributed_sampler(splitter: Any) -> None:
    """Make ``splitter`` hand its loaders no ``distributed_sampler`` (on this instance)."""
    kwargs = splitter.data_loader_kwargs
    splitter.data_loader_kwargs = {k: v for k, v in kwargs.items() if k != "distributed_sampler"}
