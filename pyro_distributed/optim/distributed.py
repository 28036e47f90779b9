"""DistributedOptimizer: any PyroOptim, with gradients averaged across workers.

It wraps the user's optimizer instead of rebuilding it: clipping, schedulers,
per-parameter arguments and state all stay the wrapped optimizer's own code.
A call reads as the sequence it runs, the same on every worker:

1. split off local parameters, whose gradients never travel
   (:mod:`pyro_distributed.local`);
2. exchange the gradients of the rest (:class:`~pyro_distributed.exchange.sync.GradientSync`:
   agree on the parameters, average them, overlapped with backward);
3. prepare the local gradients; observe the gradient noise scale;
4. let the wrapped optimizer step, so that clipping sees the averaged
   gradient, and drop gradients borrowed from other workers.

With one worker it does none of it but the step, and costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import pyro
import torch
from pyro.optim import PyroOptim
from torch import Tensor

from ..checks import check_bool
from ..engines import Engine
from ..exchange import Compression, GradientSync, Reduction, compressor
from ..local.gradients import LocalGradients, split_local
from .consistency import assert_in_sync
from .multi_tensor import GroupedStepper, grouping_refusal, groups_exactly
from .noise_scale import NoiseScale, NoiseScaleEstimator
from .options import BindsAtFirstStep, EngineBinding, bind_exchange, check_options
from .schedulers import step_schedulers
from .sparse_step import SparseStepper, nonfinite, scale_rows
from .step_guards import refuse_nonfinite
from .torch_optimizer import DistributedTorchOptimizer

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(BindsAtFirstStep, PyroOptim):
    """Wrap a :class:`~pyro.optim.PyroOptim` for data-parallel SVI.

    Each worker runs the same model and guide on its own data; every call
    averages the gradients across workers before the wrapped optimizer steps,
    so all workers keep bitwise identical parameters. ``SVI`` accepts it like
    any Pyro optimizer, and the same script runs as one plain process.

    :param pyro_optim: the optimizer to distribute, for example
        ``pyro.optim.Adam({"lr": 0.01})``, a ``PyroLRScheduler``, or
        ``ClippedAdam``. It is used, not copied: keep using it if you like.
        A ``torch.optim.Optimizer`` instead (Pyro's torch-native loop) gives a
        :class:`~pyro_distributed.optim.torch_optimizer.DistributedTorchOptimizer`,
        which is a torch optimizer itself and takes the same arguments but
        ``multi_tensor``.
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
        ``ValueError`` here. The norms ride in the gradient buckets (results
        are unchanged), so pass the same value on every worker.

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
        # A torch optimizer gets the torch front end, which is a
        # torch.optim.Optimizer itself (Pyro's torch-native loop); the
        # arguments are the same, so one name serves both paths.
        if cls is DistributedOptimizer and isinstance(pyro_optim, torch.optim.Optimizer):
            return DistributedTorchOptimizer(pyro_optim, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        pyro_optim: PyroOptim,
        *,
        engine: str | Engine = "auto",
        bucket_cap_mb: float = 25.0,
        nonfinite: Literal["skip", "raise"] = "skip",
        check_every: int | None = None,
        compression: Compression = "none",
        multi_tensor: bool | None = None,
        overlap: bool = True,
        noise_scale: bool | float = False,
    ) -> None:
        # No super().__init__() on purpose: all optimizer state lives in the
        # wrapped optimizer, and attribute reads fall through to it (__getattr__).
        check_options(bucket_cap_mb, nonfinite, check_every, overlap)
        check_bool("multi_tensor", multi_tensor, optional=True)
        reduction = Reduction(compression=compressor(compression))
        self._configure(
            pyro_optim,
            engine,
            bucket_cap_mb,
            reduction,
            nonfinite,
            check_every,
            overlap,
            multi_tensor,
            noise_scale,
        )

    def _configure(
        self,
        pyro_optim: PyroOptim,
        engine: str | Engine,
        bucket_cap_mb: float,
        reduction: Reduction,
        nonfinite: Literal["skip", "raise"] = "skip",
        check_every: int | None = None,
        overlap: bool = True,
        multi_tensor: bool | None = None,
        noise_scale: bool | float = False,
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
        self.nonfinite = nonfinite
        self.check_every = check_every
        if multi_tensor:
            refusal = grouping_refusal(pyro_optim)
            if refusal is not None:
                raise ValueError(f"multi_tensor=True is not available: {refusal}")
        grouped = multi_tensor or (multi_tensor is None and groups_exactly(pyro_optim))
        self._stepper = GroupedStepper(pyro_optim) if grouped else None
        #: How many times the optimizer was called (saved in checkpoints).
        self.num_steps = 0
        self._bucket_cap_mb, self._reduction, self._overlap = bucket_cap_mb, reduction, overlap
        NoiseScaleEstimator.smoothing_of(noise_scale)  # a wrong value fails here, not at step 1
        self._noise_option = noise_scale
        self._noise: NoiseScaleEstimator | None = None
        self._sync: GradientSync | None = None
        self._local: LocalGradients | None = None
        # Steps the rows of local_updates="sparse" parameters (optim.sparse_step).
        self._sparse = SparseStepper(pyro_optim)
        self._binding = EngineBinding(engine)
        if self._binding.bound:
            self._bind()

    def _bind(self) -> None:
        self._noise, self._sync, self._local = bind_exchange(
            self._binding.engine(),
            self._noise_option,
            self._bucket_cap_mb,
            self._reduction,
            self._overlap,
            "param store",
        )

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
        self.num_steps += 1
        # Parameters read under local_updates="sparse" leave here: they have
        # row gradients, not a .grad (pyro_distributed.local.sparse).
        params, sparse = self._sparse.take(params)
        sync = self.sync
        if sync is None:
            self._step_wrapped(params, *args, **kwargs)
            self._sparse.step(sparse)
            return
        assert self._local is not None  # bound with the sync
        replicated, local = split_local(_by_store_name(params))
        local_finite = True
        if local or sparse:
            # Local gradients never travel: scaled and checked here, and the
            # check rides with the exchange's header to every worker.
            rows_finite = scale_rows(sparse, self.engine.world_size)
            owned = {**local, **{rows.name: rows.tensor for rows in sparse}}
            local_finite = self._local.prepare(owned, rows_finite)
        exchanged = sync.exchange(replicated, _param_store, nonfinite_here=not local_finite)
        finite = exchanged.finite
        stepped = [*exchanged.tensors, *local.values()]
        if finite:
            if self._noise is not None and exchanged.tensors:  # before the wrapped optimizer clips
                self._noise.observe(*sync.squared_norms())
            self._step_wrapped(stepped, *args, **kwargs)
            self._sparse.step(sparse)
        else:
            store = pyro.get_param_store()
            named = [(store.param_name(p) or "?", p) for p in stepped]
            refuse_nonfinite(named, self.num_steps, self.nonfinite, extra=nonfinite(sparse))
        exchanged.release_borrowed()
        if self.check_every and self.num_steps % self.check_every == 0:
            assert_in_sync(self)

    def _step_wrapped(self, params: Iterable[Tensor], *args: Any, **kwargs: Any) -> None:
        if self._stepper is not None:
            self._stepper.step(params)
        else:
            self.wrapped(params, *args, **kwargs)  # type: ignore[arg-type]

    def noise_scale(self, batch_size: int | None = None) -> NoiseScale:
        """The gradient noise scale so far (needs ``noise_scale=True``); no communication.

        ``batch_size`` (data points per worker per step) adds B_simple in data
        points. ``print(optim.noise_scale(32))`` shows the figures and a reading.
        """
        self.engine  # noqa: B018 (binds the engine)
        if self._noise is None:
            raise ValueError("noise_scale() needs DistributedOptimizer(..., noise_scale=True)")
        return self._noise.estimate(batch_size)

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

    def _forget_parameters(self) -> None:
        """Drop per-parameter optimizers and sync records after a checkpoint was loaded.

        New ones are made as each parameter reaches the optimizer again, and
        they take the loaded state; parameters are broadcast once more.
        """
        self.wrapped.optim_objs.clear()
        self.wrapped.grad_clip.clear()
        if self._sync is not None:
            self._sync.forget()
        if self._stepper is not None:
            self._stepper.forget()
        self._sparse.forget()

    def checked_tensors(self) -> dict[str, Tensor]:
        """The parameters that must be identical on every worker: the param store."""
        return _param_store()

    def get_state(self) -> dict[str, Any]:
        """The optimizer state, keyed by param-store name, in PyroOptim's format."""
        return self.wrapped.get_state()

    def set_state(self, state_dict: dict[str, Any]) -> None:
        """Hand state to the wrapped optimizer; applied as each parameter appears."""
        self.wrapped.set_state(state_dict)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.wrapped!r}, engine={self._binding.describe()})"


def _by_store_name(params: Iterable[Tensor]) -> dict[str, Tensor]:
    """``params`` by their param-store names, the names every worker shares."""
    store = pyro.get_param_store()
    named = {}
    for param in params:
        name = store.param_name(param)
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
