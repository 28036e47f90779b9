"""One multi-tensor optimizer step for all parameters that share settings.

``PyroOptim`` keeps one torch optimizer per parameter, so a guide with 400
small tensors pays for 400 Python-level ``step()`` calls every iteration. A
:class:`GroupedStepper` keeps one torch optimizer per distinct set of
hyper-parameters instead, with every member in a single parameter group and
``foreach=True``, so each step is a handful of multi-tensor kernels.

For Adam, AdamW, SGD, RMSprop, Adagrad and Adamax on the CPU the results are
bitwise those of one optimizer per parameter (tested with their options:
amsgrad, weight decay, Nesterov momentum, centred RMSprop, states included),
so :class:`~pyro_distributed.DistributedOptimizer` groups them by default.
NAdam and RAdam differ from their one-tensor step by a rounding: in a test
of 30 steps, at most 5e-7 on values of order 1 (a few units in the last
place of float32); they are grouped only when asked for.

It keeps ``PyroOptim``'s behaviour where it matters:

* each parameter still has its own torch optimizer in ``optim_objs``, whose
  state *is* the group's state for that parameter (the same dict), so
  ``get_state``, ``set_state``, checkpoints and code that reads
  ``optim_objs`` see the live state in ``PyroOptim``'s format;
* each parameter has its own state (Adam's ``step`` counter included), so
  parameters first seen at different times behave as before;
* only the parameters passed to a call are stepped: the groups are made for
  the step's parameters, and made again when they change.

Hyper-parameters are read from ``optim_objs`` when the groups are made:
editing ``optim_objs[p].param_groups`` later reaches the groups only when
the step's parameters change.
It supports plain ``PyroOptim`` wrappers of torch optimizers that have a
multi-tensor implementation, without ``clip_args``; :func:`grouping_refusal`
says why anything else is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyro
import torch
from pyro.optim import PyroOptim
from torch import Tensor

from ..pyro_internals import pop_waiting_state, single_optimizer

#: Grouped, these give bitwise the results of one optimizer per parameter.
_EXACT: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
)
#: Grouped, these round differently (see the module docstring).
_MULTI_TENSOR_OPTIMIZERS = (*_EXACT, torch.optim.NAdam, torch.optim.RAdam)


def grouping_refusal(pyro_optim: PyroOptim) -> str | None:
    """Why ``pyro_optim`` cannot be stepped grouped, or ``None`` if it can."""
    if type(pyro_optim) is not PyroOptim:
        return f"{type(pyro_optim).__name__} is not a plain PyroOptim (schedulers are not grouped)"
    constructor = pyro_optim.pt_optim_constructor
    if constructor not in _MULTI_TENSOR_OPTIMIZERS:
        return f"{getattr(constructor, '__name__', constructor)} has no multi-tensor step"
    if pyro_optim.pt_clip_args:
        return "clip_args clip each parameter separately"
    return None


def groups_exactly(pyro_optim: PyroOptim) -> bool:
    """Whether grouping ``pyro_optim`` is possible and bitwise exact (the default then)."""
    return grouping_refusal(pyro_optim) is None and pyro_optim.pt_optim_constructor in _EXACT


def _settings_key(group: dict[str, Any]) -> str:
    return repr(sorted((k, v) for k, v in group.items() if k != "params"))


class GroupedStepper:
    """Steps the parameters of a plain ``PyroOptim`` in multi-tensor groups.

    The groups are made for one tuple of parameters, the step's (the
    reducer's plan keeps the same tuple step after step), and made again
    when another tuple comes: nothing outlives the plan it was made for.
    """

    def __init__(self, pyro_optim: PyroOptim) -> None:
        self._pyro_optim = pyro_optim
        #: The parameters the groups were made for, and the groups.
        self._made_for: tuple[Tensor, ...] | None = None
        self._groups: list[torch.optim.Optimizer] = []

    def step(self, params: tuple[Tensor, ...]) -> None:
        """Step ``params``, grouped (the groups made at the first step of this tuple)."""
        if params is not self._made_for:
            self._groups, self._made_for = self._group(params), params
        for group in self._groups:
            group.step()

    def _group(self, params: Iterable[Tensor]) -> list[torch.optim.Optimizer]:
        """One multi-tensor optimizer per distinct set of settings among ``params``."""
        groups: dict[str, torch.optim.Optimizer] = {}
        for param in params:
            single = self._single(param)
            settings = single.param_groups[0]
            key = _settings_key(settings)
            group = groups.get(key)
            if group is None:
                constructor: Any = type(single)  # a concrete optimizer class
                group = constructor([{**settings, "params": [param], "foreach": True}])
                groups[key] = group
            else:
                group.param_groups[0]["params"].append(param)
            group.state[param] = single.state[param]
        return list(groups.values())

    def _single(self, param: Tensor) -> torch.optim.Optimizer:
        # A one-parameter optimizer resolves the hyper-parameters and takes
        # any waiting state exactly as PyroOptim would, and stays in
        # optim_objs; the group steps the parameter, on the same state dict.
        pyro_optim = self._pyro_optim
        single: torch.optim.Optimizer | None = pyro_optim.optim_objs.get(param)
        if single is None:
            single = single_optimizer(pyro_optim, param)
            name = pyro.get_param_store().param_name(param)
            waiting = pop_waiting_state(pyro_optim, name)
            if waiting is not None:
                single.load_state_dict(waiting)
            pyro_optim.optim_objs[param] = single
        # else: made, and stepped, by the sparse step (local_updates="sparse",
        # optim.sparse_step) before this parameter's first dense step: its
        # state (moments, step count) carries over instead of restarting.
        pyro_optim.grad_clip[param] = None  # clip_args are refused
        return single
