"""Reading local parameters back: this worker's rows, or all N of them."""

from __future__ import annotations

import pyro
import torch
from torch import Tensor

from .. import runtime
from ..gather import Destination, gather_pieces
from .registry import LocalParam, local_param
from .store import length_along

__all__ = ["gather_param", "local_rows"]


def _named(name: str) -> tuple[LocalParam | None, Tensor]:
    store = pyro.get_param_store()
    if name not in store:
        raise KeyError(f"no parameter named {name!r} in the param store")
    return local_param(name), store[name].detach()


def local_rows(name: str) -> tuple[Tensor, Tensor]:
    """This worker's rows of a parameter, and where they sit in the whole.

    Returns ``(global_indices, rows)``: the global index of each row along the
    plate, and the (constrained) values. For a parameter that is not local,
    every row: ``(arange(n), value)`` along its first axis.

    Example::

        indices, locs = pd.local_rows("AutoNormal.locs.z")
        predictions[indices] = decode(locs)   # this worker's data points
    """
    param, value = _named(name)
    if param is None:
        return torch.arange(len(value)), value
    length = length_along(value, param)
    rows = param.rows
    if length != len(rows):
        raise ValueError(
            f"local parameter {name!r} holds {length} rows, not this worker's block of "
            f"{len(rows)}: it has not been used under shard_subsamples(own_local_params=True)"
        )
    return torch.arange(rows.start, rows.stop), value


def gather_param(name: str, *, to: Destination = "main") -> Tensor | None:
    """A local parameter's N rows, in their original order, on worker 0.

    A collective: every worker sends its block in turn and worker 0 copies it
    into place, so it never holds more than the result and one block. Other
    workers return ``None`` (with ``to="all"``, every worker gets the result).
    For a parameter that is not local, its (replicated) value.

    Example::

        locs = pd.gather_param("AutoNormal.locs.z")   # every worker calls it
        if pd.is_main():
            torch.save(locs, "posterior_means.pt")

    .. warning::
        A collective: call it on every worker, with the same name.
    """
    param, value = _named(name)
    engine = runtime.current_engine()
    if param is None:
        return value if to == "all" or engine.rank == 0 else None
    _, mine = local_rows(name)
    gathered = gather_pieces(engine, {name: mine}, {name: param.axis}, to)
    return None if gathered is None else gathered[name]
