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

import pyro

from .. import runtime
from .module_buffers import named_buffers, trained_modules
from .reducer import FrontEnd, compare_across_workers


def assert_in_sync(optim: FrontEnd | None = None) -> None:
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
    if optim is not None and not callable(getattr(optim, "checked_tensors", None)):
        raise TypeError(
            f"assert_in_sync: optim must be a DistributedOptimizer, a "
            f"DistributedTorchOptimizer or None, got {optim!r:.60}"
        )
    if optim is not None:
        tensors, state = optim.checked_tensors(), optim.get_state()
        compare_across_workers(optim.engine, tensors, optim.checked_buffers(), state)
        return
    tensors = dict(pyro.get_param_store().named_parameters())
    buffers = dict(named_buffers(trained_modules(list(tensors.values()))))
    compare_across_workers(runtime.current_engine(), tensors, buffers, None)
