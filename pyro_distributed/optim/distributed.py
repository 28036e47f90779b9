"""DistributedOptimizer: any PyroOptim, with gradients averaged across workers.

It wraps the user's optimizer instead of rebuilding it: clipping, schedulers,
per-parameter arguments and state all stay the wrapped optimizer's own code.
Everything around the gradient exchange is the reducer's
(:class:`~pyro_distributed.optim.reducer.Reducer`); this front end hands it
the parameters by their param-store names, once per plan, and the param
store as the exchange's catalog (:class:`ParamStoreCatalog`), and steps the
wrapped optimizer between the reducer's calls (one multi-tensor optimizer
where that is exact, and the rows of sparse local parameters), so that
clipping sees the averaged gradient.

With one worker it does none of it but the step, and costs nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import pyro
import torch
from pyro.optim import PyroOptim
from torch import Tensor

from ..checks import check_bool
from ..engines import Engine
from ..exchange import CommHook, Compression, GradBucket, Reducing
from ..local.registry import local_params
from ..policies import StepPolicy
from ..pyro_internals import stored_unconstrained
from .front_end import FrontEnd
from .multi_tensor import GroupedStepper, grouping_refusal, groups_exactly
from .options import DEFAULTS, ReducerOptions
from .reducer import Reduced, Reducer
from .schedulers import step_schedulers
from .sparse_step import SparseStepper


class DistributedOptimizer(FrontEnd, PyroOptim):
    """Wrap a :class:`~pyro.optim.PyroOptim` for data-parallel SVI.

    Each worker runs the same model and guide on its own data; every call
    averages the gradients across workers before the wrapped optimizer steps,
    so all workers keep bitwise identical parameters. ``SVI`` accepts it like
    any Pyro optimizer, and the same script runs as one plain process.

    :param pyro_optim: the optimizer to distribute, for example
        ``pyro.optim.Adam({"lr": 0.01})``, a ``PyroLRScheduler``, or
        ``ClippedAdam``. It is used, not copied: keep using it if you like.
        For a ``torch.optim.Optimizer`` (Pyro's torch-native loop) use
        :class:`~pyro_distributed.DistributedTorchOptimizer`, a torch
        optimizer itself with the same arguments but ``multi_tensor``.
        Passed one here, this class still returns that one with a
        :class:`DeprecationWarning` (the spelling of 0.x); the result is not
        an instance of this class, whose ``step`` means something else.
    :param engine: ``"auto"`` (default), ``"torch"``, ``"horovod"``, ``"mpi"``,
        ``"local"``, or a running :class:`~pyro_distributed.engines.Engine`.
        A name other than ``"local"`` is bound at the first step, not here,
        with :func:`pyro_distributed.init`: an optimizer built before
        Lightning (or any launcher) has created its process group still
        averages over all of its workers.
    :param bucket_cap_mb: largest fused gradient buffer, in MiB.
    :param nonfinite: what every worker does when an averaged gradient holds
        NaN or Inf (a non-finite gradient on any worker reaches the average):
        ``"skip"`` (default) the step with a :class:`RuntimeWarning` naming the
        parameters, or ``"raise"`` :class:`~pyro_distributed.PyroDistributedError`.
        Checked when there is more than one worker.
    :param check_every: run :func:`~pyro_distributed.assert_in_sync` after
        every ``check_every``-th step (default: never).
    :param compression: ``"none"`` (default), ``"fp16"`` or ``"bf16"``: send
        gradients in half precision, dividing by the world size before
        summation. The error bound is in :mod:`pyro_distributed.exchange.compression`.
    :param multi_tensor: step all parameters that share hyper-parameters with
        one multi-tensor (``foreach``) torch optimizer instead of one optimizer
        per parameter (:mod:`pyro_distributed.optim.multi_tensor`). ``None``
        (default): whenever that is bitwise exact, which is for plain
        ``pyro.optim`` Adam, AdamW, SGD, RMSprop, Adagrad and Adamax without
        ``clip_args``. ``True`` also groups NAdam and RAdam (rounding differs
        slightly); ``False`` never groups.
    :param overlap: start averaging gradients during backward, as soon as a
        bucket's gradients are complete (:mod:`pyro_distributed.exchange.overlap`).
        Bitwise the same results as without; on by default.
    :param noise_scale: ``True``, or a smoothing factor in (0, 1), measures the
        gradient noise scale at every step (:meth:`noise_scale`,
        :mod:`pyro_distributed.optim.noise_scale`); needs two or more workers, else
        ``ValueError`` at the first step. The norms ride in the gradient buckets (results
        are unchanged), so pass the same value on every worker.
    :param comm_hook: how each bucket of gradients travels, in place of the
        exact average (:mod:`pyro_distributed.exchange.hooks`): for example
        :class:`~pyro_distributed.LowRankHook`, or a function ``(bucket,
        engine) -> Reducing``. With ``compression``, the hook runs on the
        bucket cast to the narrow type. A hook's state is saved in
        checkpoints (:mod:`pyro_distributed.exchange.hooks` gives the rules).
    :param step_policy: when workers exchange, and what (:mod:`pyro_distributed.policies`):
        ``None`` (default) averages every step's gradients; :class:`~pyro_distributed.LocalSGD`
        averages the parameters every few steps; :class:`~pyro_distributed.DiLoCo` steps an
        outer optimizer by the workers' averaged moves. Workers then differ between sync
        points (:attr:`~pyro_distributed.DistributedOptimizer.in_sync`).

    Example::

        import pyro, pyro_distributed as pd
        from pyro.infer import SVI, Trace_ELBO

        optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}))
        svi = SVI(model, guide, optim, Trace_ELBO())
        for step in range(1000):
            loss = svi.step(my_shard_of_the_data)

    Run it with ``torchrun --nproc-per-node 2 train.py`` (or plain
    ``python train.py`` for one worker).

    .. warning::
        Every worker must call the optimizer (``svi.step``) the same number of
        times: each call is a collective. A worker that stops early leaves the
        others waiting until the engine's time-out, after which they raise
        :class:`~pyro_distributed.PyroDistributedError`.

    .. warning::
        Every worker must create the same parameters, with the same names,
        shapes and dtypes. A parameter used by only some workers in a step is
        still stepped on all of them (the others contribute a zero gradient),
        but it must exist in every worker's param store; otherwise every worker
        raises :class:`~pyro_distributed.PyroDistributedError` naming it.

    .. warning::
        The first time a parameter reaches the optimizer, every worker takes
        worker 0's value for it. The gradient of that first step was computed
        by each worker at its own initial value; seed workers identically
        before parameters are created if that first step must be exact.

    .. warning::
        With ``overlap=True`` (the default) a backward pass sends gradients
        as it runs. Follow every backward pass through the optimizer's
        parameters with an optimizer call on every worker, as ``svi.step``
        does; a backward pass on some workers only (say, a diagnostic on
        worker 0) is corrected at the next call, but one that no call
        follows leaves sends unanswered. Pass ``overlap=False`` for such
        scripts.

    .. warning::
        An optimizer bound to one worker (stepped, or built with
        ``engine="local"``, before the process group existed) raises
        :class:`~pyro_distributed.PyroDistributedError` at its next step once
        a group of more workers exists, instead of averaging over one worker.

    .. warning::
        Give each worker different data. Inside ``pyro.plate(...,
        subsample_size=b)`` every worker draws the same subsample unless the
        subsampling is sharded; otherwise the workers duplicate each other.
    """

    _stepper: GroupedStepper | None

    def __new__(cls, pyro_optim: Any = None, *args: Any, **kwargs: Any) -> Any:
        # The 0.x spelling for the torch front end: one name for two classes
        # would make isinstance() lie, so it warns and names the right class.
        if cls is DistributedOptimizer and isinstance(pyro_optim, torch.optim.Optimizer):
            warnings.warn(
                "DistributedOptimizer(torch_optimizer) is deprecated: use "
                "pd.DistributedTorchOptimizer(torch_optimizer), which it returns",
                DeprecationWarning,
                stacklevel=2,
            )
            from .torch_optimizer import DistributedTorchOptimizer  # only for the old spelling

            return DistributedTorchOptimizer(pyro_optim, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        pyro_optim: PyroOptim,
        *,
        engine: str | Engine = "auto",
        bucket_cap_mb: float = DEFAULTS.bucket_cap_mb,
        nonfinite: Literal["skip", "raise"] = DEFAULTS.nonfinite,
        check_every: int | None = DEFAULTS.check_every,
        compression: Compression = DEFAULTS.compression,
        multi_tensor: bool | None = None,
        overlap: bool = DEFAULTS.overlap,
        noise_scale: bool | float = DEFAULTS.noise_scale,
        comm_hook: CommHook | Callable[[GradBucket, Engine], Reducing] | None = DEFAULTS.comm_hook,
        step_policy: StepPolicy | None = DEFAULTS.step_policy,
    ) -> None:
        # No super().__init__() on purpose: all optimizer state lives in the
        # wrapped optimizer, and attribute reads fall through to it (__getattr__).
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
        check_bool("multi_tensor", multi_tensor, optional=True)
        self._configure(pyro_optim, engine, options, multi_tensor)

    def _configure(
        self,
        pyro_optim: PyroOptim,
        engine: str | Engine,
        options: ReducerOptions,
        multi_tensor: bool | None = None,
    ) -> None:
        """Set up the wrapper; shared by every constructor of this family."""
        if not isinstance(pyro_optim, PyroOptim):
            raise TypeError(
                f"pyro_optim must be a pyro.optim.PyroOptim, such as "
                f"pyro.optim.Adam({{'lr': 0.01}}), or a torch.optim.Optimizer; "
                f"got {type(pyro_optim).__name__}"
            )
        if isinstance(pyro_optim, DistributedOptimizer):
            raise TypeError(
                f"pyro_optim is already a {type(pyro_optim).__name__}; "
                f"wrap the plain optimizer once"
            )
        self.wrapped = pyro_optim
        if multi_tensor:
            refusal = grouping_refusal(pyro_optim)
            if refusal is not None:
                raise ValueError(f"multi_tensor=True is not available: {refusal}")
        grouped = multi_tensor or (multi_tensor is None and groups_exactly(pyro_optim))
        self._stepper = GroupedStepper(pyro_optim) if grouped else None
        # Steps the rows of local_updates="sparse" parameters (optim.sparse_step).
        self._sparse = SparseStepper(pyro_optim)
        self._reducer = Reducer(engine, options, ParamStoreCatalog(), "param store")
        #: What the next step must step, after a checkpoint was loaded (names, file).
        self._expected: tuple[frozenset[str], str] | None = None
        for hook in list(_ON_CREATED):
            hook(self)

    @property
    def grouped(self) -> bool:
        """Whether parameters are stepped by multi-tensor optimizers (``multi_tensor``)."""
        return self._stepper is not None

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this object lacks: read the wrapped
        # optimizer's (optim_objs, pt_optim_args, ...), so nothing it offers is lost.
        wrapped = self.__dict__.get("wrapped")
        if wrapped is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(wrapped, name)

    def __call__(self, params: Iterable[Tensor], *args: Any, **kwargs: Any) -> None:
        """Average gradients across workers, then step the wrapped optimizer.

        :param params: the unconstrained parameters to step, as SVI passes them
            (a set), or a list or ``dict.values()``.
        """
        # Parameters read under local_updates="sparse" leave here: they have
        # row gradients, not a .grad (pyro_distributed.local.sparse).
        if self._expected is not None:
            params = list(params)
            self._check_expected(params)
        params, sparse = self._sparse.take(params)
        # SVI hands over a new set of the same tensors at every step: the same
        # ids, the same plan (one pass, in C).
        reducer, key = self._reducer, frozenset(map(id, params))
        plan = reducer.plan_for(key) or reducer.new_plan(
            key, _by_store_name(params, required=reducer.sync is not None)
        )
        reduced = reducer.reduce(plan, sparse)
        try:
            if reduced.finite:
                self._step_wrapped(reduced, args, kwargs)
        finally:
            self._finish(reduced)

    def _step_wrapped(self, reduced: Reduced, args: Any, kwargs: Any) -> None:
        """Step the wrapped optimizer on ``reduced.tensors``, then the sparse rows."""
        if self._stepper is not None:
            self._stepper.step(reduced.tensors)
        else:
            self.wrapped(reduced.tensors, *args, **kwargs)  # type: ignore[arg-type]
        self._sparse.step(reduced.sparse)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped optimizer's learning-rate schedulers.

        Takes what the wrapped :class:`~pyro.optim.lr_scheduler.PyroLRScheduler`
        takes. For ``ReduceLROnPlateau`` the metric (the first argument, or
        ``metrics=``) is averaged across workers first, so every worker
        changes its learning rate at the same step.

        .. warning::
            With ``ReduceLROnPlateau`` this is a collective: call it on every
            worker, at the same point.
        """
        step_schedulers(self.wrapped, self.engine, args, kwargs)

    def expect_parameters(self, names: Iterable[str], source: str) -> None:
        """Refuse the next step unless it steps exactly ``names``: those a
        checkpoint loaded from ``source`` holds. Parameters a guide creates at
        its first call cannot be compared when the checkpoint is loaded."""
        self._expected = (frozenset(names), source)

    def _check_expected(self, params: list[Tensor]) -> None:
        assert self._expected is not None
        expected, source = self._expected
        self._expected = None
        store = pyro.get_param_store()
        stepped = {name for name in map(store.param_name, params) if name is not None}
        new, unused = sorted(stepped - expected), sorted(expected - stepped)
        if new or unused:
            said = [f"parameters {new} are trained but not in the checkpoint"] if new else []
            said += [f"{unused} are in the checkpoint but not trained"] if unused else []
            raise ValueError(
                f"the checkpoint {source!r} is of a different model: {'; '.join(said)}. "
                f"Load this model's checkpoint, or pass strict=False to load_checkpoint "
                f"to load the parameters the two share"
            )

    def forget(self) -> None:
        """Treat every parameter as new, after the param store's tensors were
        replaced (:func:`~pyro_distributed.load_checkpoint` calls it).

        Ends what the optimizer learned of its parameters (see
        :meth:`FrontEnd.forget <pyro_distributed.optim.front_end.FrontEnd.forget>`)
        and drops the per-parameter optimizers: new ones are made as each
        parameter reaches the optimizer again, and they take the state given
        to :meth:`set_state`. Every parameter takes worker 0's value once more
        at the next step.

        .. warning::
            Call it on every worker at the same step.
        """
        self.wrapped.optim_objs.clear()
        self.wrapped.grad_clip.clear()
        super().forget()

    def checked_tensors(self) -> dict[str, Tensor]:
        """The parameters that must be identical on every worker: the param store."""
        return _param_store()

    def get_state(self) -> dict[str, Any]:
        """The optimizer state, keyed by param-store name, in PyroOptim's format."""
        return self.wrapped.get_state()

    def set_state(self, state_dict: dict[str, Any]) -> None:
        """Hand state to the wrapped optimizer; applied as each parameter appears."""
        self.wrapped.set_state(state_dict)

    def _own_optimizer_state(self) -> Any:
        # Owned local rows' state travels in their blocks, not here.
        local = local_params()
        saved = self.wrapped.get_state()
        return {name: state for name, state in saved.items() if name not in local}

    def _load_own_optimizer_state(self, state: Any) -> None:
        self.wrapped.set_state(state)  # applied as each parameter's optimizer is made

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.wrapped!r}, engine={self._reducer.describe_engine()})"


#: Called with every DistributedOptimizer as it is made (see :func:`watch_created`).
_ON_CREATED: list[Callable[[DistributedOptimizer], None]] = []


def watch_created(hook: Callable[[DistributedOptimizer], None]) -> Callable[[], None]:
    """Call ``hook(optimizer)`` for every :class:`DistributedOptimizer` made from
    now on, in this process, once it is set up; returns what stops it. A
    launched worker resumes and collects the optimizers its function makes so."""
    _ON_CREATED.append(hook)
    return lambda: _ON_CREATED.remove(hook)


class ParamStoreCatalog(Mapping[str, Tensor]):
    """The param store's unconstrained tensors by name, read live: what this
    front end could step (the exchange's catalog, read when workers disagree)."""

    def __getitem__(self, name: str) -> Tensor:
        tensor = stored_unconstrained(name)
        if tensor is None:
            raise KeyError(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(list(pyro.get_param_store().keys()))

    def __len__(self) -> int:
        return len(pyro.get_param_store())


def _by_store_name(params: Iterable[Tensor], required: bool = True) -> dict[str, Tensor]:
    """``params`` by their param-store names, the names every worker shares
    (``required=False``, with one worker: a tensor outside the store is named
    by its place, as nothing is exchanged)."""
    store = pyro.get_param_store()
    named = {}
    for place, param in enumerate(params):
        name = store.param_name(param)
        if name is None and not required:
            name = f"tensor {place}"
        if name is None:
            raise ValueError(
                f"a tensor of shape {tuple(param.shape)} passed to the optimizer is not in "
                f"Pyro's param store; distributed optimizers name parameters by their "
                f"param-store names (create them with pyro.param or a PyroModule)"
            )
        named[name] = param
    return named


def _param_store() -> dict[str, Tensor]:
    """Every parameter this worker could step: its param store."""
    return dict(pyro.get_param_store().named_parameters())
