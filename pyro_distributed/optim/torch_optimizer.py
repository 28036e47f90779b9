"""DistributedTorchOptimizer: any ``torch.optim.Optimizer``, with gradients averaged.

Pyro's torch-native loop trains an ELBO module with a torch optimizer::

    loss_fn = Trace_ELBO()(model, guide)
    loss = loss_fn(batch); loss.backward(); optimizer.step()

``pd.DistributedOptimizer(torch_optimizer)`` returns this wrapper, which is a
``torch.optim.Optimizer`` itself: schedulers, ``zero_grad``,
``state_dict``/``load_state_dict`` and ``add_param_group`` act on the wrapped
optimizer, whose ``param_groups``, ``state`` and ``defaults`` it shares (the
same objects, not copies). :meth:`~DistributedTorchOptimizer.step` hands every
parameter of every group to the same reducer that the Pyro path uses
(:class:`~pyro_distributed.optim.reducer.Reducer`), then lets the wrapped
optimizer step.

Parameters are known to the exchange by their position,
``param_groups[g][i]`` (:class:`ParamGroupNames`), which is the same on every worker that builds its
optimizer the same way; workers whose optimizers differ get an error that
names the positions.

Local parameters owned by their worker (``shard_subsamples(own_local_params=True)``)
never travel; under ``local_updates="sparse"`` they have no ``.grad`` at all,
and ``step()`` steps their selected rows in the same call of the wrapped
optimizer (:mod:`pyro_distributed.optim.sparse_step`, the rules the SVI
path follows).

Clipping: a gradient clipped between ``backward()`` and ``step()`` is still
this worker's own gradient. :meth:`~DistributedTorchOptimizer.synchronize`
averages first, so that clipping acts on the average; a ``step()`` without it
that finds a gradient changed since backward (a clip, a rescale) warns once,
since that change was made to one worker's gradient before averaging.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from ..engines import Engine
from ..exchange import CommHook, Compression, GradBucket, Reducing
from ..local.gradients import split_local
from ..local.registry import local_of
from ..policies import StepPolicy
from ..torch_internals import init_optimizer_hooks
from .front_end import FrontEnd
from .options import DEFAULTS, ReducerOptions
from .reducer import Reduced, Reducer
from .sparse_step import TorchSparseStepper
from .step_guards import GradStamps, check_state_fits

Closure = Callable[[], Any]


class DistributedTorchOptimizer(FrontEnd, torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step()`` averages gradients across workers.

    Made by :class:`~pyro_distributed.DistributedOptimizer` when it is given a
    torch optimizer; it takes the same keyword arguments (but
    ``multi_tensor``, which a torch optimizer decides for itself).

    Example::

        pyro.settings.set(module_local_params=True)
        loss_fn = Trace_ELBO()(model, guide)
        loss_fn(*first_batch)  # AutoGuides create their parameters lazily
        optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.01))
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

    .. warning::
        Under ``shard_subsamples(own_local_params=True, local_updates="sparse")``
        a local parameter's gradient is its selected rows', outside ``.grad``
        (which stays ``None``): ``clip_grad_norm_`` and other code reading
        ``.grad`` do not see it. The wrapped optimizer must be Adam, AdamW,
        SGD or Pyro's ClippedAdam, without the options the lazy rules lack;
        others are refused by name at the first ``step()``
        (:mod:`pyro_distributed.optim.sparse_step`).

    Sparse local steps, the same loop::

        with pd.shard_subsamples(own_local_params=True, local_updates="sparse"):
            loss_fn(*first_batch)  # creates the parameters and cuts the blocks
        optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.01))
        for batch in loader:
            optimizer.zero_grad()
            with pd.shard_subsamples(own_local_params=True, local_updates="sparse"):
                loss_fn(*batch).backward()
            optimizer.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        engine: str | Engine = "auto",
        bucket_cap_mb: float = DEFAULTS.bucket_cap_mb,
        nonfinite: Literal["skip", "raise"] = DEFAULTS.nonfinite,
        check_every: int | None = DEFAULTS.check_every,
        compression: Compression = DEFAULTS.compression,
        overlap: bool = DEFAULTS.overlap,
        noise_scale: bool | float = DEFAULTS.noise_scale,
        comm_hook: CommHook | Callable[[GradBucket, Engine], Reducing] | None = DEFAULTS.comm_hook,
        step_policy: StepPolicy | None = DEFAULTS.step_policy,
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
        options = ReducerOptions.of(
            bucket_cap_mb=bucket_cap_mb,
            nonfinite=nonfinite,
            check_every=check_every,
            compression=compression,
            overlap=overlap,
            noise_scale=noise_scale,
            comm_hook=comm_hook,
            step_policy=step_policy,
        )
        self.wrapped = optimizer
        self._synchronized: Reduced | None = None
        self._stamps = GradStamps()
        self._warned_changed = False
        # Swaps the rows of local_updates="sparse" parameters in (optim.sparse_step).
        self._sparse = TorchSparseStepper(optimizer)
        self._names = ParamGroupNames(optimizer)
        self._reducer = Reducer(engine, options, GroupCatalog(self._names), "optimizer")
        # The hooks go on before local rows are cut (construction, not the
        # first step): a hook added to a parameter after its rows were cut in
        # place breaks its next backward. One worker has no average to clip.
        self._stamps.watch([param for _, param in self.named_parameters()])
        if self._reducer.bound and self._reducer.sync is None:
            self._stamps.unwatch()
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

    def state_dict(self) -> dict[str, Any]:
        return self.wrapped.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped.zero_grad(set_to_none)
        # The gradients of rows handed out under local_updates="sparse" too.
        self._sparse.zero_grad()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wrapped.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wrapped.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedTorchOptimizer is not picklable; save its state_dict()")

    def __repr__(self) -> str:
        engine = self._reducer.describe_engine()
        return f"DistributedTorchOptimizer({self.wrapped!r}, engine={engine})"

    # -- the step

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """Every parameter of every group, by the name the exchange knows it by."""
        return self._names.named_parameters()

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
        self._synchronized = self._reduce()

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
        reduced = self._synchronized
        if reduced is None:
            # A step alone (the step policy's) has nothing to average first.
            if self.sync is not None and self._reducer.averages_next_step():
                self._warn_if_changed_since_backward()
            reduced = self._reduce()
        self._synchronized = None
        try:
            if reduced.finite:
                # The wrapped optimizer's own step: every dense parameter on its
                # (averaged) .grad and, swapped in for their parameters, the rows
                # of sparse local ones (local_updates="sparse").
                with self._sparse.swapped_in(reduced.sparse):
                    self.wrapped.step()
        finally:
            self._finish(reduced)
        if reduced.exchanged is None:
            self._stamps.unwatch()  # one worker has no average to clip
        elif not self._warned_changed:
            self._stamps.watch(reduced.exchanged.tensors)
        return loss

    def _reduce(self) -> Reduced:
        # First: an optimizer without a lazy rule is refused before anything travels.
        sparse = self._sparse.take()
        # Names are positions in the groups: the same ids in the same places,
        # the same names, and the same plan.
        groups, reducer = self.wrapped.param_groups, self._reducer
        key = tuple(tuple(map(id, group["params"])) for group in groups)
        plan = reducer.plan_for(key) or reducer.new_plan(key, dict(self.named_parameters()))
        if plan.local and reducer.sync is not None:
            # Refused before anything travels: local parameters this optimizer cannot step.
            check_state_fits(self.wrapped, plan.local)
        return reducer.reduce(plan, sparse)

    def _warn_if_changed_since_backward(self) -> None:
        if self._warned_changed:
            return
        changed = self._stamps.changed()
        if changed is not None:
            self._warned_changed = True
            self._stamps.unwatch()  # shown once: the hooks have nothing more to say
            name = next(name for name, param in self.named_parameters() if param is changed)
            warnings.warn(
                f"the gradient of {name!r} changed after backward() and before step() "
                f"(by clip_grad_norm_, say): that change acted on this worker's own gradient, "
                f"before averaging. To clip the averaged gradient, call "
                f"optimizer.synchronize() before clipping. (Shown once.)",
                UserWarning,
                stacklevel=3,
            )

    def get_state(self) -> dict[str, Any]:
        """Per-parameter optimizer state of the replicated parameters, by exchange
        name (for drift checks)."""
        return self._names.state()

    def _own_optimizer_state(self) -> Any:
        # Owned local rows' state travels in their blocks, not here.
        saved = self.wrapped.state_dict()
        params = [param for group in self.wrapped.param_groups for param in group["params"]]
        saved["state"] = {
            index: state
            for index, state in saved["state"].items()
            if local_of(params[index]) is None
        }
        return saved

    def _load_own_optimizer_state(self, state: Any) -> None:
        merged = self.wrapped.state_dict()  # the local rows' state, from their blocks
        merged["state"] = {**merged["state"], **state["state"]}
        self.wrapped.load_state_dict({**state, "state": merged["state"]})

    def checked_tensors(self) -> dict[str, Tensor]:
        """The parameters that must be identical on every worker (local ones are
        each worker's own), by exchange name."""
        return self._names.catalog()


class ParamGroupNames:
    """A torch optimizer's parameters by their position, ``param_groups[g][i]``:
    the names every worker shares for them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        for g, group in enumerate(self._optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                yield f"param_groups[{g}][{i}]", param

    def catalog(self) -> dict[str, Tensor]:
        """The parameters that travel (local ones left out), by name."""
        replicated, _ = split_local(dict(self.named_parameters()))
        return replicated

    def state(self) -> dict[str, Any]:
        """The optimizer's per-parameter state of :meth:`catalog`, by name."""
        state = self._optimizer.state
        return {name: dict(state[p]) for name, p in self.catalog().items() if p in state}


class GroupCatalog(Mapping[str, Tensor]):
    """The parameters that travel, by position, read live from the optimizer's
    groups: the exchange's catalog (read when workers disagree)."""

    def __init__(self, names: ParamGroupNames) -> None:
        self._names = names

    def __getitem__(self, name: str) -> Tensor:
        return self._names.catalog()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names.catalog())

    def __len__(self) -> int:
        return len(self._names.catalog())
