"""One multi-tensor optimizer step for all parameters that share settings.

``PyroOptim`` keeps one torch optimizer per parameter, so a guide with 400
small tensors pays for 400 Python-level ``step()`` calls every iteration. A
:class:`GroupedStepper` keeps one torch optimizer per distinct set of
hyper-parameters instead, with every member in a single parameter group and
``foreach=True``, so each step is a handful of multi-tensor kernels.

For Adam, AdamW, SGD and RMSprop on the CPU the results are bitwise those of
one optimizer per parameter (tested, states included). It keeps
``PyroOptim``'s behaviour where it matters:

* each parameter still has its own optimizer state (Adam's ``step`` counter
  included), so parameters first seen at different times behave as before;
* only the parameters passed to a call are stepped: members of a group that
  were not passed are hidden from that step;
* ``get_state`` and ``set_state`` use ``PyroOptim``'s per-parameter format
  (``{name: {"state": {0: ...}, "param_groups": [{..., "params": [0]}]}}``),
  so checkpoints move freely between the two modes.

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

__all__ = ["GroupedStepper", "grouping_refusal"]

_MULTI_TENSOR_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


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
        # A one-parameter optimizer resolves the hyper-parameters and applies
        # any waiting state exactly as PyroOptim would; then its parameter
        # and state move into the group with the same settings.
        single: torch.optim.Optimizer = self._pyro_optim._get_optim(param)
        name = pyro.get_param_store().param_name(param)
        waiting = self._pyro_optim._state_waiting_to_be_consumed.pop(name, None)
        if waiting is not None:
            single.load_state_dict(waiting)
        key = _settings_key(single.param_groups[0])
        group = self._groups.get(key)
        if group is None:
            single.param_groups[0]["foreach"] = True
            self._groups[key] = group = single
        else:
            group.param_groups[0]["params"].append(param)
            if param in single.state:
                group.state[param] = single.state[param]
        self._group_of[param] = group

    def step(self, params: Iterable[Tensor]) -> None:
        stepping = set()
        for param in params:
            if param not in self._group_of:
                self._join(param)
            stepping.add(param)
        for group in {id(self._group_of[p]): self._group_of[p] for p in stepping}.values():
            members = group.param_groups[0]["params"]
            hidden = [p for p in members if p not in stepping and p.grad is not None]
            saved = [p.grad for p in hidden]
            for p in hidden:  # PyroOptim steps only what it is given
                p.grad = None
            group.step()
            for p, grad in zip(hidden, saved, strict=True):
                p.grad = grad

    def get_state(self) -> dict[str, Any]:
        """Per-parameter state in PyroOptim's format, keyed by param-store name."""
        store = pyro.get_param_store()
        state: dict[str, Any] = {}
        for param, group in self._group_of.items():
            name = store.param_name(param)
            if name is None:  # no longer in the param store
                continue
            settings = {k: v for k, v in group.param_groups[0].items() if k != "params"}
            settings["foreach"] = None
            state[name] = {
                "state": {0: group.state[param]} if param in group.state else {},
                "param_groups": [{**settings, "params": [0]}],
            }
        return state
