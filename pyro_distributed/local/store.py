"""Surgery on where local parameters live: creating them, cutting them to this
worker's block, and handing the model the rows it selected.

A local parameter lives in Pyro's param store, or, in ``module_local_params``
mode, on its PyroModule as an ``nn.Parameter``. There it is cut to the block
in place (``param.data``), so the module, and any torch optimizer already
built over it, keep the same parameter object.
"""

from __future__ import annotations

from typing import Any

import pyro
import torch
from torch import Tensor
from torch.distributions import constraints, transform_to

from .. import runtime
from ..pyro_internals import (
    attach_unconstrained,
    param_constraint,
    replace_unconstrained,
    stored_unconstrained,
)
from .registry import LocalParam, touch


def create(
    param: LocalParam, init: Any, constraint: Any, module_tensor: Tensor | None = None
) -> None:
    """Create ``param`` with all its rows, if it does not exist yet (or check that
    ``module_tensor``, a module's parameter, has them)."""
    if module_tensor is not None:
        _check_full(param, module_tensor)
        return
    store = pyro.get_param_store()
    if param.name not in store:
        value = _initial(param, init, "parameter")
        length_along(value, param)
        store.setdefault(param.name, value, constraint or constraints.real)
    stored = stored_unconstrained(param.name)
    assert stored is not None
    _check_full(param, stored)


def _check_full(param: LocalParam, tensor: Tensor) -> None:
    length = length_along(tensor, param)
    if length != param.size:
        raise ValueError(
            f"parameter {param.name!r} has {length} rows along plate {param.plate!r} "
            f"(axis {param.axis}); it needs the plate's size {param.size}"
        )


def localize(
    param: LocalParam,
    init: Any = None,
    constraint: Any = None,
    module_tensor: Tensor | None = None,
) -> bool:
    """Make the param store (or ``module_tensor``) hold only this worker's rows of
    ``param``; return whether a module's parameter was cut just now.

    A new parameter is created from its block of ``init`` (a tensor or a
    callable, with the plate's size or the block's length along the plate).
    One created in full (an AutoGuide creates its parameters outside the
    plates) is cut to the block here, once; its unconstrained values are sliced
    as they are, so that every row keeps its bits.
    """
    if module_tensor is not None:
        if length_along(module_tensor, param) == len(param.rows):
            return False
        with torch.no_grad():
            module_tensor.data = _block_of(param, module_tensor.detach()).clone()
        return True
    store = pyro.get_param_store()
    if param.name not in store:
        value = _initial(param, init, "local parameter")
        store.setdefault(param.name, _block_of(param, value), constraint or constraints.real)
        return False
    unconstrained = stored_unconstrained(param.name)
    assert unconstrained is not None
    if length_along(unconstrained, param) != len(param.rows):
        replace_unconstrained(param.name, _block_of(param, unconstrained.detach()).clone())
    return False


def _initial(param: LocalParam, init: Any, what: str) -> Tensor:
    """The initial value of a parameter that does not exist yet."""
    if init is None:
        raise ValueError(f"{what} {param.name!r} does not exist and has no init")
    value: Tensor = init() if callable(init) else init
    return value


def _block_of(param: LocalParam, value: Tensor) -> Tensor:
    """This worker's rows of ``value``, which has all ``size`` rows or the block's."""
    length, rows = length_along(value, param), param.rows
    if length == len(rows):
        return value
    if length != param.size:
        raise ValueError(
            f"local parameter {param.name!r} has {length} rows along plate {param.plate!r} "
            f"(axis {param.axis} of shape {list(value.shape)}); it needs the plate's size "
            f"{param.size}, or worker {runtime.rank()}'s block of {len(rows)} rows"
        )
    return value.narrow(param.axis, rows.start, len(rows))


def length_along(tensor: Tensor, param: LocalParam) -> int:
    if tensor.dim() < -param.axis:
        raise ValueError(
            f"local parameter {param.name!r} of shape {list(tensor.shape)} has no axis "
            f"{param.axis} for plate {param.plate!r}"
        )
    return int(tensor.shape[param.axis])


def unconstrained_and_constraint(
    param: LocalParam, module_tensor: Tensor | None, constraint: Any
) -> tuple[Tensor, Any]:
    """``param``'s unconstrained tensor and its constraint: ``module_tensor`` and
    ``constraint`` when the parameter lives on a PyroModule, else the param
    store's (not ``store[name]``, which would constrain every row of the block
    to select a few)."""
    if module_tensor is not None:
        return module_tensor, constraint
    unconstrained = stored_unconstrained(param.name)
    if unconstrained is None:
        raise KeyError(f"no parameter named {param.name!r} in the param store")
    return unconstrained, param_constraint(param.name)


def select_rows(
    param: LocalParam,
    indices: Tensor,
    owned: bool,
    module_tensor: Tensor | None = None,
    constraint: Any = None,
) -> Tensor:
    """The constrained rows ``indices`` (global) of a block-drawn parameter, as a
    value that Pyro's SVI can trace back to its unconstrained tensor.

    The rows are selected first and only then constrained, unlike Pyro's plate,
    which constrains all N rows and then selects. Besides costing O(batch)
    instead of O(N), this keeps the values bitwise independent of how many
    rows the tensor holds: vectorised kernels can round a row differently
    depending on where it falls in the tensor, so a worker holding only its
    block could otherwise drift from the replicated run in the last bit.
    """
    unconstrained, constraint = unconstrained_and_constraint(param, module_tensor, constraint)
    offset = param.rows.start if owned else 0
    rows = (indices - offset).to(unconstrained.device)
    selected = unconstrained.index_select(param.axis % unconstrained.dim(), rows)
    if owned and torch.is_grad_enabled():
        touch(param.name, rows)
    value: Tensor = transform_to(constraint or constraints.real)(selected)
    attach_unconstrained(value, unconstrained)
    return value
