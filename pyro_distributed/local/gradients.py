"""What the optimizer does with local parameters' gradients at each step.

A local parameter's gradient never travels. Replicated, its rows would be
averaged with W-1 zero contributions; :func:`scale_local_grads` applies the
scaling the exchange applies to an average (given by the caller, the
optimizer step: ``GradientSync.average_alone_``), so the rows come out
bitwise as the replicated path computes them, at any W.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..consensus import ABSENT, require_agreement
from ..engines import Engine
from .registry import (
    LocalParam,
    any_registered,
    local_of,
    local_param,
    pop_touched,
    registered,
)
from .sparse import RowGradients

#: Turns a gradient, in place, into what averaging it with W-1 zeros gives.
Scale = Callable[[Tensor], Tensor]


def split_local(named: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``named`` split into (replicated, local); the local ones by their own names
    (param-store names, or the names their PyroModule gives them)."""
    if not any_registered():
        return dict(named), {}
    replicated: dict[str, Tensor] = {}
    local: dict[str, Tensor] = {}
    for name, param in named.items():
        record = local_of(param)
        if record is None:
            replicated[name] = param
        else:
            local[record.name] = param
    return replicated, local


def scale_local_grads(params: Mapping[str, Tensor], scale: Scale) -> bool:
    """Scale local gradients as an average, in place; return whether all are finite.

    ``scale`` is what averaging a gradient with W-1 zero contributions does
    to it, bitwise (the exchange's own scaling). Only the rows selected since
    the last step can be non-zero, so only those are scaled and checked:
    O(batch) work instead of O(N/W).
    """
    finite = True
    for name, param in params.items():
        touched = pop_touched(name)
        record = local_param(name, param)
        grad = param.grad
        if grad is None:
            continue
        if touched is None or record is None:
            scale(grad)
            finite = finite and bool(torch.isfinite(grad).all())
            continue
        axis = record.axis % grad.dim()
        rows = torch.unique(torch.cat(touched))
        scaled = scale(grad.index_select(axis, rows))
        grad.index_copy_(axis, rows, scaled)
        finite = finite and bool(torch.isfinite(scaled).all())
    return finite


def scale_row_grads(sparse: Sequence[RowGradients], scale: Scale) -> bool:
    """Scale sparse steps' row gradients as an average; return whether all are finite (O(rows)).

    ``scale`` is the one the step gives dense local gradients (what averaging
    with W-1 zeros does, the exchange's own scaling), so the rows get the
    same bits as a dense local gradient's.
    """
    finite = True
    for gradients in sparse:
        scale(gradients.grad)
        finite = finite and bool(torch.isfinite(gradients.grad).all())
    return finite


def nonfinite_rows(sparse: Sequence[RowGradients]) -> list[str]:
    """The names of the parameters whose row gradient holds NaN or Inf."""
    return [g.name for g in sparse if not bool(torch.isfinite(g.grad).all())]


class LocalGradients:
    """What the optimizer does with local parameters' gradients at each step."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._agreed: set[str] = set()

    def prepare(self, params: Mapping[str, Tensor], scale: Scale, also_finite: bool = True) -> bool:
        """Scale the gradients with ``scale`` (:func:`scale_local_grads`); return
        whether this worker's are finite.

        ``also_finite``: whether this worker's gradients checked elsewhere
        (sparse local rows, :mod:`pyro_distributed.optim.sparse_step`) are
        finite; it joins the result.

        The first time a local parameter reaches the optimizer, the workers
        compare its plate (a collective); a different size on some worker is
        an error on every worker. Whether any worker's local gradient is NaN
        or Inf then travels with the gradient exchange's header
        (``GradientSync.exchange(..., nonfinite_here=...)``), so that every
        worker skips (or refuses) the step together at no extra round trip.
        """
        fresh = sorted(name for name in params if name not in self._agreed)
        if fresh:
            _check_plates_agree(self._engine, {name: registered(name) for name in fresh})
            self._agreed.update(fresh)
        return scale_local_grads(params, scale) and also_finite


def _check_plates_agree(engine: Engine, params: dict[str, LocalParam]) -> None:
    require_agreement(
        engine,
        {name: (p.plate, p.size, p.axis) for name, p in params.items()},
        message=lambda name, split: (
            f"workers disagree on local parameter {name!r} ({split}); a local "
            f"parameter's plate must have the same size on every worker"
        ),
        describe=lambda value: (
            "not a local parameter" if value is ABSENT else f"plate {value[0]!r} of size {value[1]}"
        ),
    )
