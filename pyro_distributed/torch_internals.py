"""Every reach into torch's private names, in one place.

torch offers publicly almost everything this library needs; the few things
it does not are wrapped here, each with what it needs and why no public API
serves, so that an upgrade of torch is checked by reading this file, and
``tests/test_internals.py`` fails with the installed version named when one
has moved. This module imports nothing of Pyro: the engines and the exchange,
which know nothing of Pyro, use it (an import-linter contract checks that).
Pyro's private names are reached in :mod:`pyro_distributed.pyro_internals`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.distributed_c10d import PrefixStore as _PrefixStore

if torch.distributed.is_available():
    # torch.distributed.nn.functional evaluates ``group.WORLD`` into its
    # functions' defaults when it is first imported, and torch.optim imports it
    # (through torch._dynamo) when the first optimizer is made, often after the
    # process group. Its defaults then hold that group past
    # destroy_process_group, with the group's threads, until the interpreter
    # finalises; a thread still releasing a finished collective's tensors then
    # takes the GIL and aborts the process ("terminate called without an active
    # exception", after training has ended). Imported here, before this
    # library makes any group, its defaults hold None.
    import torch.distributed.nn.functional

#: A store that prefixes every key. torch exports it from ``torch.distributed``
#: but documents it nowhere; the torch engine uses it to give every attempt at
#: joining a process group keys of its own on a shared TCP store.
PrefixStore = _PrefixStore


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that shares another's groups and state (so skips
    ``Optimizer.__init__``, which would replace them) the hook registries that
    ``__init__`` makes, and the step wrapper that runs those hooks, so that
    ``register_step_pre_hook`` and friends work on it as on any optimizer."""
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    optimizer._optimizer_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_state_dict_post_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    optimizer._patch_step_function()


def grad_version(grad: Tensor) -> int:
    """How many times ``grad`` was modified in place (autograd's version counter).

    The overlap must know whether a gradient changed after its bucket left;
    an in-place accumulation keeps the tensor's identity, and only its version
    counter says it changed.
    """
    version: int = grad._version
    return version


#: A parameter's gradient as it was: the tensor (or ``None``) and its version.
GradStamp = tuple[Tensor | None, int]


def grad_stamp(param: Tensor) -> GradStamp:
    """``param``'s gradient object and its version: any later change to
    ``.grad``, replaced or modified in place, changes one of the two."""
    grad = param.grad
    return grad, (grad_version(grad) if grad is not None else -1)


def grad_changed_since(param: Tensor, stamp: GradStamp) -> bool:
    """Whether ``param``'s gradient changed since :func:`grad_stamp` took ``stamp``."""
    grad, version = stamp
    # Compared by identity: == on tensors would compare their values.
    return param.grad is not grad or (grad is not None and grad_version(grad) != version)


def flatten_dense(tensors: list[Tensor]) -> Tensor:
    """The tensors' values, flattened and concatenated into one new 1-D tensor.

    One call into C++ instead of one ``reshape(-1)`` per tensor and a
    ``torch.cat``: packing a bucket of hundreds of small gradients is a
    per-step cost. ``TypeError`` if an element is ``None``, ``RuntimeError``
    if one is sparse. With a single tensor the result may be a view of it;
    the callers always pass two or more.
    """
    flat: Tensor = _flatten_dense_tensors(tensors)  # type: ignore[no-untyped-call]
    return flat


def unflatten_dense(flat: Tensor, like: list[Tensor]) -> tuple[Tensor, ...]:
    """Views into ``flat``, one per tensor of ``like``, shaped like it and laid
    out back to back from the start of ``flat`` (values past them are ignored).

    The inverse of :func:`flatten_dense` in one call into C++, where one
    ``split`` and a ``view_as`` per tensor would cost a Python call each.
    """
    views: tuple[Tensor, ...] = _unflatten_dense_tensors(flat, like)  # type: ignore[no-untyped-call]
    return views


def copy_all_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``target.copy_(source)`` for every pair, in one call into C++.

    ``torch._foreach_copy_``: documented nowhere, and the only way to fill
    a resident bucket's hundreds of views without a Python call each.
    ``TypeError`` if a source is ``None``, ``RuntimeError`` if one is sparse.
    """
    torch._foreach_copy_(targets, sources)
