"""Reading local parameters back: this worker's rows, or all N of them."""

from __future__ import annotations

from typing import Any

import pyro
import torch
from torch import Tensor
from torch.distributions import constraints, transform_to

from .. import runtime
from ..checks import check_choice
from ..gather import Destination, gather_pieces
from .registry import LocalParam, local_of, local_param, module_constraint, unconstrained
from .store import length_along


def _check_named(caller: str, name: Any, module: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{caller}: name must be a parameter's name (a string), got {name!r}")
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(f"{caller}: module must be a torch.nn.Module or None, got {module!r:.60}")


def _named(name: str, module: torch.nn.Module | None) -> tuple[LocalParam | None, Tensor]:
    """The record (``None`` if not local) and the value of parameter ``name``.

    ``name`` is a param-store name, or the name Pyro gives a PyroModule's
    parameter in ``module_local_params`` mode (``"AutoNormal.locs.z"``): the
    value is then constrained. With ``module``, ``name`` is one that
    ``module.named_parameters()`` gives, and the value is that unconstrained
    parameter.
    """
    if module is not None:
        held = dict(module.named_parameters()).get(name)
        if held is None:
            raise KeyError(f"{type(module).__name__} has no parameter named {name!r}")
        return local_of(held), held.detach()
    store = pyro.get_param_store()
    if name in store:
        return local_param(name), store[name].detach()
    tensor = unconstrained(name)
    if tensor is None:
        raise KeyError(
            f"no parameter named {name!r} in the param store, nor a local parameter of a "
            f"PyroModule of that name; for a module's own names, pass module="
        )
    constraint = module_constraint(name) or constraints.real
    return local_param(name), transform_to(constraint)(tensor).detach()


def local_rows(name: str, *, module: torch.nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """This worker's rows of a parameter, and where they sit in the whole.

    Returns ``(global_indices, rows)``: the global index of each row along the
    plate, and the (constrained) values. For a parameter that is not local,
    every row: ``(arange(n), value)`` along its first axis.

    :param name: a param-store name, or the name Pyro gives a PyroModule's
        parameter (``"AutoNormal.locs.z"``); with ``module``, a name from
        ``module.named_parameters()`` (``"guide.locs.z_unconstrained"``),
        whose unconstrained rows are returned.

    Example::

        indices, locs = pd.local_rows("AutoNormal.locs.z")
        predictions[indices] = decode(locs)   # this worker's data points
    """
    _check_named("local_rows", name, module)
    param, value = _named(name, module)
    if param is None:
        return torch.arange(len(value), device=value.device), value
    length = length_along(value, param)
    rows = param.rows
    if length != len(rows):
        raise ValueError(
            f"local parameter {name!r} holds {length} rows, not this worker's block of "
            f"{len(rows)}: it has not been used under shard_subsamples(own_local_params=True)"
        )
    return torch.arange(rows.start, rows.stop, device=value.device), value


def gather_param(
    name: str, *, to: Destination = "main", module: torch.nn.Module | None = None
) -> Tensor | None:
    """A local parameter's N rows, in their original order, on worker 0.

    A collective: every worker sends its block in turn and worker 0 copies it
    into place, so it never holds more than the result and one block. Other
    workers return ``None`` (with ``to="all"``, every worker gets the result).
    For a parameter that is not local, its (replicated) value. ``name`` and
    ``module`` are as for :func:`local_rows`.

    Example::

        locs = pd.gather_param("AutoNormal.locs.z")   # every worker calls it
        if pd.is_main():
            torch.save(locs, "posterior_means.pt")

    .. warning::
        A collective: call it on every worker, with the same name.
    """
    _check_named("gather_param", name, module)
    check_choice("gather_param: to", to, ("main", "all"))
    param, value = _named(name, module)
    engine = runtime.current_engine()
    if param is None:
        return value if to == "all" or engine.rank == 0 else None
    _, mine = local_rows(name, module=module)
    gathered = gather_pieces(engine, {name: mine}, {name: param.axis}, to)
    return None if gathered is None else gathered[name]
