"""The rows of a sparse local step: which rows a step read, and their gradient.

Under ``pd.shard_subsamples(own_local_params=True, local_updates="sparse")``
an owned local parameter costs O(rows selected) a step, not O(N/W).
:func:`draw_rows` draws a step's rows of the block in O(batch);
:func:`select_rows` hands the model and guide a fresh leaf,
``unconstrained[rows]``, and records ``(rows, leaf)``, so backward fills the
leaf and the block tensor's ``.grad`` stays ``None``; :func:`take_gradients`
turns a parameter's recorded leaves into one :class:`RowGradients` (distinct
rows, sorted; a row read twice gets the sum, as the dense gradient would).
The lazy step on those rows, and its rules per optimizer, is
:mod:`pyro_distributed.optim.sparse_step`; the user's guide is
``docs/guide/local-parameters.md``. ``local_updates="dense"`` (the default)
never enters this module.

.. warning::
    The sparse step is *lazy*, like ``torch.optim.SparseAdam``: a row that
    is not in a step's batch keeps its value and its optimizer state, so
    the result differs from the dense step with Adam or momentum. See
    :mod:`pyro_distributed.optim.sparse_step` for each optimizer's rule and
    the optimizers and options it refuses.

.. warning::
    Rows are recorded when a local parameter is read with gradients enabled,
    and consumed by the next optimizer step. Read local parameters for a
    step only inside ``svi.step`` (or between the torch optimizer's steps).
    ``zero_grad()`` drops the leaves' gradients but not the reads, so a loss
    computed before it and backpropagated after it is stepped.

.. warning::
    A sparse local parameter's gradient is in its leaves, not in ``.grad``:
    code that reads or changes ``.grad`` between backward and step (your own
    ``clip_grad_norm_``, a gradient-norm log) does not see it. Clipping
    inside the optimizer (Pyro's ``clip_args``, ClippedAdam's ``clip_norm``)
    does.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributions import constraints, transform_to

from ..errors import PyroDistributedError
from ..pyro_internals import attach_unconstrained
from . import registry
from .registry import LocalParam
from .store import unconstrained_and_constraint

LocalUpdates = Literal["dense", "sparse"]
#: The values ``shard_subsamples(local_updates=...)`` accepts.
LOCAL_UPDATES: tuple[str, ...] = ("dense", "sparse")


def check_local_updates(
    local_updates: object, own_local_params: bool, where: str = "shard_subsamples"
) -> LocalUpdates:
    """``local_updates`` if it is valid with ``own_local_params``; else an error
    naming it and ``where`` it was passed.

    :raises TypeError: when it is not a string.
    :raises ValueError: when it is neither ``"dense"`` nor ``"sparse"``, or
        ``"sparse"`` without ``own_local_params=True`` (only owned rows can be
        stepped alone: replicated rows are averaged in full).
    """
    if not isinstance(local_updates, str):
        raise TypeError(
            f"{where}: local_updates must be 'dense' or 'sparse', "
            f"got {type(local_updates).__name__} {local_updates!r}"
        )
    if local_updates == "dense":
        return "dense"
    if local_updates != "sparse":
        raise ValueError(
            f"{where}: local_updates must be 'dense' or 'sparse', got {local_updates!r}"
        )
    if not own_local_params:
        raise ValueError(
            f"{where}: local_updates='sparse' needs own_local_params=True "
            "(only rows a worker owns can be stepped without the others)"
        )
    return "sparse"


#: Below this many block rows per drawn row, one permutation of the block is
#: cheaper than rejecting repeats, and it is what the dense mode draws.
PERMUTE_BELOW = 64


def draw_rows(length: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` distinct rows of ``range(length)``, uniformly at random, in O(count).

    The dense mode draws ``torch.randperm(length)[:count]``, O(length), which
    on a large block costs more than the rest of a sparse step. Here rows are
    drawn with replacement and a row seen before is drawn again, in rounds,
    keeping first sightings in order: the same as drawing one row at a time
    from those not yet drawn, so every ordered choice of ``count`` distinct
    rows is equally likely. The expected work is O(count) while ``count`` is a
    small fraction of ``length``; for a large fraction (``length <
    PERMUTE_BELOW * count``) the permutation is cheap, and used, so that a
    batch of a whole block draws as the dense mode does.
    """
    device = generator.device  # the generator's: the CPU one for the library's own draws
    if length < PERMUTE_BELOW * count:
        return torch.randperm(length, generator=generator, device=device)[:count]
    chosen = torch.randint(length, (count,), generator=generator, device=device)
    while True:
        distinct, position = torch.unique(chosen, return_inverse=True)
        if len(distinct) == len(chosen):
            return chosen
        # The first sighting of each row, in the order drawn.
        order = torch.arange(len(chosen), device=device)
        first = torch.full((len(distinct),), len(chosen), device=device).scatter_reduce_(
            0, position, order, reduce="amin"
        )
        kept = chosen[first.sort().values]
        fresh = torch.randint(length, (count - len(kept),), generator=generator, device=device)
        chosen = torch.cat([kept, fresh])


@dataclass
class _Uses:
    """The rows of one local parameter read since its last step, and their leaves."""

    tensor: weakref.ref[Tensor]
    param: LocalParam
    uses: list[tuple[Tensor, Tensor]]


# Param-store name -> the reads waiting for the next optimizer step.
_pending: dict[str, _Uses] = {}


def pending_reads(name: str) -> list[tuple[Tensor, Tensor]]:
    """The reads of ``name`` waiting for the next step: (block-relative rows, the
    leaf they were handed out as). For diagnostics and tests; do not edit them."""
    entry = _pending.get(name)
    return [] if entry is None else list(entry.uses)


def select_rows(
    param: LocalParam,
    indices: Tensor,
    module_tensor: Tensor | None = None,
    constraint: Any = None,
) -> Tensor:
    """The constrained rows ``indices`` (global) of an owned parameter, for a sparse step.

    Like :func:`pyro_distributed.local.store.select_rows`, but the rows are
    copied into a new leaf tensor first: backward then fills the leaf's
    small gradient and leaves the block tensor's ``.grad`` alone. Outside
    gradient recording (``torch.no_grad()``, as in ``Predictive``) nothing is
    recorded. The value still carries the block tensor (``.unconstrained``),
    which is how SVI finds the parameters to hand to the optimizer.

    :param module_tensor: the parameter's unconstrained ``nn.Parameter`` when
        it lives on a PyroModule (``module_local_params``), with its
        ``constraint``; otherwise both come from the param store.
    """
    unconstrained, constraint = unconstrained_and_constraint(param, module_tensor, constraint)
    rows = (indices - param.rows.start).to(unconstrained.device)
    axis = param.axis % unconstrained.dim()
    selected = unconstrained.detach().index_select(axis, rows)
    if torch.is_grad_enabled():
        selected.requires_grad_(True)
        entry = _pending.get(param.name)
        if entry is None or entry.tensor() is not unconstrained:
            entry = _pending[param.name] = _Uses(weakref.ref(unconstrained), param, [])
        entry.uses.append((rows, selected))
    value: Tensor = transform_to(constraint or constraints.real)(selected)
    attach_unconstrained(value, unconstrained)
    return value


@dataclass
class RowGradients:
    """One local parameter's gradient on the rows selected since its last step.

    :param name: the param-store name.
    :param tensor: the param store's block tensor (unconstrained).
    :param axis: the plate's axis in ``tensor`` (non-negative).
    :param rows: the distinct rows (block-relative), sorted.
    :param grad: their summed gradient: ``tensor``'s shape with ``len(rows)``
        along ``axis``.
    """

    name: str
    tensor: Tensor
    axis: int
    rows: Tensor
    grad: Tensor


def any_pending() -> bool:
    """Whether any sparse read waits for a step (a cheap first test: without
    one, no optimizer needs to look at its parameters for rows)."""
    return bool(_pending)


def take_gradients(params: list[Tensor]) -> tuple[list[Tensor], list[RowGradients]]:
    """Split ``params`` into (the rest, the row gradients of sparse local parameters).

    Consumes the reads recorded for each parameter, found by identity: a
    param-store tensor or a PyroModule's ``nn.Parameter`` alike. A sparse
    parameter whose reads got no gradient (its loss term did not depend on
    it, or no backward pass followed) is left out of both, as the dense
    optimizer skips a parameter whose ``.grad`` is ``None``, unless it has a
    dense ``.grad`` of its own (a dense step after such a read): then it is
    in the rest. Reads of parameters not in ``params`` wait for a later call.
    """
    if not _pending:
        return params, []
    waiting = {id(e.tensor()): name for name, e in _pending.items() if e.tensor() is not None}
    rest: list[Tensor] = []
    sparse: list[RowGradients] = []
    for tensor in params:
        name = waiting.get(id(tensor))
        entry = _pending.get(name) if name is not None else None
        if name is None or entry is None or entry.tensor() is not tensor:
            rest.append(tensor)
            continue
        del _pending[name]
        gradients = _summed(name, tensor, entry)
        if gradients is not None:
            sparse.append(gradients)
        elif tensor.grad is not None:
            # Read sparsely without a backward pass through it (a warm-up call,
            # a logged loss), then stepped densely: the dense step's, as always.
            rest.append(tensor)
    # Reads of parameters that have since been replaced (a checkpoint load,
    # pyro.clear_param_store()) can never be stepped.
    stale = [n for n, e in _pending.items() if e.tensor() is not registry.unconstrained(n)]
    for name in stale:
        del _pending[name]
    return rest, sparse


def clear_gradients(tensors: Iterable[Tensor]) -> None:
    """Drop the gradients of the leaves handed out for ``tensors``, as ``zero_grad``
    drops a dense ``.grad``: a backward pass before it does not count.

    The reads themselves stay recorded, so that a loss computed before
    ``zero_grad()`` and backpropagated after it is stepped, as it is dense.
    """
    if not _pending:
        return
    ids = {id(tensor) for tensor in tensors}
    for entry in _pending.values():
        if id(entry.tensor()) in ids:
            for _, leaf in entry.uses:
                leaf.grad = None


def _summed(name: str, tensor: Tensor, entry: _Uses) -> RowGradients | None:
    pieces = [(rows, leaf.grad) for rows, leaf in entry.uses if leaf.grad is not None]
    if not pieces:
        return None
    dense = tensor.grad
    if dense is not None:
        # A dense step just before this one (a switch from local_updates="dense")
        # leaves a zeroed .grad (Pyro's zero_grads, zero_grad(set_to_none=False)),
        # which adds nothing: drop it. Checked in O(N/W) only then: a sparse
        # step leaves .grad None.
        if bool(dense.count_nonzero()):
            raise PyroDistributedError(
                f"local parameter {name!r} has a dense gradient under "
                f"local_updates='sparse': read it only through its plate inside "
                f"shard_subsamples(local_updates='sparse')"
            )
        tensor.grad = None
    axis = entry.param.axis % tensor.dim()
    rows = torch.cat([rows for rows, _ in pieces])
    grads = torch.cat([grad for _, grad in pieces], dim=axis)
    distinct, position = torch.unique(rows, sorted=True, return_inverse=True)
    shape = list(grads.shape)
    shape[axis] = len(distinct)
    # Summed in the order the reads happened, as autograd accumulates a dense
    # gradient: a row read once gets exactly its leaf's gradient (0 + g = g).
    summed = grads.new_zeros(shape).index_add_(axis, position, grads)
    return RowGradients(name, tensor, axis, distinct, summed)


def drop_reads(names: Iterable[str] | None = None) -> None:
    """Drop the recorded reads (of ``names``, or all): their parameters were replaced."""
    if names is None:
        _pending.clear()
        return
    for name in names:
        _pending.pop(name, None)
