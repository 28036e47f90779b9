"""What a Lightning checkpoint of a Pyro training plan needs beyond the module's ``state_dict``.

A plan in scvi-tools' pattern (``PyroTrainingPlan``: ``self.svi = SVI(model,
guide, pyro_optim, loss)``, a stand-in torch optimizer for Lightning) keeps
its optimizer state in the Pyro optimizer, which Lightning never sees, and
creates its guide's parameters lazily, at the first call. Resuming such a
plan needs both:

* :func:`pyro_optimizer_state` and :func:`restore_pyro_optimizer`: the Pyro
  optimizer's state, global parameters' in Lightning's file and each local
  parameter's rows in its worker's block file (as a torch optimizer's rows
  are, :mod:`pyro_distributed.integrations.lightning.checkpoints`), handed back with
  ``PyroOptim.set_state``, which applies it as each parameter appears;
* the guide's parameters created, local ones cut to this worker's block,
  before Lightning restores the module (it restores after ``setup()`` and
  before the first step), from one batch of the plan's own training loader:
  :func:`pyro_distributed.integrations.scvi.guides.create_guide_params`.
"""

from __future__ import annotations

from typing import Any

from pyro.optim import PyroOptim

from ...checkpoint.modules import ModuleLocal, module_locals


def pyro_optimizer(module: Any) -> PyroOptim | None:
    """The Pyro optimizer of ``module.svi`` (scvi-tools' plans), if it has one."""
    optim = getattr(getattr(module, "svi", None), "optim", None)
    return optim if isinstance(optim, PyroOptim) else None


def pyro_optimizer_state(
    module: Any, local: dict[str, ModuleLocal]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Pyro optimizer's state: ``(global, rows)``, the global parameters'
    by param-store name and each local parameter's by its module name (its rows
    travel in the block files)."""
    optim = pyro_optimizer(module)
    if optim is None:
        return {}, {}
    state = optim.get_state()
    by_pyro_name = {held.pyro_name: name for name, held in local.items()}
    rows = {by_pyro_name[key]: value for key, value in state.items() if key in by_pyro_name}
    shared = {key: value for key, value in state.items() if key not in by_pyro_name}
    return shared, rows


def pyro_optimizer_steps(module: Any) -> int | None:
    """The step count of the plan's distributed Pyro optimizer (its drift checks' schedule)."""
    return getattr(pyro_optimizer(module), "num_steps", None)


def restore_pyro_optimizer(
    module: Any, shared: dict[str, Any], rows: dict[str, Any], steps: int | None
) -> None:
    """Hand the saved state (``shared`` by param-store name, ``rows`` by module
    name, and the step count) to the plan's Pyro optimizer."""
    optim = pyro_optimizer(module)
    if optim is None:
        return
    if steps is not None and hasattr(optim, "num_steps"):
        optim.num_steps = steps
    if not (shared or rows):
        return
    local = module_locals(module)
    state = dict(shared)
    state.update({local[name].pyro_name: value for name, value in rows.items() if name in local})
    optim.set_state(state)
