"""DistributedTorchOptimizer: any ``torch.optim.Optimizer``, with gradients averaged.

Pyro's torch-native loop trains an ELBO module with a torch optimizer::

    loss_fn = Trace_ELBO()(model, guide)
    loss = loss_fn(batch); loss.backward(); optimizer.step()

``pd.DistributedOptimizer(torch_optimizer)`` returns this wrapper, which is a
``torch.optim.Optimizer`` itself: schedulers, ``zero_grad``,
``state_dict``/``load_state_dict`` and ``add_param_group`` act on the wrapped
optimizer, whose ``param_groups``, ``state`` and ``defaults`` it shares (the
same objects, not copies). :meth:`~DistributedTorchOptimizer.step` hands every
parameter of every group to the same gradient exchange that the Pyro path
uses (:class:`~pyro_distributed.exchange.sync.GradientSync`), then lets the
wrapped optimizer step.

Parameters are known to the exchange by their position,
``param_groups[g][i]``, which is the same on every worker that builds its
optimizer the same way; workers whose optimizers differ get an error that
names the positions.

Clipping: a gradient clipped between ``backward()`` and ``step()`` is still
this worker's own gradient. :meth:`~DistributedTorchOptimizer.synchronize`
averages first, so that clipping acts on the average; a ``step()`` without it
that finds a gradient changed since backward (a clip, a rescale) warns once,
since that change was made to one worker's gradient before averaging.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .. import runtime
from ..checks import check_bool, check_choice, check_int, check_number
from ..engines import Engine
from ..errors import PyroDistributedError
from ..exchange.averager import Reduction
from ..exchange.compression import Compression, compressor
from ..exchange.sync import Exchanged, GradientSync
from ..internals import grad_version, init_optimizer_hooks
from ..local.gradients import LocalGradients, split_local
from .consistency import assert_in_sync
from .noise_scale import NoiseScale, NoiseScaleEstimator

__all__ = ["DistributedTorchOptimizer"]

Closure = Callable[[], Any]


class DistributedTorchOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step()`` averages gradients across workers.

    Made by :class:`~pyro_distributed.DistributedOptimizer` when it is given a
    torch optimizer; it takes the same keyword arguments (but
    ``multi_tensor``, which a torch optimizer decides for itself).

    Example::

        pyro.settings.set(module_local_params=True)
        loss_fn = Trace_ELBO()(model, guide)
        loss_fn(*first_batch)  # AutoGuides create their parameters lazily
        optimizer = pd.DistributedOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.01))
        for batch in loader:
            optimizer.zero_grad()
            loss_fn(*batch).backward()
            optimizer.step()

    .. warning::
        Every worker must call ``step()`` the same number of times (each is a
        collective), with an optimizer built the same way: the same
        parameters, in the same groups and order, with the same shapes.

    .. warning::
        The first ``step()`` gives every parameter worker 0's value, and so
        does the first step after ``add_param_group``. Build the optimizer
        after the call that creates a guide's parameters lazily, or those
        parameters are not in it.

    .. warning::
        Gradients are averaged in ``step()``. ``clip_grad_norm_`` (or any
        change to ``.grad``) between ``backward()`` and ``step()`` acts on
        this worker's own gradient; to clip the average, call
        :meth:`synchronize` first. A ``step()`` that finds a gradient changed
        since backward without it warns once.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        engine: str | Engine = "auto",
        bucket_cap_mb: float = 25.0,
        nonfinite: Literal["skip", "raise"] = "skip",
        check_every: int | None = None,
        compression: Compression = "none",
        overlap: bool = True,
        noise_scale: bool | float = False,
    ) -> None:
        # No super().__init__(): the wrapped optimizer's groups, state and
        # defaults are shared below, so that everything acting on this object
        # (schedulers, add_param_group, state_dict) acts on the wrapped one.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedTorchOptimizer):
            raise TypeError(
                "optimizer is already a DistributedTorchOptimizer; wrap the plain optimizer once"
            )
        check_number("bucket_cap_mb", bucket_cap_mb, positive=True)
        if not isinstance(engine, (str, Engine)):
            raise TypeError(f"engine must be a name or an Engine, got {type(engine).__name__}")
        check_choice("nonfinite", nonfinite, ("skip", "raise"))
        check_int("check_every", check_every, minimum=1, optional=True)
        check_bool("overlap", overlap)
        reduction = Reduction(compression=compressor(compression))
        self.wrapped = optimizer
        self.engine = runtime.init(engine) if isinstance(engine, str) else engine
        self.nonfinite = nonfinite
        self.check_every = check_every
        #: How many times ``step()`` was called (saved in checkpoints).
        self.num_steps = 0
        self._noise = NoiseScaleEstimator.create(noise_scale, self.engine.world_size)
        #: The gradient exchange; ``None`` with one worker.
        self.sync: GradientSync | None = None
        if self.engine.world_size > 1:
            self.sync = GradientSync(
                self.engine,
                max(1, int(bucket_cap_mb * 2**20)),
                reduction,
                overlap=overlap,
                measure_norms=self._noise is not None,
                catalog_name="optimizer",
            )
        self._local = LocalGradients(self.engine)
        self._synchronized: _Synchronized | None = None
        self._stamps = _GradStamps()
        if self.sync is not None:  # one worker has no average to clip
            self._stamps.watch([param for _, param in self.named_parameters()])
        self._warned_changed = False
        init_optimizer_hooks(self)

    # -- what torch.optim.Optimizer users read and write, shared with the wrapped one

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.wrapped.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.wrapped.param_groups = groups

    @property
    def state(self) -> Any:
        return self.wrapped.state

    @state.setter
    def state(self, state: Any) -> None:
        self.wrapped.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.wrapped.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.wrapped.defaults = defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.wrapped.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wrapped.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wrapped.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedTorchOptimizer is not picklable; save its state_dict()")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.wrapped!r}, engine={self.engine!r})"

    # -- the step

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter of every group, by the name the exchange knows it by."""
        for g, group in enumerate(self.wrapped.param_groups):
            for i, param in enumerate(group["params"]):
                yield f"param_groups[{g}][{i}]", param

    def synchronize(self) -> None:
        """Average the gradients now, before ``step()``: to clip the averaged gradient.

        A collective. The next ``step()`` steps on these averages without
        averaging again.

        Example::

            loss_fn(*batch).backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(loss_fn.parameters(), 10.0)
            optimizer.step()
        """
        if self.sync is None or self._synchronized is not None:
            return
        self._synchronized = self._exchange()

    def step(self, closure: Closure | None = None) -> Any:
        """Average the gradients across workers, then step the wrapped optimizer.

        :param closure: re-evaluates the loss and its gradients, as torch's
            optimizers take it; it runs before the gradients are averaged.
        :returns: what the closure returned, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.num_steps += 1
        if self.sync is None:
            self.wrapped.step()
            return loss
        synchronized = self._synchronized
        if synchronized is None:
            self._warn_if_changed_since_backward()
            synchronized = self._exchange()
        self._synchronized = None
        exchanged, finite = synchronized
        if finite:
            if self._noise is not None and exchanged.tensors:
                self._noise.observe(*self.sync.squared_norms())
            self.wrapped.step()
        else:
            self._refuse_nonfinite()
        for name, param in zip(exchanged.names, exchanged.tensors, strict=True):
            if name in exchanged.borrowed:
                param.grad = None
        self._stamps.watch(exchanged.tensors)
        if self.check_every and self.num_steps % self.check_every == 0:
            assert_in_sync(self)
        return loss

    def _exchange(self) -> _Synchronized:
        """Average the replicated gradients; scale the local ones (which never
        travel); return the exchange and whether every gradient is finite."""
        assert self.sync is not None
        replicated, local = split_local(dict(self.named_parameters()))
        exchanged = self.sync.exchange(replicated, lambda: replicated)
        finite = exchanged.finite
        if local:
            _check_state_fits(self.wrapped, local)
            finite = self._local.prepare(local) and finite
        return exchanged, finite

    def _warn_if_changed_since_backward(self) -> None:
        if self._warned_changed:
            return
        changed = self._stamps.changed(self.named_parameters())
        if changed:
            self._warned_changed = True
            warnings.warn(
                f"the gradient of {changed} changed after backward() and before step() "
                f"(by clip_grad_norm_, say): that change acted on this worker's own gradient, "
                f"before averaging. To clip the averaged gradient, call "
                f"optimizer.synchronize() before clipping. (Shown once.)",
                UserWarning,
                stacklevel=3,
            )

    def _refuse_nonfinite(self) -> None:
        bad = [
            name
            for name, param in self.named_parameters()
            if param.grad is not None and not bool(torch.isfinite(param.grad).all())
        ]
        message = (
            f"the averaged gradient of {', '.join(map(repr, bad[:5]))}"
            f"{f' and {len(bad) - 5} more' if len(bad) > 5 else ''} is not finite "
            f"(NaN or Inf on at least one worker) at step {self.num_steps}"
        )
        if self.nonfinite == "raise":
            raise PyroDistributedError(message)
        warnings.warn(f"{message}; every worker skips this step", RuntimeWarning, stacklevel=3)

    def noise_scale(self, batch_size: int | None = None) -> NoiseScale:
        """The gradient noise scale so far (needs ``noise_scale=True``); no communication."""
        if self._noise is None:
            raise ValueError("noise_scale() needs DistributedOptimizer(..., noise_scale=True)")
        return self._noise.estimate(batch_size)

    def get_state(self) -> dict[str, Any]:
        """Per-parameter optimizer state of the replicated parameters, by exchange
        name (for drift checks)."""
        state = self.wrapped.state
        return {name: dict(state[p]) for name, p in self.checked_tensors().items() if p in state}

    def checked_tensors(self) -> dict[str, Tensor]:
        """The parameters that must be identical on every worker (local ones are
        each worker's own), by exchange name."""
        replicated, _ = split_local(dict(self.named_parameters()))
        return replicated


def _check_state_fits(optimizer: torch.optim.Optimizer, local: dict[str, Tensor]) -> None:
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


_Synchronized = tuple[Exchanged, bool]


class _GradStamps:
    """Each parameter's gradient as its last backward pass left it, to notice
    changes made to it afterwards (by clipping, say)."""

    def __init__(self) -> None:
        self._stamps: dict[int, tuple[Tensor, int]] = {}
        self._hooks: dict[int, RemovableHandle] = {}

    def watch(self, params: Sequence[Tensor]) -> None:
        for param in params:
            if id(param) not in self._hooks:
                self._hooks[id(param)] = param.register_post_accumulate_grad_hook(self._stamp)  # type: ignore[no-untyped-call]

    def _stamp(self, param: Tensor) -> None:
        if param.grad is not None:
            self._stamps[id(param)] = (param.grad, grad_version(param.grad))

    def changed(self, named: Iterator[tuple[str, Tensor]]) -> str | None:
        """The name of the first watched parameter whose gradient changed since its
        last backward pass, if any."""
        for name, param in named:
            stamp = self._stamps.pop(id(param), None)
            grad = param.grad
            if stamp is None or grad is None:
                continue
            if grad is not stamp[0] or grad_version(grad) != stamp[1]:
                return repr(name)
        return None
