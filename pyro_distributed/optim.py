"""DistributedOptimizer: any PyroOptim, with gradients averaged across workers.

It wraps the user's optimizer instead of rebuilding it: clipping, schedulers,
per-parameter arguments and state all stay the wrapped optimizer's own code.
A call does three things, in the same order on every worker:

1. agree on the sorted list of parameters, synchronising new ones
   (:mod:`pyro_distributed.agreement`);
2. average their gradients in a few fused buffers (:mod:`pyro_distributed.reduce`);
   with overlap, most buckets already left during backward
   (:mod:`pyro_distributed.overlap`), and step 1 confirms they were the right ones;
3. let the wrapped optimizer step, so that clipping sees the averaged gradient.

With one worker it does none of the first two and costs nothing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import pyro
import torch
from pyro.optim import PyroOptim
from torch import Tensor

from . import runtime
from .agreement import (
    DIGEST_FLOATS,
    ParameterAgreement,
    Proposal,
    StepParams,
    digest_floats,
    digests_equal,
)
from .compression import Compression, compressor
from .consistency import assert_in_sync
from .engines import Engine
from .errors import PyroDistributedError
from .multi_tensor import GroupedStepper, grouping_refusal, groups_exactly
from .noise_scale import NoiseScale, NoiseScaleEstimator
from .overlap import BackwardOverlap
from .ownership import LocalGradients, split_local
from .reduce import GradientAverager, Reduction
from .schedulers import step_schedulers

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(PyroOptim):
    """Wrap a :class:`~pyro.optim.PyroOptim` for data-parallel SVI.

    Each worker runs the same model and guide on its own data; every call
    averages the gradients across workers before the wrapped optimizer steps,
    so all workers keep bitwise identical parameters. ``SVI`` accepts it like
    any Pyro optimizer, and the same script runs as one plain process.

    :param pyro_optim: the optimizer to distribute, for example
        ``pyro.optim.Adam({"lr": 0.01})``, a ``PyroLRScheduler``, or
        ``ClippedAdam``. It is used, not copied: keep using it if you like.
    :param engine: ``"auto"`` (default), ``"torch"``, ``"horovod"``, ``"mpi"``,
        ``"local"``, or a running :class:`~pyro_distributed.engines.Engine`.
        A name starts the engine with :func:`pyro_distributed.init` if needed.
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
        summation. The error bound is in :mod:`pyro_distributed.compression`.
    :param multi_tensor: step all parameters that share hyper-parameters with
        one multi-tensor (``foreach``) torch optimizer instead of one optimizer
        per parameter (:mod:`pyro_distributed.multi_tensor`). ``None``
        (default): whenever that is bitwise exact, which is for plain
        ``pyro.optim`` Adam, AdamW, SGD, RMSprop, Adagrad and Adamax without
        ``clip_args``. ``True`` also groups NAdam and RAdam (rounding differs
        slightly); ``False`` never groups.
    :param overlap: start averaging gradients during backward, as soon as a
        bucket's gradients are complete (:mod:`pyro_distributed.overlap`).
        Bitwise the same results as without; on by default.
    :param noise_scale: ``True``, or a smoothing factor in (0, 1), measures the
        gradient noise scale at every step (:meth:`noise_scale`,
        :mod:`pyro_distributed.noise_scale`); needs two or more workers, else
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
        Give each worker different data. Inside ``pyro.plate(...,
        subsample_size=b)`` every worker draws the same subsample unless the
        subsampling is sharded; otherwise the workers duplicate each other.
    """

    _stepper: GroupedStepper | None

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
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number, got {bucket_cap_mb!r}")
        if not (math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be positive and finite, got {bucket_cap_mb!r}")
        if not isinstance(engine, (str, Engine)):
            raise TypeError(f"engine must be a name or an Engine, got {type(engine).__name__}")
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        if check_every is not None and (
            isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1
        ):
            raise ValueError(f"check_every must be a positive int or None, got {check_every!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        if multi_tensor is not None and not isinstance(multi_tensor, bool):
            raise TypeError(f"multi_tensor must be True, False or None, got {multi_tensor!r}")
        reduction = Reduction(compression=compressor(compression))
        running = runtime.init(engine) if isinstance(engine, str) else engine
        self._configure(
            pyro_optim,
            running,
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
        engine: Engine,
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
                f"pyro.optim.Adam({{'lr': 0.01}}); got {type(pyro_optim).__name__}"
            )
        if isinstance(pyro_optim, DistributedOptimizer):
            raise TypeError(
                f"pyro_optim is already a {type(pyro_optim).__name__}; "
                f"wrap the plain optimizer once"
            )
        self.wrapped = pyro_optim
        self.engine = engine
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
        cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        self._agreement = ParameterAgreement(engine, cap_bytes)
        self._noise = NoiseScaleEstimator.create(noise_scale, engine.world_size)
        self._averager = GradientAverager(engine, cap_bytes, reduction, self._noise is not None)
        self._overlap = (
            BackwardOverlap(engine, self._averager) if overlap and engine.world_size > 1 else None
        )
        self._local = LocalGradients(engine)

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
        if self.engine.world_size == 1:
            self._step_wrapped(params, *args, **kwargs)
            return
        # Local parameters (pyro_distributed.ownership) never travel.
        params, local = split_local(params)
        step, finite = self._average(params)
        if local:
            finite = self._local.prepare(local) and finite
        if finite:
            if self._noise is not None and step.tensors:  # before the wrapped optimizer clips
                self._noise.observe(*self._averager.squared_norms())
            self._step_wrapped([*step.tensors, *local], *args, **kwargs)
        else:
            self._refuse_nonfinite([*step.tensors, *local])
        for name, param in zip(step.names, step.tensors, strict=True):
            if name in step.borrowed:
                # This worker's SVI will not zero it; a stale average must not
                # count as this worker's gradient next step.
                param.grad = None
        if self.check_every and self.num_steps % self.check_every == 0:
            assert_in_sync(self)

    def _average(self, params: Iterable[Tensor]) -> tuple[StepParams, bool]:
        """Agree on the step's parameters and average their gradients.

        Returns the step and whether every averaged gradient is finite.
        """
        proposal = self._agreement.propose(params)
        overlap = self._overlap
        if overlap is None or not overlap.armed:
            step = self._agreement.settle(proposal).step
            finite = self._averager.average_(step.names, step.tensors)
        else:
            step, finite = self._average_overlapped(proposal, overlap)
        if overlap is not None:
            overlap.after_step(step.names, step.tensors)
        return step, finite

    def _average_overlapped(
        self, proposal: Proposal, overlap: BackwardOverlap
    ) -> tuple[StepParams, bool]:
        # Every bucket leaves before the header, on every worker alike; the
        # header then says whether they held the right parameters.
        overlap.send_remaining()
        stale = overlap.stale_flags()
        if overlap.carrier is not None:
            summed = overlap.send_carrier([*digest_floats(proposal.digest), *stale])
            unanimous = digests_equal(summed, self.engine.world_size)
            resend = [int(flag > 0) for flag in summed[DIGEST_FLOATS:]]
            if unanimous and not proposal.new and proposal.names == overlap.names:
                return self._agreement.accept(proposal), overlap.finish(resend)
            overlap.discard()
            step = self._agreement.settle(proposal).step
        else:
            settlement = self._agreement.settle(proposal, stale)
            step = settlement.step
            if settlement.unchanged and step.names == overlap.names:
                return step, overlap.finish(resend=settlement.riders)
            overlap.discard()
        return step, self._averager.average_(step.names, step.tensors)

    def _step_wrapped(self, params: Iterable[Tensor], *args: Any, **kwargs: Any) -> None:
        if self._stepper is not None:
            self._stepper.step(params)
        else:
            self.wrapped(params, *args, **kwargs)  # type: ignore[arg-type]

    def _refuse_nonfinite(self, params: Sequence[Tensor]) -> None:
        """Skip the step (or raise), identically on every worker."""
        store = pyro.get_param_store()
        bad = [
            store.param_name(param) or "?"
            for param in params
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
        """The gradient noise scale so far (needs ``noise_scale=True``); no communication.

        ``batch_size`` (data points per worker per step) adds B_simple in data
        points. ``print(optim.noise_scale(32))`` shows the figures and a reading.
        """
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
        self._agreement.forget()
        if self._overlap is not None:
            self._overlap.reset()
        if self._stepper is not None:
            self._stepper.forget()

    def get_state(self) -> dict[str, Any]:
        """The optimizer state, keyed by param-store name, in PyroOptim's format."""
        return self.wrapped.get_state()

    def set_state(self, state_dict: dict[str, Any]) -> None:
        """Hand state to the wrapped optimizer; applied as each parameter appears."""
        self.wrapped.set_state(state_dict)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.wrapped!r}, engine={self.engine!r})"
