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
"""

from __future__ import annotations

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
