"""Checkpoints that every worker can resume from, written without races.

Two kinds, one pair of functions: a run with a Pyro optimizer saves the param
store (:mod:`.param_store`); a run with a torch optimizer saves the module it
trains (:mod:`.modules`). Both hold the optimizer's state, every worker's RNG
state and the step count, write local parameters' blocks beside the file, and
share how files are written and read (:mod:`.files`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..checks import check_bool, check_path
from ..optim.distributed import DistributedOptimizer
from ..optim.torch_optimizer import DistributedTorchOptimizer
from . import modules, param_store

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(
    path: str | os.PathLike[str],
    optim: DistributedOptimizer | DistributedTorchOptimizer,
    *,
    module: torch.nn.Module | None = None,
    schedulers: Sequence[Any] = (),
) -> None:
    """Write a checkpoint of this training run to ``path`` (worker 0 writes it).

    :param path: where to write; its directory must exist on worker 0. A
        symbolic link is written through: the file it leads to is replaced.
    :param optim: the distributed optimizer of the run.
    :param module: with a torch optimizer (Pyro's torch-native loop), the
        module it trains, for example the ELBO module ``Trace_ELBO()(model,
        guide)``: its parameters and buffers are saved.
    :param schedulers: with a torch optimizer, its learning-rate schedulers,
        whose state is saved too (a Pyro optimizer's schedulers are part of it).
    :raises TypeError: if ``path`` is not a ``str`` or ``os.PathLike``.
    :raises PyroDistributedError: on every worker, if worker 0 could not write
        the file, or ``path`` leads to anything but a regular file or a new
        path (a device, a directory). The previous file there is left intact.

    Example::

        if step % 100 == 0:
            pyro_distributed.save_checkpoint("run.pt", optim)
            # torch-native: save_checkpoint("run.pt", optimizer, module=loss_fn)

    .. warning::
        Call it on every worker at the same step: it is a collective.
    """
    check_path("path", path)
    if isinstance(optim, DistributedTorchOptimizer):
        modules.save(path, optim, _required(module), list(schedulers))
        return
    _check_pyro_optim(optim, module, schedulers)
    param_store.save(path, optim)


def load_checkpoint(
    path: str | os.PathLike[str],
    optim: DistributedOptimizer | DistributedTorchOptimizer,
    *,
    missing_ok: bool = False,
    module: torch.nn.Module | None = None,
    schedulers: Sequence[Any] = (),
    strict: bool = True,
    trusted: bool = False,
) -> int:
    """Restore a checkpoint on every worker; returns the step count it was saved at.

    Afterwards every worker holds identical parameters and optimizer state.
    Each worker's RNG state is restored when the world size matches the one
    the checkpoint was written with; otherwise RNG states are left alone.

    :param path: the checkpoint; only worker 0 needs to be able to read it.
    :param optim: the distributed optimizer of the run being resumed.
    :param missing_ok: if worker 0 finds no file, change nothing and return 0
        on every worker: the one flag a restartable script needs (see below).
    :param module: with a torch optimizer, the module it trains (as saved).
    :param schedulers: with a torch optimizer, its schedulers (as saved).
    :param strict: refuse a checkpoint whose parameter names differ from the
        model's, in either direction (default). Parameters that do not exist
        yet (a guide's, before its first call) are compared at the next step,
        which raises before it changes anything. ``False`` loads the
        parameters both share and leaves the rest; shapes, dtypes and
        constraints of shared names must still agree.
    :param trusted: unpickle the file in full, which can run any code it
        holds. Off by default: checkpoints hold data only (tensors, numbers,
        strings, and torch's and Pyro's constraint classes) and are read with
        ``torch.load(weights_only=True)``. Needed for state of your own classes,
        and for files written by pyro_distributed 0.x (format version 3).
    :raises FileNotFoundError: on every worker, if worker 0 finds no file and
        ``missing_ok`` is false.
    :raises TypeError: if ``path`` is not a ``str`` or ``os.PathLike``.
    :raises ValueError: on every worker, before anything changes, if the file
        is damaged or truncated, is not a checkpoint, lacks an entry or holds
        one of the wrong type (named), needs a class it may not load (named),
        holds parameters whose names, shapes, dtypes or constraints contradict
        the model's (a checkpoint of a different model), or optimizer state
        that the optimizer cannot take (another optimizer's, or of another
        shape).
    :raises PyroDistributedError: on every worker, if any worker cannot read
        a block file it needs (naming the worker and the file).

    Example, a script that ``torchrun --max-restarts 3`` can restart at any
    time and that finishes as if it had never stopped::

        start = pyro_distributed.load_checkpoint("run.pt", optim, missing_ok=True)
        for step in range(start, num_steps):
            svi.step(data)
            if (step + 1) % 100 == 0:
                pyro_distributed.save_checkpoint("run.pt", optim)

    .. warning::
        Call it on every worker at the same point: it is a collective. Pass
        ``trusted=True`` only for files you trust as you trust code.
    """
    check_path("path", path)
    check_bool("strict", strict)
    check_bool("trusted", trusted)
    check_bool("missing_ok", missing_ok)
    if isinstance(optim, DistributedTorchOptimizer):
        return modules.load(
            path,
            optim,
            _required(module),
            list(schedulers),
            missing_ok,
            trusted=trusted,
            strict=strict,
        )
    _check_pyro_optim(optim, module, schedulers)
    return param_store.load(path, optim, missing_ok, trusted=trusted, strict=strict)


def _required(module: torch.nn.Module | None) -> torch.nn.Module:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"a checkpoint of a torch optimizer's run needs module=, the torch.nn.Module it "
            f"trains (the ELBO module, say); got {module!r}"
        )
    return module


def _check_pyro_optim(optim: object, module: object, schedulers: Sequence[Any]) -> None:
    if not isinstance(optim, DistributedOptimizer):
        raise TypeError(
            f"optim must be the run's DistributedOptimizer (or HorovodOptimizer), "
            f"got {type(optim).__name__}"
        )
    if module is not None or schedulers:
        raise TypeError(
            "module= and schedulers= are for runs with a torch optimizer; a Pyro "
            "optimizer's checkpoint holds the param store and its own schedulers"
        )
