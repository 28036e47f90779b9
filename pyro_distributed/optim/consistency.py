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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyro
from torch import Tensor

from .. import runtime
from ..consensus import ABSENT, require_agreement
from ..digest import digest
from ..engines import Engine
from ..local.registry import local_params
from .module_buffers import named_buffers, trained_modules

if TYPE_CHECKING:
    from .front_end import FrontEnd


def assert_in_sync(optim: FrontEnd | None = None) -> None:
    """Raise on every worker if any parameter or optimizer state differs across workers.

    :param optim: compare this optimizer's parameters, per-parameter state
        and module buffers (and use its engine); without it, the param store
        and the buffers of the modules holding its parameters are compared.
        Under a step policy that lets workers step alone, the optimizer's
        state is each worker's own and is left out; call it at a sync point
        (``optim.in_sync``), where the parameters are identical.
    :raises PyroDistributedError: naming the first differing entry and which
        workers hold which version.

    Example::

        pyro_distributed.assert_in_sync(optim)   # e.g. after loading a checkpoint

    .. warning::
        A collective: call it on every worker at the same point.
    """
    if optim is not None and not callable(getattr(optim, "checked_tensors", None)):
        raise TypeError(
            f"assert_in_sync: optim must be a DistributedOptimizer, a "
            f"DistributedTorchOptimizer or None, got {optim!r:.60}"
        )
    if optim is not None:
        optim.check_in_sync()
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
    """:func:`~pyro_distributed.assert_in_sync` on what it reads: parameters
    (local ones left out: each worker holds its own rows), module buffers and,
    where given, optimizer state by parameter name."""
    local = local_params()
    values: dict[str, Any] = {
        f"parameter {name!r}": value for name, value in sorted(tensors.items()) if name not in local
    }
    values.update((f"buffer {name!r}", value) for name, value in buffers.items())
    if state is not None:
        values.update(
            (f"optimizer state of {name!r}", state[name])
            for name in sorted(state, key=str)
            if name not in local
        )
    require_identical(engine, values)


def _drifted(name: str, split: str) -> str:
    return f"workers have drifted apart: {name} differs ({split})"


def require_identical(
    engine: Engine,
    values: dict[str, Any],
    message: Callable[[str, str], str] = _drifted,
    absent: str = "none",
) -> None:
    """The drift check, the one every caller makes: a digest of each of
    ``values`` (by the label a message names it with), compared in one
    collective; every worker raises
    :class:`~pyro_distributed.PyroDistributedError` with ``message(label,
    split)`` for the first that differs (``absent`` where a worker lacks it).
    """
    require_agreement(
        engine,
        {label: digest(value) for label, value in values.items()},
        message=message,
        describe=lambda value: absent if value is ABSENT else f"version {value}",
    )
