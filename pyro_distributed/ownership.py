"""Local variational parameters, each row held by the worker that owns its data.

A guide with one set of variational parameters per data point (per-cell
abundances, per-document topic weights, per-group effects) declares them as
``pyro.param(name, init, event_dim=k)`` inside a subsampled plate, or gets them
from an AutoGuide built with ``create_plates``. Replicated, every worker holds
all N rows and their optimizer state, and averages an N-row gradient every
step, although only the worker whose data a row belongs to ever touches it.

Under ``pd.shard_subsamples(own_local_params=True)`` a plate of size N is cut
into W contiguous blocks (:func:`~pyro_distributed.data.block_range`), worker
r draws its subsamples from block r only, and the rows of every local
parameter outside block r never exist on worker r:

* the param store, and so the optimizer, hold the block's rows only;
* a local parameter's gradient never travels. Replicated, its rows would be
  averaged with W-1 zero contributions, which is the owner's gradient times
  1/W; :func:`scale_local_grads` multiplies by exactly that factor, so the
  rows come out bitwise as the replicated path computes them;
* :func:`gather_param` and :func:`local_rows` read the result, and the
  checkpoints (:mod:`pyro_distributed.checkpoint`) save each block where its
  worker writes it and re-partition blocks for another number of workers.

This module keeps the record of which parameters are local (:class:`LocalParam`)
and does the row bookkeeping; the effect handler that applies it to Pyro's
``param`` and plate messages is :class:`~pyro_distributed.shard_subsamples`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyro
import torch
from torch import Tensor
from torch.distributions import constraints, transform_to

from . import runtime
from .data import block_range
from .engines import Engine
from .errors import PyroDistributedError
from .gather import Destination, gather_pieces

__all__ = [
    "LocalGradients",
    "LocalParam",
    "create",
    "forget",
    "gather_param",
    "local_param",
    "local_params",
    "local_rows",
    "localize",
    "register",
    "scale_local_grads",
    "split_local",
    "state_bytes",
]


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
# Rows of each owned parameter selected since the last optimizer step: the
# only rows its gradient can be non-zero in (Pyro's SVI zeroes gradients after
# each step), so the only ones the optimizer needs to scale and check.
_touched: dict[str, list[Tensor]] = {}


def _stored(name: str) -> Tensor | None:
    """The param store's unconstrained tensor for ``name`` (Pyro's own map: the
    public getters compute the constrained value, O(N) for a large parameter)."""
    tensor: Tensor | None = pyro.get_param_store()._params.get(name)
    return tensor


def local_param(name: str, tensor: Tensor | None = None) -> LocalParam | None:
    """``name``'s record if it is local: registered for ``tensor`` (default: the
    param store's current tensor of that name)."""
    entry = _local.get(name)
    if entry is None:
        return None
    current = tensor if tensor is not None else _stored(name)
    return entry[0] if current is not None and entry[1]() is current else None


def local_params() -> dict[str, LocalParam]:
    """The parameters that are local in this process, by param-store name."""
    return {name: param for name in list(_local) if (param := local_param(name)) is not None}


def register(param: LocalParam) -> None:
    """Record ``param``, as the param store holds it now, as local; while it is,
    the same name must keep the same plate and size."""
    known = local_param(param.name)
    if known is not None and known != param:
        raise ValueError(
            f"local parameter {param.name!r} was declared along plate {known.plate!r} of "
            f"size {known.size} (axis {known.axis}) and is now used along plate "
            f"{param.plate!r} of size {param.size} (axis {param.axis})"
        )
    tensor = _stored(param.name)
    if tensor is None:
        raise KeyError(f"no parameter named {param.name!r} in the param store")
    _local[param.name] = (param, weakref.ref(tensor))


def forget(names: Iterable[str]) -> None:
    """Drop the record of these parameters (after a checkpoint replaced them)."""
    for name in names:
        _local.pop(name, None)
        _touched.pop(name, None)


def create(param: LocalParam, init: Any, constraint: Any) -> None:
    """Create ``param`` with all its rows, if it does not exist yet."""
    store = pyro.get_param_store()
    if param.name not in store:
        if init is None:
            raise ValueError(f"parameter {param.name!r} does not exist and has no init")
        value = init() if callable(init) else init
        _length_along(value, param)
        store.setdefault(param.name, value, constraint or constraints.real)
    stored = _stored(param.name)
    assert stored is not None
    length = _length_along(stored, param)
    if length != param.size:
        raise ValueError(
            f"parameter {param.name!r} has {length} rows along plate {param.plate!r} "
            f"(axis {param.axis}); it needs the plate's size {param.size}"
        )


def localize(param: LocalParam, init: Any = None, constraint: Any = None) -> None:
    """Make the param store hold only this worker's rows of ``param``.

    A new parameter is created from its block of ``init`` (a tensor or a
    callable, with the plate's size or the block's length along the plate).
    One created in full (an AutoGuide creates its parameters outside the
    plates) is cut to the block here, once; its unconstrained values are sliced
    as they are, so that every row keeps its bits.
    """
    store = pyro.get_param_store()
    if param.name not in store:
        if init is None:
            raise ValueError(f"local parameter {param.name!r} does not exist and has no init")
        value = init() if callable(init) else init
        store.setdefault(param.name, _block_of(param, value), constraint or constraints.real)
        return
    unconstrained = _stored(param.name)
    assert unconstrained is not None
    if _length_along(unconstrained, param) != len(param.rows):
        replace_unconstrained(param.name, _block_of(param, unconstrained.detach()).clone())


def _block_of(param: LocalParam, value: Tensor) -> Tensor:
    """This worker's rows of ``value``, which has all ``size`` rows or the block's."""
    length, rows = _length_along(value, param), param.rows
    if length == len(rows):
        return value
    if length != param.size:
        raise ValueError(
            f"local parameter {param.name!r} has {length} rows along plate {param.plate!r} "
            f"(axis {param.axis} of shape {list(value.shape)}); it needs the plate's size "
            f"{param.size}, or worker {runtime.rank()}'s block of {len(rows)} rows"
        )
    return value.narrow(param.axis, rows.start, len(rows))


def replace_unconstrained(name: str, value: Tensor) -> None:
    """Put ``value`` in the param store as ``name``'s unconstrained tensor, as it is.

    Pyro's public setters go through the constraint's transform and its
    inverse, which changes bits; the store's two private maps are set instead.
    """
    store = pyro.get_param_store()
    old = store._params.get(name)
    if old is not None:
        store._param_to_name.pop(old, None)
    value = value.detach().requires_grad_(True)
    if isinstance(old, torch.nn.Parameter):
        # PyroModule keeps its parameters as nn.Parameter and would swap in a
        # new wrapper (a new tensor to the optimizer) on its next read.
        value = torch.nn.Parameter(value)
    store._params[name] = value
    store._param_to_name[value] = name


def _length_along(tensor: Tensor, param: LocalParam) -> int:
    if tensor.dim() < -param.axis:
        raise ValueError(
            f"local parameter {param.name!r} of shape {list(tensor.shape)} has no axis "
            f"{param.axis} for plate {param.plate!r}"
        )
    return int(tensor.shape[param.axis])


def select_rows(param: LocalParam, indices: Tensor, owned: bool) -> Tensor:
    """The constrained rows ``indices`` (global) of a block-drawn parameter, as a
    value that Pyro's SVI can trace back to its unconstrained tensor.

    The rows are selected first and only then constrained, unlike Pyro's plate,
    which constrains all N rows and then selects. Besides costing O(batch)
    instead of O(N), this keeps the values bitwise independent of how many
    rows the tensor holds: vectorised kernels can round a row differently
    depending on where it falls in the tensor, so a worker holding only its
    block could otherwise drift from the replicated run in the last bit.
    """
    store = pyro.get_param_store()
    # Not store[name]: that would constrain all the rows, to select a few.
    unconstrained = _stored(param.name)
    if unconstrained is None:
        raise KeyError(f"no parameter named {param.name!r} in the param store")
    offset = param.rows.start if owned else 0
    rows = (indices - offset).to(unconstrained.device)
    selected = unconstrained.index_select(param.axis % unconstrained.dim(), rows)
    if owned and torch.is_grad_enabled():
        _touched.setdefault(param.name, []).append(rows)
    # Pyro has no public getter for a parameter's constraint.
    constraint = store._constraints[param.name]
    value: Tensor = transform_to(constraint)(selected)
    # What Pyro's own plate attaches to a subsampled parameter.
    value.unconstrained = weakref.ref(unconstrained)  # type: ignore[attr-defined]
    value._pyro_unconstrained_param = unconstrained  # type: ignore[attr-defined]
    return value


def split_local(params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """``params`` split into (replicated, local) by their param-store names."""
    if not _local:
        return list(params), []
    store = pyro.get_param_store()
    replicated: list[Tensor] = []
    local: list[Tensor] = []
    for param in params:
        name = store.param_name(param)
        is_local = name is not None and local_param(name, param) is not None
        (local if is_local else replicated).append(param)
    return replicated, local


def scale_local_grads(params: Iterable[Tensor], world_size: int) -> bool:
    """Multiply local gradients by 1/W, in place; return whether all are finite.

    1/W is what averaging them with W-1 zero contributions gives, and bitwise
    so: the average is computed as a sum, which adds exact zeros, times 1/W.
    Only the rows selected since the last step can be non-zero, so only those
    are scaled and checked: O(batch) work instead of O(N/W).
    """
    factor = 1.0 / world_size
    store = pyro.get_param_store()
    finite = True
    for param in params:
        name = store.param_name(param)
        touched = _touched.pop(name, None) if name is not None else None
        record = local_param(name, param) if name is not None else None
        grad = param.grad
        if grad is None:
            continue
        if touched is None or record is None:
            grad.mul_(factor)
            finite = finite and bool(torch.isfinite(grad).all())
            continue
        axis = record.axis % grad.dim()
        rows = torch.unique(torch.cat(touched))
        scaled = grad.index_select(axis, rows).mul_(factor)
        grad.index_copy_(axis, rows, scaled)
        finite = finite and bool(torch.isfinite(scaled).all())
    return finite


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
    length = _length_along(value, param)
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


def state_bytes(parameters: Iterable[Tensor], optimizers: Iterable[Any]) -> int:
    """Bytes of ``parameters`` plus every tensor in the torch optimizers' state:
    what a worker holds for them (for example ``optim.optim_objs.values()``)."""
    total = sum(p.numel() * p.element_size() for p in parameters)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


class LocalGradients:
    """What the optimizer does with local parameters' gradients at each step."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._agreed: set[str] = set()

    def prepare(self, params: list[Tensor], also_finite: bool = True) -> bool:
        """Scale the gradients by 1/W; return whether every worker's are finite.

        ``also_finite``: whether this worker's gradients checked elsewhere
        (sparse local rows, :mod:`pyro_distributed.sparse_step`) are finite;
        it joins the same reduction, so that a step costs one either way.

        The first time a local parameter reaches the optimizer, the workers
        compare its plate (a collective); a different size on some worker is
        an error on every worker. Then one one-element reduction per step
        tells every worker whether any local gradient anywhere is NaN or Inf,
        so that all skip (or refuse) the step together.
        """
        store = pyro.get_param_store()
        names = [store.param_name(param) for param in params]
        fresh = sorted(name for name in names if name is not None and name not in self._agreed)
        if fresh:
            _check_plates_agree(self._engine, {name: _local[name][0] for name in fresh})
            self._agreed.update(fresh)
        finite = scale_local_grads(params, self._engine.world_size) and also_finite
        flag = torch.tensor([int(not finite)], dtype=torch.int64)
        self._engine.allreduce_([flag], op="max")
        return not bool(flag.item())


def _check_plates_agree(engine: Engine, params: dict[str, LocalParam]) -> None:
    views: list[dict[str, LocalParam]] = engine.allgather_object(params)
    for name in sorted(set().union(*views)):
        seen = {rank: view.get(name) for rank, view in enumerate(views)}
        if len({(p.plate, p.size, p.axis) if p else None for p in seen.values()}) > 1:
            shown = "; ".join(
                f"worker {rank}: "
                + (f"plate {p.plate!r} of size {p.size}" if p else "not a local parameter")
                for rank, p in seen.items()
            )
            raise PyroDistributedError(
                f"workers disagree on local parameter {name!r} ({shown}); a local "
                f"parameter's plate must have the same size on every worker"
            )
