"""Every reach into Pyro's private names, in one place.

The library needs a few things that Pyro does not offer publicly. Each is
wrapped here, with what it needs and why no public API serves, so that an
upgrade of Pyro is checked by reading this file, and
``tests/test_internals.py`` fails with the installed versions named when an
internal has moved. No other module names a private attribute of Pyro;
torch's private names are reached in :mod:`pyro_distributed.torch_internals`.
"""

from __future__ import annotations

import weakref
from typing import Any

import pyro
import torch
from pyro.optim import PyroOptim
from pyro.optim.optim import _load_state_dict
from pyro.poutine.subsample_messenger import _Subsample
from torch import Tensor

#: The distribution behind a plate's subsample site. Plate probes and sharded
#: subsampling must recognise that site among sample sites; Pyro exports no
#: public name or flag for it.
Subsample = _Subsample


def stored_unconstrained(name: str) -> Tensor | None:
    """The param store's unconstrained tensor for ``name``, or ``None``.

    Pyro's public getters (``store[name]``, ``pyro.param``) return the
    constrained value, which computes the constraint's transform over every
    row: O(N) for a local parameter of N rows, to read a few.
    """
    tensor: Tensor | None = pyro.get_param_store()._params.get(name)
    return tensor


def replace_unconstrained(name: str, value: Tensor) -> Tensor:
    """Make ``value`` ``name``'s unconstrained tensor, bit for bit; return what is stored.

    Pyro's public setters go through the constraint's transform and its
    inverse, which changes bits; the store's two private maps (name to tensor,
    tensor to name) are set instead.
    """
    store = pyro.get_param_store()
    old = store._params.get(name)
    if old is not None:
        store._param_to_name.pop(old, None)
    value = value.detach().requires_grad_(True)
    if isinstance(old, torch.nn.Parameter):
        # PyroModule keeps its parameters as nn.Parameter and would swap in a
        # new wrapper (a new tensor to the optimizer) on its next read.
        value = torch.nn.Parameter(value)
    store._params[name] = value
    store._param_to_name[value] = name
    return value


def param_constraint(name: str) -> Any:
    """The constraint ``name`` was created with: Pyro has no public getter for it."""
    return pyro.get_param_store()._constraints[name]


def attach_unconstrained(value: Tensor, unconstrained: Tensor) -> None:
    """Mark a constrained ``value`` as computed from ``unconstrained``, as Pyro's
    own param statement does, so that SVI steps ``unconstrained`` when the
    value was made outside Pyro's param statement (a few selected rows)."""
    value.unconstrained = weakref.ref(unconstrained)  # type: ignore[attr-defined]
    value._pyro_unconstrained_param = unconstrained  # type: ignore[attr-defined]


def module_param(msg: dict[str, Any]) -> tuple[Tensor, Any, bool] | None:
    """For a ``param`` message from a PyroModule in ``module_local_params`` mode,
    the module's unconstrained ``nn.Parameter``, its constraint, and whether the
    constrained value Pyro already computed is in an autograd graph; else ``None``.

    In that mode a PyroParam lives on its module, not in the param store, and
    Pyro announces each use with a message whose only argument is the name and
    whose function returns the constrained value it already computed, tied to
    the parameter by ``.unconstrained``. Pyro marks such messages no other way.
    A ``pyro.param`` statement always passes its init as a second argument.
    """
    if len(msg["args"]) != 1 or msg["args"][0] in pyro.get_param_store():
        return None
    value = msg["fn"]()
    ref = getattr(value, "unconstrained", None)
    tensor = ref() if callable(ref) else None
    if not isinstance(tensor, torch.nn.Parameter):
        return None
    return tensor, msg["kwargs"].get("constraint"), value.grad_fn is not None


def single_optimizer(pyro_optim: PyroOptim, param: Tensor) -> torch.optim.Optimizer:
    """The one-parameter torch optimizer ``pyro_optim`` keeps (or makes) for ``param``.

    Made by Pyro's own code, so that per-parameter arguments resolve exactly
    as they would without this library; Pyro makes it only inside ``__call__``.
    """
    optimizer: torch.optim.Optimizer = pyro_optim._get_optim(param)
    return optimizer


def grad_clip_of(pyro_optim: PyroOptim, param: Tensor) -> Any:
    """The clipping function ``pyro_optim`` applies to ``param``'s gradient (or
    ``None``), resolved from ``clip_args`` by Pyro's own code."""
    return pyro_optim._get_grad_clip(param)  # type: ignore[arg-type]


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Load ``state`` into a one-parameter optimizer (or scheduler) the way
    ``PyroOptim.set_state`` does, which Pyro keeps in a private helper."""
    _load_state_dict(optimizer, state)


def pop_waiting_state(pyro_optim: PyroOptim, name: str | None) -> dict[str, Any] | None:
    """Loaded optimizer state that ``pyro_optim`` still holds for parameter ``name``
    (``set_state`` keeps it until the parameter's optimizer is made), removed."""
    state: dict[str, Any] | None = pyro_optim._state_waiting_to_be_consumed.pop(name, None)
    return state


def stand_in_optimizer(pyro_optim: PyroOptim, name: str, tensor: Tensor) -> Any:
    """The one-parameter optimizer (or scheduler) ``pyro_optim`` would make for
    parameter ``name``, over ``tensor`` instead of the parameter.

    Pyro resolves per-parameter arguments from the param store's name of the
    tensor it is given, so ``tensor`` carries ``name`` in the store's private
    map for the call, and no longer.
    """
    named = pyro.get_param_store()._param_to_name
    named[tensor] = name
    try:
        return pyro_optim._get_optim(tensor)
    finally:
        named.pop(tensor, None)


def reduce_autoguide(obj: Any) -> tuple[Any, ...] | None:
    """A pickle reduction of an ``AutoGuide`` that keeps its model and leaves
    the guide as it was; ``None`` for anything else.

    ``AutoGuide.__getstate__`` drops the model (it sets ``_model`` and
    ``master`` to ``None`` on the live guide, then copies its state), so a
    guide made in a kernel would reach a launch's workers without its model,
    and the kernel's own guide would lose it too. This copies the state
    instead, with the model, and rebuilds through ``AutoGuide.__setstate__``,
    which links nested guides (an ``AutoGuideList``'s) to their new parent.
    """
    from pyro.infer.autoguide import AutoGuide

    if not isinstance(obj, AutoGuide):
        return None
    # What PyroModule.__getstate__ does too: a parameter's weak reference to
    # itself (an unconstrained one's), which Pyro sets again at the next read.
    for parameter in obj.parameters():
        parameter.__dict__.pop("unconstrained", None)
    state = {**obj.__dict__, "master": None}  # a weak reference, relinked by __setstate__
    return _restore_autoguide, (type(obj), state)


def _restore_autoguide(cls: Any, state: dict[str, Any]) -> Any:
    guide = cls.__new__(cls)
    guide.__setstate__(state)
    return guide
