"""The lazy optimizer step of ``shard_subsamples(local_updates="sparse")``.

:mod:`pyro_distributed.local.sparse` gives each sparse local parameter the
distinct rows R selected since its last step and their summed gradient g
(already scaled as the average scales it, as ownership scales dense local
gradients). The step
here changes those rows only, of the parameter and of its optimizer state,
and leaves every other row bitwise as it was: the *lazy* semantics of
``torch.optim.SparseAdam`` and TensorFlow's LazyAdam, which is also what
Hoffman et al.'s stochastic variational inference does with local
parameters. Its cost is ``O(|R|)``, never ``O(N/W)``.

On the rows of R, each optimizer applies its own dense update formula,
evaluated by the torch optimizer itself on a small tensor that stands in
for the parameter in its param group (:func:`rows_in_place`), holding those
rows (and those rows of its state), so every hyper-parameter means what it
means for the dense step. One implementation serves both front ends:

* the SVI path (:class:`SparseStepper`): ``PyroOptim`` keeps one torch
  optimizer per parameter (``optim_objs``); each sparse parameter's is
  stepped on its rows;
* the torch-native path (:class:`TorchSparseStepper`): the user's torch
  optimizer holds every parameter; its one ``step()`` steps the global
  parameters on their averaged ``.grad`` and, in place of each sparse
  parameter, its rows, with the hyper-parameters of that parameter's group.
  Its state is the optimizer's own (``optimizer.state[param]``, so
  ``state_dict`` and checkpoints), in torch's format.

The rules, with t the parameter's step count:

* **t is global**: the number of optimizer steps in which the parameter had
  any row selected, kept in the optimizer's ``state["step"]`` as the dense
  step keeps it, not a count per row. Bias correction uses it, as
  ``torch.optim.SparseAdam`` does.
* **Adam** (``pyro.optim.Adam``, torch's formula): for each row r in R,
  ``m_r = b1 m_r + (1 - b1) g_r``, ``v_r = b2 v_r + (1 - b2) g_r^2`` and
  ``p_r -= lr / (1 - b1^t) * m_r / (sqrt(v_r) / sqrt(1 - b2^t) + eps)``.
  ``weight_decay`` (L2) adds ``weight_decay * p_r`` to g_r for r in R only;
  with ``decoupled_weight_decay=True`` it is AdamW's rule below.
* **AdamW**: as Adam, after ``p_r *= 1 - lr * weight_decay`` for r in R only:
  rows outside the batch do not decay.
* **ClippedAdam** (Pyro's): g_r is clamped to ``[-clip_norm, clip_norm]``
  elementwise (its ``clip_norm`` is a bound on each element, not a norm),
  ``lr`` is multiplied by ``lrd`` once per step of the torch optimizer that
  holds the parameter, as the dense step does (on the SVI path, each step in
  which the parameter had rows; on the torch-native path, every
  ``step()``, once per param group), ``weight_decay`` and
  ``centered_variance`` act on rows of R only, and the update is
  ``p_r -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m_r / (sqrt(v_r) + eps)``:
  ClippedAdam's formula, which is also torch's SparseAdam's.
* **SGD**: ``p_r -= lr * g_r`` for r in R (``weight_decay`` adds
  ``weight_decay * p_r`` for r in R only). With momentum mu, the buffer of
  r in R becomes ``mu * b_r + g_r`` (Nesterov: the step uses
  ``g_r + mu * b_r``); buffers of other rows neither decay nor move their
  row. A row's buffer starts at zero, so its first step sets it to g_r, as
  torch's first step does. Without momentum or weight decay, sparse and
  dense SGD give bitwise the same numbers: a row without gradient does not
  move.
* ``clip_args`` (SVI path): ``clip_value`` clamps the rows' elements,
  bitwise the dense result. ``clip_norm`` scales the rows by
  ``min(1, clip_norm / (||g_R|| + 1e-6))`` with the norm of the rows of R:
  the dense gradient's norm, as every other row of it is zero, but summed in
  another order, so it can differ from the dense step's norm in the last
  bits (tests: at most 2 ulps).
* Schedulers (``PyroLRScheduler``, torch's ``lr_scheduler``) change ``lr``
  between steps as usual.

Compared with ``torch.optim.SparseAdam``: the same rows, moments and step
count change; Adam and AdamW put ``eps`` where torch's dense Adam puts it
(inside the bias correction), SparseAdam where ClippedAdam puts it.

.. warning::
    Only these rules exist. Any other optimizer (RMSprop, Adagrad, NAdam,
    ...) and the options ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable``, ``fused`` and SGD's ``dampening`` are refused at the
    first sparse step with a :class:`ValueError` naming them, before
    anything is stepped or sent, on either front end (a torch optimizer by
    the options of the sparse parameter's group); use
    ``local_updates="dense"`` for those.

.. warning::
    Lazy is not dense: with Adam or momentum the parameters differ from the
    dense step's (a dense Adam keeps moving every row with its decaying
    moments). Both converge to the same optimum in SVI; compare them on your
    model before switching a long run.

.. warning::
    A lazy step's momentum averages a row's gradients over the row's visits,
    not over steps: with rows visited about once an epoch, Adam's default
    ``beta1 = 0.9`` spans some ten epochs and the fit lags the dense one's.
    Lower ``beta1`` (say ``betas=(0.5, 0.999)``) for such rows; the local
    parameters guide compares the two.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from pyro.optim import PyroOptim
from pyro.optim.clipped_adam import ClippedAdam
from torch import Tensor

from ..local import sparse as sparse_local
from ..local.sparse import RowGradients
from ..pyro_internals import grad_clip_of, load_optimizer_state, pop_waiting_state, single_optimizer

#: The optimizers with a lazy rule (see the module docstring).
SUPPORTED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    ClippedAdam,
    torch.optim.SGD,
)
_REFUSED_OPTIONS: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.Adam: ("amsgrad", "maximize", "capturable", "differentiable", "fused"),
    torch.optim.AdamW: ("amsgrad", "maximize", "capturable", "differentiable", "fused"),
    ClippedAdam: (),
    torch.optim.SGD: ("maximize", "differentiable", "fused"),
}


def refusal(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """Why the sparse step cannot step a parameter of ``group`` (one of
    ``optimizer``'s param groups), or ``None`` if it can."""
    kind = type(optimizer)
    name = kind.__name__
    if kind not in _REFUSED_OPTIONS:
        return (
            f"local_updates='sparse' has no lazy rule for the optimizer {name}; it steps "
            f"{', '.join(k.__name__ for k in SUPPORTED)} (use local_updates='dense' for {name})"
        )
    bad = [option for option in _REFUSED_OPTIONS[kind] if group.get(option)]
    if kind is torch.optim.SGD and group["momentum"] and group["dampening"]:
        bad.append(f"dampening={group['dampening']!r}")
    if bad:
        return (
            f"local_updates='sparse' does not implement {name} with {', '.join(bad)}; "
            f"leave them out or use local_updates='dense'"
        )
    return None


Clip = Callable[[Tensor], Any]


@contextmanager
def rows_in_place(
    optimizer: torch.optim.Optimizer,
    sparse: Sequence[RowGradients],
    clip: Clip | None = None,
) -> Iterator[None]:
    """Within it, ``optimizer`` holds each sparse parameter's selected rows in its place.

    Each parameter of ``sparse`` is replaced, in its param group, by a small
    tensor of its selected rows whose ``.grad`` is their summed gradient, and
    its per-element state (``exp_avg``, ``momentum_buffer``, ...) by those
    rows of it; the rest of its state (the ``step`` count) is shared. An
    ``optimizer.step()`` inside is then the optimizer's own update applied to
    those rows only: the lazy update. On leaving, the stepped rows are
    written back into the parameter and its state, which keep the dense
    format (a state entry the step created is a zero-filled full block with
    those rows set, as the dense step's would be after its first step). On an
    error nothing is written back.

    :param clip: applied to each row tensor before the step, as ``PyroOptim``
        applies ``clip_args`` to a parameter: on the rows, which is the dense
        gradient's norm or values, every other row of it being zero.
    """
    where = {
        id(p): (group, i) for group in optimizer.param_groups for i, p in enumerate(group["params"])
    }
    # Each group's own list of parameters, put back as it was (the same object).
    originals = {id(group): (group, group["params"]) for group in optimizer.param_groups}
    swapped: list[tuple[RowGradients, Tensor]] = []
    try:
        for gradients in sparse:
            param, axis, rows = gradients.tensor, gradients.axis, gradients.rows
            group, index = where[id(param)]
            rows_param = param.detach().index_select(axis, rows).requires_grad_(True)
            rows_param.grad = gradients.grad
            if clip is not None:
                clip(rows_param)
            state = optimizer.state.get(param, {})
            optimizer.state[rows_param] = {
                key: _rows(value, param, axis, rows) for key, value in state.items()
            }
            if group["params"] is originals[id(group)][1]:
                group["params"] = list(group["params"])
            group["params"][index] = rows_param
            swapped.append((gradients, rows_param))
        yield
    except BaseException:
        for _, rows_param in swapped:
            optimizer.state.pop(rows_param, None)
        raise
    finally:
        for group, params in originals.values():
            group["params"] = params
    for gradients, rows_param in swapped:
        _write_back(optimizer, gradients, rows_param)


def _write_back(
    optimizer: torch.optim.Optimizer, gradients: RowGradients, rows_param: Tensor
) -> None:
    param, axis, rows = gradients.tensor, gradients.axis, gradients.rows
    stepped = optimizer.state.pop(rows_param)
    with torch.no_grad():
        param.index_copy_(axis, rows, rows_param)
    state = optimizer.state[param]
    for key, value in stepped.items():
        if isinstance(value, Tensor) and value.dim() and value.shape == rows_param.shape:
            full = state.get(key)
            if not isinstance(full, Tensor) or full.shape != param.shape:
                # First step: the dense step's zero-initialised state
                # (exp_avg, exp_avg_sq, momentum_buffer), one allocation.
                full = torch.zeros_like(param, memory_format=torch.preserve_format)
                state[key] = full
            full.index_copy_(axis, rows, value)
        else:
            state[key] = value  # the step count (shared, or a new int)


def _rows(value: Any, param: Tensor, axis: int, rows: Tensor) -> Any:
    """``value``'s selected rows if it is per-element state of ``param``, else ``value``."""
    if isinstance(value, Tensor) and value.dim() and value.shape == param.shape:
        return value.index_select(axis, rows)
    return value


class SparseStepper:
    """Steps sparse local parameters on their selected rows, for one ``PyroOptim``.

    The optimizer state lives where the dense step keeps it: in the torch
    optimizer that ``pyro_optim`` holds for the parameter (``optim_objs``),
    in the same format, so that ``get_state``/``set_state`` and checkpoints
    see nothing different.
    """

    def __init__(self, pyro_optim: PyroOptim) -> None:
        self._pyro_optim = pyro_optim
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def take(self, params: Any) -> tuple[list[Tensor], list[RowGradients]]:
        """Split ``params`` into (the rest, the sparse local parameters' row gradients).

        Makes each sparse parameter's torch optimizer if it has none yet (taking
        state waiting from ``set_state``, as ``PyroOptim`` does) and refuses an
        optimizer without a lazy rule, before anything is stepped.
        """
        rest, sparse = sparse_local.take_gradients(list(params))
        for gradients in sparse:
            self._optimizer(gradients)
        return rest, sparse

    def step(self, sparse: list[RowGradients]) -> None:
        """Apply the lazy update to each parameter's selected rows."""
        for gradients in sparse:
            optimizer = self._optimizer(gradients)
            clip = self._pyro_optim.grad_clip.get(gradients.tensor)
            with rows_in_place(optimizer, [gradients], clip):
                optimizer.step()

    def _optimizer(self, gradients: RowGradients) -> torch.optim.Optimizer:
        pyro_optim, param = self._pyro_optim, gradients.tensor
        held = pyro_optim.optim_objs.get(param)
        if held is None:
            # As PyroOptim.__call__ makes one, so that state and format agree.
            held = pyro_optim.optim_objs[param] = single_optimizer(pyro_optim, param)
            pyro_optim.grad_clip[param] = grad_clip_of(pyro_optim, param)
            waiting = pop_waiting_state(pyro_optim, gradients.name)
            if waiting is not None:
                load_optimizer_state(held, waiting)
        optimizer: torch.optim.Optimizer = (
            held if isinstance(held, torch.optim.Optimizer) else held.optimizer
        )
        if optimizer not in self._checked:
            reason = refusal(optimizer, optimizer.param_groups[0])
            if reason is not None:
                raise ValueError(f"local parameter {gradients.name!r}: {reason}")
            self._checked.add(optimizer)
        return optimizer


class TorchSparseStepper:
    """Steps sparse local parameters on their selected rows, for one torch optimizer.

    The torch-native front end's optimizer holds every parameter, global and
    local, in its param groups. The front end's one ``optimizer.step()``
    steps them all, inside :meth:`swapped_in`: the global ones on their
    averaged ``.grad``, the sparse ones (whose ``.grad`` is ``None``) as
    their selected rows, in place (:func:`rows_in_place`), so that per-step
    group updates (ClippedAdam's ``lr *= lrd``) happen once.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def _params(self) -> list[Tensor]:
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def take(self) -> list[RowGradients]:
        """The row gradients of the optimizer's sparse local parameters, consumed;
        refuses an optimizer or option without a lazy rule before anything is stepped."""
        if not sparse_local.any_pending():
            return []  # no O(parameters) list to build at every step
        _, sparse = sparse_local.take_gradients(self._params())
        if sparse:
            group_of = {
                id(p): group for group in self._optimizer.param_groups for p in group["params"]
            }
            for gradients in sparse:
                reason = refusal(self._optimizer, group_of[id(gradients.tensor)])
                if reason is not None:
                    raise ValueError(f"local parameter {gradients.name!r}: {reason}")
        return sparse

    def swapped_in(self, sparse: list[RowGradients]) -> AbstractContextManager[None]:
        """Within it, the optimizer holds the sparse rows in their parameters'
        places, so that its ``step()`` steps its dense parameters and the rows."""
        return rows_in_place(self._optimizer, sparse) if sparse else nullcontext()

    def zero_grad(self) -> None:
        """Drop the gradients recorded for the sparse rows, as ``zero_grad`` drops ``.grad``."""
        if sparse_local.any_pending():
            sparse_local.clear_gradients(self._params())
