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
* only the parameters passed to a call are stepped: members of a group that
  were not passed are hidden from that step.

Hyper-parameters are read when a parameter first reaches the optimizer;
editing ``optim_objs[p].param_groups`` later does not reach the group.
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


#: The groups a step steps, each with the members that sit it out (:meth:`GroupedStepper.plan`).
GroupedSteps = list[tuple[torch.optim.Optimizer, list[Tensor]]]


def _settings_key(group: dict[str, Any]) -> str:
    return repr(sorted((k, v) for k, v in group.items() if k != "params"))


class GroupedStepper:
    """Steps the parameters of a plain ``PyroOptim`` in multi-tensor groups."""

    def __init__(self, pyro_optim: PyroOptim) -> None:
        self._pyro_optim = pyro_optim
        self._groups: dict[str, torch.optim.Optimizer] = {}
        self._group_of: dict[Tensor, torch.optim.Optimizer] = {}

    def forget(self) -> None:
        """Drop every group (after the param store was replaced)."""
        self._groups.clear()
        self._group_of.clear()

    def _join(self, param: Tensor) -> None:
        # A one-parameter optimizer resolves the hyper-parameters and takes
        # any waiting state exactly as PyroOptim would, and stays in
        # optim_objs; the group steps the parameter, on the same state dict.
        pyro_optim = self._pyro_optim
        single = pyro_optim.optim_objs.get(param)
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
        settings = single.param_groups[0]
        key = _settings_key(settings)
        group = self._groups.get(key)
        if group is None:
            constructor: Any = type(single)  # a concrete optimizer class
            group = constructor([{**settings, "params": [param], "foreach": True}])
            self._groups[key] = group
        else:
            group.param_groups[0]["params"].append(param)
        group.state[param] = single.state[param]
        self._group_of[param] = group

    def step(self, groups: GroupedSteps) -> None:
        """Step ``groups`` (:meth:`plan`), each member that was not passed sitting out."""
        for group, hideable in groups:
            if not hideable:
                group.step()
                continue
            hidden = [p for p in hideable if p.grad is not None]
            saved = [p.grad for p in hidden]
            for p in hidden:  # PyroOptim steps only what it is given
                p.grad = None
            group.step()
            for p, grad in zip(hidden, saved, strict=True):
                p.grad = grad

    def plan(self, params: Iterable[Tensor]) -> GroupedSteps:
        """The groups that ``params`` belong to (joining new ones), each with the
        members that were not passed and must sit out the step. The step's plan
        keeps it while the parameters stay the same (``optim.reducer.Plan``)."""
        stepping = set()
        for param in params:
            if param not in self._group_of:
                self._join(param)
            stepping.add(param)
        groups = {id(self._group_of[p]): self._group_of[p] for p in stepping}.values()
        return [
            (group, [p for p in group.param_groups[0]["params"] if p not in stepping])
            for group in groups
        ]
