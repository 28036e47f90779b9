"""A checkpoint's optimizer state, tried on the run's optimizer before it is loaded.

torch's ``load_state_dict`` takes whatever it is given: Adam's moments load
into SGD, which ignores them, and a moment of the wrong shape or a missing
setting fails only at the next step, as a bare ``RuntimeError`` or
``KeyError`` with the run already restored. So each parameter's saved state
is tried first on stand-ins: optimizers of the run's kind, with its
settings, over a tensor of zeros shaped like the parameter.

- A fresh stand-in stepped once on a zero gradient shows the entries this
  optimizer keeps; saved state (where a parameter has any) must hold the
  same entries, each tensor of the shape the stand-in's has.
- A second stand-in loads the saved state and steps once; whatever it
  raises is named, with the parameter and the file.

An optimizer whose fresh stand-in cannot step (LBFGS needs a closure) is not
tried. Stand-ins are made one parameter at a time, each over a tensor of that
parameter's size, and dropped before the next.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from pyro.optim import PyroOptim
from torch import Tensor

from ..pyro_internals import load_optimizer_state, stand_in_optimizer

__all__ = ["check_pyro_optim", "check_torch_optimizer"]


def check_pyro_optim(
    pyro_optim: PyroOptim, saved: dict[str, Any], params: dict[str, Tensor], shown: str
) -> None:
    """Try ``saved``, a Pyro optimizer's state by parameter name, on ``pyro_optim``;
    ``params`` are the saved parameters (the shapes to try them at).

    :raises ValueError: naming the file, the parameter and what does not fit.
    """
    for name in sorted(saved):
        if name not in params:
            continue  # nothing of that name to step: Pyro keeps it unused
        entry = saved[name]
        _try(
            partial(_pyro_stand_in, pyro_optim, name, params[name]),
            partial(_load_pyro_state, entry),
            _single_state(entry["optimizer"] if _is_scheduler_state(entry) else entry),
            f"parameter {name!r}",
            shown,
        )


def check_torch_optimizer(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], shown: str
) -> None:
    """Try ``saved``, a torch optimizer's ``state_dict``, on ``optimizer``,
    parameter by parameter, with the saved groups' settings.

    :raises ValueError: naming the file, the parameter and what does not fit.
    """
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    sizes = [len(group["params"]) for group in groups]
    saved_sizes = [len(group["params"]) for group in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"the checkpoint {shown} holds an optimizer of {saved_sizes} parameters by "
            f"group, and this one has {sizes}: it was saved with other parameters or groups"
        )
    for number, (group, saved_group) in enumerate(zip(groups, saved_groups, strict=True)):
        settings = {key: value for key, value in group.items() if key != "params"}
        pairs = zip(group["params"], saved_group["params"], strict=True)
        for place, (param, index) in enumerate(pairs):
            entry = saved["state"].get(index)
            single = {
                "state": {} if entry is None else {0: entry},
                "param_groups": [{**saved_group, "params": [0]}],
            }
            _try(
                partial(_torch_stand_in, type(optimizer), settings, param),
                partial(_load_torch_state, single),
                entry,
                f"parameter {place} of group {number}",
                shown,
            )


StandIn = tuple[Any, torch.optim.Optimizer, Tensor]


def _pyro_stand_in(pyro_optim: PyroOptim, name: str, like: Tensor, size: str) -> StandIn:
    tensor = _zeros(like, size)
    made = stand_in_optimizer(pyro_optim, name, tensor)
    return made, _optimizer_of(made), tensor


def _load_pyro_state(entry: dict[str, Any], made: Any) -> None:
    # A copy: torch loads tensors of the right device and dtype as they are,
    # and the stand-in's step would change the state that is to be loaded.
    load_optimizer_state(made, copy.deepcopy(entry))


def _torch_stand_in(kind: type[Any], settings: dict[str, Any], like: Tensor, size: str) -> StandIn:
    tensor = _zeros(like, size)
    made = kind([{**settings, "params": [tensor]}])
    return made, made, tensor


def _load_torch_state(single: dict[str, Any], made: Any) -> None:
    made.load_state_dict(copy.deepcopy(single))  # as the stand-in steps it in place


def _try(
    make: Callable[[str], StandIn],
    load: Callable[[Any], None],
    saved: Any,
    what: str,
    shown: str,
) -> None:
    """Compare ``saved`` (one parameter's state, or ``None``) with what a fresh
    stand-in keeps, then load the saved state (``load``) into another and step it.

    The fresh stand-in holds no data (torch's meta device: shapes alone), and
    the trial is of the parameter's size only where there is saved state to
    load: a checkpoint of a large parameter is checked without holding it
    several times over. Running out of memory is not a verdict on the file."""
    try:
        _, fresh, tensor = made = make("meta")
        _step(fresh, tensor)
    except Exception:  # an optimizer that cannot be tried this way
        return
    kind = type(fresh).__name__
    expected = fresh.state.get(tensor, {})
    del made, fresh, tensor
    if saved:
        if not isinstance(saved, dict) or set(saved) != set(expected):
            held = sorted(saved) if isinstance(saved, dict) else saved
            raise ValueError(
                f"the checkpoint {shown} holds optimizer state {held} for {what}, where "
                f"this run's {kind} keeps {sorted(expected) or 'none'}: it was saved with "
                f"another optimizer, or other settings"
            )
        for key, value in expected.items():
            got = saved[key]
            sized = isinstance(value, Tensor) and value.dim() > 0
            if sized and not (isinstance(got, Tensor) and got.shape == value.shape):
                said = list(got.shape) if isinstance(got, Tensor) else type(got).__name__
                raise ValueError(
                    f"the checkpoint {shown} holds optimizer state {key!r} of shape "
                    f"{said} for {what}, which needs {list(value.shape)}"
                )
    try:
        made, trial, tensor = make("full" if saved else "one")
        load(made)
        _step(trial, tensor)
    except (MemoryError, torch.OutOfMemoryError):
        return  # no room to try it here; the load itself will tell
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"the checkpoint {shown} holds optimizer state for {what} that this run's "
            f"{kind} cannot use ({type(exc).__name__}: {first}): it was saved with another "
            f"optimizer, or other settings"
        ) from exc


def _zeros(like: Tensor, size: str) -> Tensor:
    """A stand-in parameter: ``like``'s shape without data (``"meta"``), zeros
    of its shape (``"full"``), or one zero of its kind (``"one"``, where only
    the optimizer's settings are tried)."""
    if size == "meta":
        return torch.zeros_like(like, device="meta")
    if size == "one":
        return torch.zeros(1, dtype=like.dtype, device=like.device)
    return torch.zeros_like(like)


def _step(optimizer: torch.optim.Optimizer, tensor: Tensor) -> None:
    tensor.grad = torch.zeros_like(tensor)
    optimizer.step()


def _optimizer_of(made: Any) -> torch.optim.Optimizer:
    """The optimizer a Pyro optimizer made, or the one its scheduler drives."""
    return made if isinstance(made, torch.optim.Optimizer) else made.optimizer


def _is_scheduler_state(entry: dict[str, Any]) -> bool:
    """Whether ``entry`` is a scheduler's state: its own and its optimizer's."""
    return "scheduler" in entry and "optimizer" in entry


def _single_state(saved: Any) -> Any:
    """The one parameter's state in a one-parameter optimizer's ``state_dict``."""
    state = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(state, dict) or not state:
        return None
    return next(iter(state.values()))
