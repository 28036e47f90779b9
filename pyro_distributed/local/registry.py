"""Which parameters are local, along which plate, and which rows a step touched.

The record is per process, as the param store is: a parameter is local from
the moment :func:`register` records it, for the tensor the param store held
then. A parameter re-created under the same name (``pyro.clear_param_store()``,
say) is a new, global parameter until it is used in its plate again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyro
from torch import Tensor

from ..partition import block_range
from ..pyro_internals import stored_unconstrained


@dataclass(frozen=True)
class LocalParam:
    """A parameter whose rows along one plate are split across workers.

    :param plate: the plate's name.
    :param size: the plate's size N: the parameter's rows in the whole run.
    :param axis: the parameter's axis along the plate, counted from the right
        (the plate's dim minus the parameter's event_dim), so it holds for the
        constrained and the unconstrained value alike.
    """

    name: str
    plate: str
    size: int
    axis: int

    @property
    def rows(self) -> range:
        """This worker's block of ``range(size)``."""
        return block_range(self.size)


# Each local parameter, with the unconstrained tensor it was registered for:
# a parameter re-created under the same name (pyro.clear_param_store(), say)
# is a new parameter, not a local one, until it is used in its plate again.
_local: dict[str, tuple[LocalParam, weakref.ref[Tensor]]] = {}
# Local parameters that live on a PyroModule (module_local_params mode), not in
# the param store: by id of their tensor, their name and constraint.
_in_modules: dict[int, tuple[str, Any]] = {}
# Rows of each owned parameter selected since the last optimizer step: the
# only rows its gradient can be non-zero in (Pyro's SVI zeroes gradients after
# each step), so the only ones the optimizer needs to scale and check.
_touched: dict[str, list[Tensor]] = {}
# Counts changes to which tensors are local (not to the rows touched): a step
# that saw the same generation and the same tensors may reuse last step's split.
_generation = 0


def generation() -> int:
    """A number that changes whenever a tensor becomes, or stops being, local."""
    return _generation


def local_param(name: str, tensor: Tensor | None = None) -> LocalParam | None:
    """``name``'s record if it is local: registered for ``tensor`` (default: the
    param store's current tensor of that name, or the module's parameter)."""
    entry = _local.get(name)
    if entry is None:
        return None
    current = tensor if tensor is not None else unconstrained(name)
    return entry[0] if current is not None and entry[1]() is current else None


def unconstrained(name: str) -> Tensor | None:
    """The unconstrained tensor of local parameter ``name``, wherever it lives."""
    stored = stored_unconstrained(name)
    if stored is not None:
        return stored
    entry = _local.get(name)
    tensor = entry[1]() if entry is not None else None
    return tensor if tensor is not None and id(tensor) in _in_modules else None


def module_constraint(name: str) -> Any:
    """The constraint of a local parameter that lives on a module, else ``None``."""
    tensor = unconstrained(name)
    held = _in_modules.get(id(tensor)) if tensor is not None else None
    return held[1] if held is not None and held[0] == name else None


def local_of(tensor: Tensor) -> LocalParam | None:
    """The record of the local parameter whose unconstrained tensor is ``tensor``."""
    held = _in_modules.get(id(tensor))
    if held is not None:
        return local_param(held[0], tensor)
    name = pyro.get_param_store().param_name(tensor)
    return local_param(name, tensor) if name is not None else None


def local_params() -> dict[str, LocalParam]:
    """The parameters that are local in this process, by param-store name."""
    return {name: param for name in list(_local) if (param := local_param(name)) is not None}


def register(
    param: LocalParam, module_tensor: Tensor | None = None, constraint: Any = None
) -> None:
    """Record ``param``, as the param store holds it now (or as ``module_tensor``,
    the unconstrained parameter of a PyroModule, with its ``constraint``), as
    local; while it is, the same name must keep the same plate and size."""
    known = local_param(param.name)
    if known is not None and known != param:
        raise ValueError(
            f"local parameter {param.name!r} was declared along plate {known.plate!r} of "
            f"size {known.size} (axis {known.axis}) and is now used along plate "
            f"{param.plate!r} of size {param.size} (axis {param.axis})"
        )
    tensor = module_tensor if module_tensor is not None else stored_unconstrained(param.name)
    if tensor is None:
        raise KeyError(f"no parameter named {param.name!r} in the param store")
    entry = _local.get(param.name)
    if entry is not None and entry[1]() is tensor:
        # Read again at every step: recorded already, for this very tensor
        # (and so, as checked above, with this plate).
        if module_tensor is not None:
            _in_modules[id(module_tensor)] = (param.name, constraint)
        return
    global _generation
    _generation += 1
    if module_tensor is not None:
        _in_modules[id(module_tensor)] = (param.name, constraint)
        weakref.finalize(module_tensor, _in_modules.pop, id(module_tensor), None)
    _local[param.name] = (param, weakref.ref(tensor))


def unregister(names: Iterable[str]) -> None:
    """Drop the record of these parameters (after a checkpoint replaced them)."""
    global _generation
    _generation += 1
    for name in names:
        entry = _local.pop(name, None)
        tensor = entry[1]() if entry is not None else None
        if tensor is not None:
            _in_modules.pop(id(tensor), None)
        _touched.pop(name, None)


def any_registered() -> bool:
    """Whether any parameter was ever registered in this process (a cheap first test)."""
    return bool(_local)


def registered(name: str) -> LocalParam:
    """The record of ``name``, which must have been registered."""
    return _local[name][0]


def touch(name: str, rows: Tensor) -> None:
    """Record that this step selected ``rows`` (block-relative) of local parameter ``name``."""
    _touched.setdefault(name, []).append(rows)


def pop_touched(name: str) -> list[Tensor] | None:
    """The rows of ``name`` selected since the last call, forgetting them."""
    return _touched.pop(name, None)
