"""Checks made around an optimizer step, shared by both front ends.

* :func:`refuse_nonfinite`: a NaN or Inf in an averaged gradient (which every
  worker sees alike) makes every worker skip the step with a warning, or
  raise, naming the parameters.
* :class:`GradStamps`: notices a gradient changed between backward and the
  step (a clip, a rescale), which acted on one worker's gradient before
  averaging.
* :func:`check_state_fits`: refuses optimizer state made for all the rows of
  a parameter that is now cut to this worker's block.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from ..errors import PyroDistributedError
from ..torch_internals import GradStamp, grad_changed_since, grad_stamp


def refuse_nonfinite(
    named: Iterable[tuple[str, Tensor]],
    step: int,
    mode: Literal["skip", "raise"],
    stacklevel: int = 4,
    extra: Sequence[str] = (),
    alone: bool = False,
) -> None:
    """Skip the step with a :class:`RuntimeWarning` (or raise), naming the
    parameters whose gradient is not finite (and ``extra`` ones, whose
    gradients are held elsewhere); the same on every worker. ``alone``: a
    step on this worker's own gradients (the step policy's), skipped or
    refused by this worker."""
    bad = [
        name
        for name, param in named
        if param.grad is not None and not bool(torch.isfinite(param.grad).all())
    ] + list(extra)
    whose = "this worker's own gradient" if alone else "the averaged gradient"
    message = (
        f"{whose} of {', '.join(map(repr, bad[:5]))}"
        f"{f' and {len(bad) - 5} more' if len(bad) > 5 else ''} is not finite "
        f"({'NaN or Inf' if alone else 'NaN or Inf on at least one worker'}) at step {step}"
    )
    if mode == "raise":
        raise PyroDistributedError(message)
    who = "this worker skips this step (a step alone)" if alone else "every worker skips this step"
    warnings.warn(f"{message}; {who}", RuntimeWarning, stacklevel=stacklevel)


def check_state_fits(optimizer: torch.optim.Optimizer, local: dict[str, Tensor]) -> None:
    """Refuse optimizer state that was made for all the rows of a local parameter.

    Cutting a local parameter to its block keeps the parameter object, so an
    optimizer built before the cut is fine, unless it already stepped it.
    """
    for name, param in local.items():
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim() and value.shape != param.shape:
                raise PyroDistributedError(
                    f"the optimizer's state {key!r} of local parameter {name!r} has shape "
                    f"{list(value.shape)}, not the shape {list(param.shape)} of this worker's "
                    f"block of rows: the optimizer stepped the parameter before "
                    f"shard_subsamples(own_local_params=True) cut it. Run the warm-up call "
                    f"under shard_subsamples before the first step"
                )


class GradStamps:
    """The gradients of a few parameters as their last backward pass left them,
    to notice changes made to them afterwards (by clipping, say).

    Only a sample is watched: at most :attr:`SAMPLE` parameters, spread evenly
    over the list. A hook is a call into Python per parameter per backward
    pass, which on hundreds of small parameters cost more than the exchange
    itself; what this looks for (``clip_grad_norm_``, a rescale of every
    gradient) changes every gradient, so a sample sees it.
    """

    #: The most parameters watched.
    SAMPLE = 8

    def __init__(self) -> None:
        self._stamps: dict[int, GradStamp] = {}
        self._hooks: dict[int, RemovableHandle] = {}
        self._given: Sequence[Tensor] = ()
        self._watched: list[Tensor] = []

    def watch(self, params: Sequence[Tensor]) -> None:
        """Watch a sample of ``params`` (at once when it is the list watched already)."""
        if params is self._given:
            return
        self._given = params
        stride = max(1, -(-len(params) // self.SAMPLE))
        sample = list(params[::stride])
        kept = {id(param) for param in sample}
        for key in [key for key in self._hooks if key not in kept]:
            self._hooks.pop(key).remove()
            self._stamps.pop(key, None)
        for param in sample:
            if id(param) not in self._hooks:
                self._hooks[id(param)] = param.register_post_accumulate_grad_hook(self._stamp)  # type: ignore[no-untyped-call]
        self._watched = sample

    def unwatch(self) -> None:
        """Remove every hook (one worker has no average to clip; or warned already)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._stamps.clear()
        self._given, self._watched = (), []

    def _stamp(self, param: Tensor) -> None:
        if param.grad is not None:
            self._stamps[id(param)] = grad_stamp(param)

    def changed(self) -> Tensor | None:
        """The first watched parameter whose gradient changed since its last
        backward pass, if any."""
        for param in self._watched:
            stamp = self._stamps.pop(id(param), None)
            if stamp is None or param.grad is None:
                continue
            if grad_changed_since(param, stamp):
                return param
        return None
