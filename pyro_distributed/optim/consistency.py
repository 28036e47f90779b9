"""Drift detection: are the workers' parameters and optimizer states still identical?

Averaging keeps workers bitwise identical only if everything else does too:
the same optimizer arguments, no per-worker edits to the param store, no
second-order optimizer working on a local Hessian. :func:`assert_in_sync`
checks, in one collective, a checksum of every parameter, every
per-parameter optimizer state and every buffer of the modules being trained
(:mod:`.module_buffers`: floating-point and integer ones), and names the
first that differs. Local parameters (:mod:`pyro_distributed.local`) are
left out: each worker holds its own rows of them.
"""

from __future__ import annotations

from typing import Any, Protocol

import pyro
from torch import Tensor

from .. import runtime
from ..consensus import ABSENT, require_agreement
from ..digest import digest
from ..engines import Engine
from ..local.registry import local_params
from .module_buffers import named_buffers, trained_modules


class Synchronised(Protocol):
    """What :func:`assert_in_sync` reads of an optimizer: its engine, the
    parameters it steps, their state and the buffers of the modules it
    trains, by names shared by every worker."""

    @property
    def engine(self) -> Engine: ...

    def checked_tensors(self) -> dict[str, Tensor]: ...

    def get_state(self) -> dict[str, Any]: ...

    def checked_buffers(self) -> dict[str, Tensor]: ...


def assert_in_sync(optim: Synchronised | None = None) -> None:
    """Raise on every worker if any parameter or optimizer state differs across workers.

    :param optim: compare this optimizer's parameters, per-parameter state
        and module buffers (and use its engine); without it, the param store
        and the buffers of the modules holding its parameters are compared.
    :raises PyroDistributedError: naming the first differing entry and which
        workers hold which version.

    Example::

        pyro_distributed.assert_in_sync(optim)   # e.g. after loading a checkpoint

    .. warning::
        A collective: call it on every worker at the same point.
    """
    if optim is not None:
        tensors, state = optim.checked_tensors(), optim.get_state()
        compare_across_workers(optim.engine, tensors, optim.checked_buffers(), state)
        return
    tensors = dict(pyro.get_param_store().named_parameters())
    buffers = dict(named_buffers(trained_modules(list(tensors.values()))))
    compare_across_workers(runtime.current_engine(), tensors, buffers, None)


def compare_across_workers(
    engine: Engine,
    tensors: dict[str, Tensor],
    buffers: dict[str, Tensor],
    state: dict[str, Any] | None,
) -> None:
    """:func:`assert_in_sync` on what it reads: parameters (local ones left
    out), module buffers and, where given, optimizer state by parameter name."""
    # Local parameters differ across workers by design: each holds its own rows.
    local = local_params()
    entries = [
        (f"parameter {name!r}", digest(value))
        for name, value in sorted(tensors.items())
        if name not in local
    ]
    entries += [(f"buffer {name!r}", digest(value)) for name, value in buffers.items()]
    if state is not None:
        entries += [
            (f"optimizer state of {name!r}", digest(state[name]))
            for name in sorted(state, key=str)
            if name not in local
        ]
    require_agreement(
        engine,
        dict(entries),
        message=lambda name, split: f"workers have drifted apart: {name} differs ({split})",
        describe=lambda value: "none" if value is ABSENT else f"version {value}",
    )
