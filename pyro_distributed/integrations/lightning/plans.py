"""LightningModules that step Pyro's ``SVI`` themselves, and the check that every worker agrees.

scvi-tools' ``PyroTrainingPlan``, the plan of every model built on its
``PyroSviTrainMixin`` (``AmortizedLDA``; cell2location's ``Cell2location``
and ``RegressionModel``), makes a ``pyro.infer.SVI`` with a ``pyro.optim``
optimizer in its ``__init__``, turns Lightning's automatic optimization off
and calls ``self.svi.step(...)`` in ``training_step``. Its
``configure_optimizers`` returns a torch optimizer over a dummy parameter,
only so that Lightning counts steps. The strategy's wrapping of
``configure_optimizers``' optimizers never reaches the SVI's, which would
step each worker's parameters on that worker's gradient alone.

:func:`distribute_svi_optimizers` finds every ``SVI`` that the module (or
one of its submodules) holds as an attribute and wraps its optimizer in
:class:`~pyro_distributed.DistributedOptimizer` on the strategy's engine, in
place: ``svi.optim``, and every attribute of the same object that held the
same optimizer (``plan.optim``), so the plan keeps one optimizer. One that
is a ``DistributedOptimizer`` already is kept. scvi-tools'
``LowLevelPyroTrainingPlan`` needs none of this: it returns a torch
optimizer from ``configure_optimizers``, which the strategy wraps.

Whatever else steps a parameter (an SVI made after training started, a
torch optimizer outside ``configure_optimizers``, an edit on one worker)
is caught by :func:`check_in_sync`, which the strategy runs after the first
training step and when training ends: every worker's digest of every
parameter of the module and of Pyro's param store (local parameters left
out: each worker holds its own rows) must agree, or every worker raises
:class:`~pyro_distributed.PyroDistributedError` naming the parameter.
Buffers (``BatchNorm`` statistics) are not compared here; making them
identical is the optimizer step's job.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyro
import torch
from pyro.infer import SVI
from pyro.optim import PyroOptim

from ...checkpoint.modules import module_locals
from ...engines import Engine
from ...errors import PyroDistributedError
from ...local.registry import local_params
from ...optim.consistency import require_identical
from ...optim.distributed import DistributedOptimizer
from ...optim.front_end import FrontEnd


def distribute_svi_optimizers(
    module: torch.nn.Module, engine: Engine, options: Mapping[str, Any]
) -> list[str]:
    """Wrap the optimizer of every ``SVI`` that ``module`` holds; the attributes wrapped.

    :param options: keyword arguments for each new ``DistributedOptimizer``.
    :raises PyroDistributedError: for an ``SVI`` whose optimizer is not a
        ``pyro.optim`` optimizer, naming where it is.
    """
    wrapped = []
    for where, owner, svi in _svis(module):
        optim = svi.optim
        if isinstance(optim, DistributedOptimizer):
            continue
        if not isinstance(optim, PyroOptim):
            raise PyroDistributedError(
                f"{where}.optim is a {type(optim).__name__}, not a pyro.optim optimizer, so "
                f"PyroDistributedStrategy cannot average its gradients across workers; "
                f"give the SVI a pyro.optim optimizer, or wrap it in "
                f"pd.DistributedOptimizer yourself"
            )
        # A hook or a step policy that keeps state serves one optimizer: each its own.
        own = {**options}
        for name in ("comm_hook", "step_policy"):
            if own.get(name) is not None:
                own[name] = copy.deepcopy(own[name])
        distributed = DistributedOptimizer(optim, engine=engine, **own)
        for name, value in list(vars(owner).items()):
            if value is optim:  # the plan's own reference to it (scvi-tools: plan.optim)
                setattr(owner, name, distributed)
        svi.optim = distributed
        wrapped.append(f"{where}.optim")
    return wrapped


def _svis(module: torch.nn.Module) -> Iterator[tuple[str, object, Any]]:
    """Every ``SVI`` held as an attribute of ``module`` or of a submodule, with where."""
    for prefix, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            if isinstance(value, SVI):
                where = f"{type(module).__name__}{'.' + prefix if prefix else ''}.{name}"
                yield where, submodule, value


def at_a_sync_point(module: torch.nn.Module, optimizers: Iterable[Any]) -> bool:
    """Whether every distributed optimizer of the run (``configure_optimizers``'
    and the module's SVIs') ended its last step at a sync point of its step
    policy: only then must the workers' parameters agree. The same on every
    worker (a policy decides from the step count)."""
    held = [svi.optim for _, _, svi in _svis(module)]
    return all(
        optimizer.in_sync for optimizer in [*optimizers, *held] if isinstance(optimizer, FrontEnd)
    )


def check_in_sync(module: torch.nn.Module, engine: Engine, when: str) -> None:
    """Raise on every worker if any parameter differs between workers (a collective).

    :param when: when the check runs, for the message ("after the first
        training step").
    """
    if engine.world_size == 1:
        return
    skipped = set(module_locals(module)) | set(local_params())
    view: dict[str, Any] = {
        f"parameter {name!r} of the module": param
        for name, param in module.named_parameters()
        if name not in skipped
    }
    for name, param in pyro.get_param_store().named_parameters():
        if name not in skipped:
            view[f"Pyro parameter {name!r}"] = param
    require_identical(
        engine,
        view,
        message=lambda item, split: (
            f"PyroDistributedStrategy: the workers' parameters differ {when}: {item} "
            f"({split}). Something stepped it outside the strategy's optimizers: every "
            f"optimizer must come from configure_optimizers or be an SVI's pyro.optim "
            f"optimizer held by the LightningModule when training starts (the strategy "
            f"wraps both), or be a pd.DistributedOptimizer"
        ),
        absent="absent",
    )
