"""Reducer: everything one optimizer step does around the gradient exchange.

A front end (a Pyro optimizer for SVI, a torch optimizer for the torch-native
loop, the next one) steps its wrapped optimizer; the :class:`Reducer` it holds
does the rest, in the same order on every worker. The front end hands it
data, never a function to call back::

    plan = reducer.plan_for(key) or reducer.new_plan(key, named)  # names: once per plan
    reduced = reducer.reduce(plan, sparse)  # exchange: .grad is the average
    try:
        if reduced.finite:
            wrapped.step(reduced.tensors)
    finally:
        reducer.done(reduced)  # buffers, refusal of non-finite, release

:meth:`Reducer.reduce` binds the engine at the first step
(:class:`~.options.EngineBinding`), scales the gradients of local parameters,
which never travel, and the rows of sparse local parameters, as the exchange
scales an average (``GradientSync.average_alone_``: the same operations, so a
local row is bitwise what the replicated run would hold), exchanges the rest
with the flag "some local gradient is not finite" in its header, observes the
noise scale and starts averaging the modules' buffers (:mod:`.module_buffers`),
which travel while the optimizer steps. :meth:`Reducer.done` finishes the
buffers, skips (or refuses) a non-finite step on every worker alike and drops
gradients borrowed from other workers. The drift check every ``check_every``
steps is the front end's (:meth:`Reducer.check_due`), since it reads the
front end's optimizer state.

**One lifecycle.** What the steady state learns lives in one :class:`Epoch`:
the exchange (which tensors were synchronised from worker 0, the overlap's
hooks and order, the last buckets), the modules whose buffers are averaged,
and the step's :class:`Plan` (names, split, the exchange's plan, the stepped
tuple, the buffer groups). A plan lasts while the front end's ``key`` (its
tensors' ids: one pass, in C) and the local registry's generation stay the
last step's; a new key gets a new plan in the same epoch. :meth:`Reducer.forget`
ends the epoch (after a checkpoint replaced the tensors, or a rollback in the
same process) and hands the communication hook the state it is to continue
from: a checkpoint's, or ``{}``. Nothing else is cached: what the front ends
derive from a plan (multi-tensor groups) they recognise by its stepped tuple.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..engines import Engine
from ..exchange import (
    Channel,
    Exchanged,
    ExchangePlan,
    GradientSync,
)
from ..local.gradients import LocalGradients, nonfinite_rows, scale_row_grads, split_local
from ..local.registry import generation
from ..local.sparse import RowGradients
from ..policies import StepContext
from .extension_state import ExtensionState
from .module_buffers import BufferGroups, ModuleBuffers, named_buffers
from .noise_scale import NoiseScale, NoiseScaleEstimator
from .options import EngineBinding, ReducerOptions
from .step_guards import refuse_nonfinite


@dataclass(eq=False)
class Plan:
    """What a step works out from its tensors, for one set of them.

    Made by :meth:`Reducer.new_plan` from the tensors by shared name; the
    exchange's part is made at its first exchange. What the optimizer steps
    follows the tensors the workers agreed on (:meth:`follow`): in the steady
    state the very tuple of the last step; when they agreed on other tensors
    (one borrowed from another worker), the stepped tuple and the buffer
    groups are made again for them. Only the reducer changes a plan.
    """

    key: Hashable
    generation: int
    #: The tensors by shared name, split: those that travel, and local ones.
    replicated: dict[str, Tensor]
    local: dict[str, Tensor]
    #: The replicated tensors, in the order given: one worker steps them as they are.
    alone: tuple[Tensor, ...] = ()
    #: The exchange's part (at the first exchange; ``None`` with one worker).
    exchange: ExchangePlan | None = None
    #: The dense tensors the optimizer steps: the agreed ones, then the local ones.
    stepped: tuple[Tensor, ...] = ()
    #: The module buffers to average, and the sparse local parameters they were found with.
    buffers: BufferGroups | None = None
    buffers_with: tuple[str, ...] = ()
    #: Whether a step ran on this plan: its first averages under every step
    #: policy, so that every worker starts from worker 0's tensors.
    stepped_once: bool = False
    _agreed: tuple[Tensor, ...] | None = None

    def follow(self, agreed: tuple[Tensor, ...]) -> None:
        """Step ``agreed`` (the tensors every worker agreed on, then the local ones)."""
        if agreed is self._agreed:
            return
        self._agreed = agreed
        self.stepped = (*agreed, *self.local.values()) if self.local else agreed
        self.buffers = None


@dataclass(eq=False)
class Epoch:
    """What the steady state learned since the engine was bound or the last
    :meth:`Reducer.forget` (module docstring); with one worker, the plan alone."""

    sync: GradientSync | None
    buffers: ModuleBuffers | None
    plan: Plan | None = None

    def close(self) -> None:
        """Take the overlap's hooks off the tensors: this epoch sends no more."""
        if self.sync is not None:
            self.sync.close()


def _nothing() -> None:
    """The buffers' finish of a step on one worker."""


@dataclass(eq=False)
class Reduced:
    """One step's reduction: what the front end's optimizer steps, and whether it may."""

    plan: Plan
    #: The row gradients of sparse local parameters (``local_updates="sparse"``).
    sparse: list[RowGradients]
    #: The steps taken before this one.
    step: int
    #: Whether the gradients were averaged (else each worker steps on its own:
    #: the step policy's choice).
    averaged: bool = True
    #: The exchange's outcome; ``None`` with one worker, or on a step alone.
    exchanged: Exchanged | None = None
    #: On a step alone: whether this worker's gradients are finite.
    finite_here: bool = True
    _finish_buffers: Callable[[], None] = _nothing

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The dense tensors to step: the exchanged ones, then the local ones
        (the same tuple step after step in the steady state)."""
        return self.plan.stepped

    @property
    def finite(self) -> bool:
        """Whether every gradient, on every worker, is finite (the same everywhere);
        on a step alone, whether this worker's are."""
        return self.finite_here if self.exchanged is None else self.exchanged.finite

    def named(self) -> dict[str, Tensor]:
        """Every stepped parameter by name: exchanged, local, sparse local."""
        exchanged = self.exchanged
        agreed = (
            self.plan.replicated
            if exchanged is None
            else dict(zip(exchanged.names, exchanged.tensors, strict=True))
        )
        return {**agreed, **self.plan.local, **{rows.name: rows.tensor for rows in self.sparse}}


class Reducer:
    """The step around the exchange, shared by every front end (module docstring).

    :param engine: an engine or its name, bound at the first step.
    :param options: the checked options (:meth:`ReducerOptions.of`).
    :param catalog: every tensor this worker could step, by shared name (local
        ones left out), read live: the exchange reads it in the rare step in
        which workers proposed different tensors.
    :param catalog_name: what the catalog is called in errors ("param store").
    """

    def __init__(
        self,
        engine: str | Engine,
        options: ReducerOptions,
        catalog: Mapping[str, Tensor],
        catalog_name: str,
    ) -> None:
        self.options = options
        self._catalog = catalog
        self._catalog_name = catalog_name
        self._num_steps = 0
        self._noise: NoiseScaleEstimator | None = None
        self._local: LocalGradients | None = None
        self._channel: Channel | None = None
        self._epoch: Epoch | None = None
        #: The modules whose buffers the last epoch averaged (read after a forget).
        self._last_roots: list[Any] = []
        #: Whether the last step ended with every worker's parameters identical,
        #: and whether a drift check is owed until the next such step.
        self._in_sync = True
        self._check_owed = False
        #: Whether the step policy continues from a checkpoint's state: then the
        #: next plan's first step is the policy's to decide, as in the saved run.
        self._continuing = False
        #: This worker's own shared parameters a load handed over, until the
        #: next step (a save before it holds them again).
        self._own_loaded: dict[str, Tensor] = {}
        #: The buffers' agreed values a load handed over, for the next epoch.
        self._agreed_loaded: dict[torch.dtype, Tensor] = {}
        self._extensions = ExtensionState(options, catalog, catalog_name, self)
        self._binding = EngineBinding(engine)
        if self._binding.bound:
            self._bind()

    @property
    def num_steps(self) -> int:
        """How many steps were taken (saved in checkpoints; hooks see it as
        :attr:`~pyro_distributed.exchange.GradBucket.step`)."""
        return self._num_steps

    @num_steps.setter
    def num_steps(self, count: int) -> None:
        self._num_steps = count

    @property
    def bound(self) -> bool:
        """Whether the engine was chosen already."""
        return self._local is not None

    def describe_engine(self) -> str:
        """The engine for a ``repr``, without binding one."""
        return self._binding.describe()

    @property
    def engine(self) -> Engine:
        """The engine, bound now if it was not yet (then only re-checked)."""
        engine = self._binding.engine()
        if self._local is None:
            self._bind()
        return engine

    @property
    def sync(self) -> GradientSync | None:
        """The gradient exchange of the current epoch; ``None`` with one worker."""
        return self._epoch_now().sync

    def _bind(self) -> None:
        engine, options = self._binding.engine(), self.options
        self._noise = NoiseScaleEstimator.create(options.noise_scale, engine.world_size)
        if engine.world_size > 1:  # one worker has nothing to exchange
            self._channel = Channel(engine)  # kept across epochs: opening one is a collective
        self._local = LocalGradients(engine)

    def _epoch_now(self) -> Epoch:
        engine = self.engine  # binds the engine
        epoch = self._epoch
        if epoch is None:
            if self._channel is None:
                epoch = Epoch(None, None)
            else:
                options = self.options
                sync = GradientSync(
                    engine,
                    max(1, int(options.bucket_cap_mb * 2**20)),
                    options.reduction,
                    # Under a policy that lets workers step alone, no bucket
                    # may leave during a backward whose step is alone.
                    overlap=options.overlap and not self.steps_alone,
                    measure_norms=self._noise is not None,
                    catalog_name=self._catalog_name,
                    channel=self._channel,
                )
                agreed, self._agreed_loaded = self._agreed_loaded, {}
                epoch = Epoch(sync, ModuleBuffers(engine, agreed))
            self._epoch = epoch
        return epoch

    def plan_for(self, key: Hashable) -> Plan | None:
        """The current plan, if it was made for ``key`` (equal keys promise the
        same tensors under the same names) and no local parameter was
        registered or dropped since; ``None`` otherwise (:meth:`new_plan`)."""
        epoch = self._epoch
        plan = None if epoch is None else epoch.plan
        if plan is None or plan.key != key or plan.generation != generation():
            return None
        return plan

    def new_plan(self, key: Hashable, named: Mapping[str, Tensor]) -> Plan:
        """A plan for the tensors ``named`` (by the names every worker shares),
        known by ``key`` from now on: the current one, in place of the last."""
        replicated, local = split_local(dict(named))
        plan = Plan(key, generation(), replicated, local, tuple(replicated.values()))
        self._epoch_now().plan = plan
        return plan

    def reduce(self, plan: Plan, sparse: list[RowGradients] | None = None) -> Reduced:
        """Count a step and exchange: every ``.grad`` of :attr:`Reduced.tensors`
        is then the average over workers (a collective with more than one).

        :param plan: :meth:`plan_for` or :meth:`new_plan` of the step's tensors.
        :param sparse: the sparse local rows taken for this step.
        """
        sparse = [] if sparse is None else sparse
        epoch = self._epoch_now()
        assert plan is epoch.plan, "a plan of this epoch (plan_for or new_plan)"
        step = self._num_steps
        self._num_steps += 1
        averaged = self._averages(step, plan)
        plan.stepped_once, self._continuing, self._own_loaded = True, False, {}
        sync, buffers = epoch.sync, epoch.buffers
        if sync is None or buffers is None:
            plan.follow(plan.alone)
            return Reduced(plan, sparse, step, averaged)
        local_gradients = self._local
        assert local_gradients is not None  # bound with the exchange
        if not averaged:
            return self._alone(plan, sparse, step, sync, local_gradients)
        if plan.exchange is None:  # the plan's first exchange
            plan.exchange = sync.plan(plan.replicated)
        local = plan.local
        local_finite = True
        if local or sparse:
            # Local gradients never travel: scaled as the exchange scales an
            # average, and checked here; the check rides in the exchange's header.
            scale = sync.average_alone_
            local_finite = local_gradients.prepare(local, scale, scale_row_grads(sparse, scale))
        exchanged = sync.exchange(
            plan.exchange, self._catalog_now, nonfinite_here=not local_finite, step=step
        )
        plan.follow(exchanged.tensors)
        reduced = Reduced(plan, sparse, step, True, exchanged)
        if reduced.finite and self._noise is not None and exchanged.tensors:
            self._noise.observe(*sync.squared_norms())  # before the optimizer clips
        # The modules are those of the plan's tensors, and of the sparse local
        # parameters that stepped with them (which may differ from step to step).
        sparse_names = tuple(rows.name for rows in sparse)
        if plan.buffers is None or plan.buffers_with != sparse_names:
            plan.buffers, plan.buffers_with = buffers.groups(reduced.named()), sparse_names
        reduced._finish_buffers = buffers.start(plan.buffers)  # travels while the optimizer steps
        return reduced

    def _alone(
        self,
        plan: Plan,
        sparse: list[RowGradients],
        step: int,
        sync: GradientSync,
        local_gradients: LocalGradients,
    ) -> Reduced:
        """A step whose gradients stay this worker's (the step policy's choice).
        Local gradients are scaled as on an averaged step, so that an owned
        parameter steps alike under every policy."""
        plan.follow(plan.alone)
        finite = True
        if plan.local or sparse:
            scale = sync.average_alone_
            finite = local_gradients.prepare(plan.local, scale, scale_row_grads(sparse, scale))
        grads = [t.grad for t in plan.alone if t.grad is not None]
        if grads:
            # The largest magnitude: finite for any finite gradient (a 2-norm
            # can overflow), NaN or Inf for any other.
            largest = torch._foreach_norm(grads, float("inf"))
            finite = finite and bool(torch.isfinite(torch.stack(largest)).all())
        return Reduced(plan, sparse, step, False, finite_here=finite)

    def _catalog_now(self) -> Mapping[str, Tensor]:
        """The catalog, as the exchange asks for it (only when workers disagree)."""
        return self._catalog

    def done(self, reduced: Reduced) -> None:
        """Finish the step :meth:`reduce` began, after the optimizer stepped (or
        not): the buffers' average, the refusal (or skip warning) of a
        non-finite step, release of borrowed gradients."""
        exchanged = reduced.exchanged
        if exchanged is not None:
            reduced._finish_buffers()
            if not exchanged.finite:
                names = (*exchanged.names, *reduced.plan.local)
                named = zip(names, reduced.tensors, strict=True)
                extra = nonfinite_rows(reduced.sparse)
                refuse_nonfinite(named, self._num_steps, self.options.nonfinite, 5, extra)
            exchanged.release_borrowed()
        elif not reduced.finite_here:
            own = reduced.named().items()
            extra = nonfinite_rows(reduced.sparse)
            refuse_nonfinite(own, self._num_steps, self.options.nonfinite, 5, extra, alone=True)
        self._after_step(reduced)

    def _after_step(self, reduced: Reduced) -> None:
        """The step policy's part after the optimizer stepped; at a sync point
        reached by averaging parameters, the modules' buffers are averaged too."""
        policy = self.options.step_policy
        if policy is None:
            return
        # Averaged gradients make identical parameters only from identical ones:
        # the first step with new parameters averages even between two sync
        # points, and there it counts as a step alone (the new parameters took
        # worker 0's values; the others still differ).
        identical = reduced.averaged and self._in_sync
        context = StepContext(self.engine, reduced.step, identical, reduced.plan.replicated)
        self._in_sync = policy.after_step(context)
        epoch = self._epoch
        buffers = None if epoch is None else epoch.buffers
        if self._in_sync and not identical and buffers is not None:
            buffers.start(buffers.groups(reduced.named()))()

    def averages_next_step(self) -> bool:
        """Whether the next step will average gradients, as far as the step
        policy says (a step with new tensors averages whatever it says)."""
        return self._averages(self._num_steps, None if self._epoch is None else self._epoch.plan)

    def _averages(self, step: int, plan: Plan | None) -> bool:
        """Whether step ``step`` on ``plan`` averages gradients: the policy's
        answer, but a plan's first step (not one that continues a checkpoint's
        run) averages whatever it says, so that new tensors take worker 0's values."""
        policy = self.options.step_policy
        if policy is None or policy.averages_gradients(step):
            return True
        return plan is None or not (plan.stepped_once or self._continuing)

    @property
    def in_sync(self) -> bool:
        """Whether the last step ended at a sync point: every worker's shared
        parameters identical (always, under the default step policy)."""
        return self._in_sync

    @property
    def steps_alone(self) -> bool:
        """Whether the step policy lets workers step alone between sync points."""
        policy = self.options.step_policy
        return policy is not None and policy.steps_alone

    def check_due(self) -> bool:
        """Whether the step just done is a ``check_every``-th one, with more
        than one worker: the front end then runs the drift check."""
        every = self.options.check_every
        if every is None or self._channel is None:
            return False
        # Under a policy that lets workers step alone, at the first sync point on.
        self._check_owed = self._check_owed or self._num_steps % every == 0
        due = self._check_owed and self._in_sync
        self._check_owed = self._check_owed and not due
        return due

    def noise_scale(self, batch_size: int | None) -> NoiseScale:
        """The gradient noise scale so far; ``ValueError`` without ``noise_scale=True``."""
        self.engine  # noqa: B018 (binds the engine)
        if self._noise is None:
            raise ValueError("noise_scale() needs DistributedOptimizer(..., noise_scale=True)")
        return self._noise.estimate(batch_size)

    def buffers(self) -> dict[str, Tensor]:
        """The buffers of the modules trained so far, all dtypes (none before
        the first step; after a forget, the last epoch's until the next step)."""
        epoch = self._epoch
        found = epoch.buffers if epoch is not None else None
        roots = found.roots if found is not None and found.roots else self._last_roots
        return dict(named_buffers(roots))

    def extension_state(self) -> dict[str, Any]:
        """What this worker's extensions of the step keep across steps, as plain
        data (:meth:`.extension_state.ExtensionState.saved`); between two sync
        points, also its own shared parameters and buffers. Checkpoints save it
        for every worker."""
        plan = None if self._epoch is None else self._epoch.plan
        own = None if self._in_sync else self._own_loaded if plan is None else plan.replicated
        state = self._extensions.saved(own)
        # What the buffers' average starts from (the same on every worker).
        buffers = None if self._epoch is None else self._epoch.buffers
        agreed = self._agreed_loaded if buffers is None else buffers.agreed
        state["agreed_buffers"] = {str(dtype): value.clone() for dtype, value in agreed.items()}
        return state

    def load_extension_state(self, state: Mapping[str, Any]) -> None:
        """Continue the extensions from ``state`` (an :meth:`extension_state`;
        ``{}``: afresh). ``ValueError`` for state they do not keep."""
        own = self._extensions.load(state)
        self._in_sync, self._own_loaded = not own, own
        self._agreed_loaded = {
            _dtype(name): value for name, value in (state.get("agreed_buffers") or {}).items()
        }
        # A checkpoint's state (not a fresh start): the next plan's first step
        # is the policy's to decide, as in the saved run.
        self._continuing = bool(state)

    def try_extension_state(self, state: Mapping[str, Any]) -> None:
        """:meth:`load_extension_state` on copies of the extensions (changing nothing)."""
        self._extensions.try_load(state)

    def keeps_extension_state(self) -> bool:
        """Whether an extension may keep state across steps."""
        return self._extensions.keeps_state()

    def forget(self) -> None:
        """End the epoch: treat every tensor as new (after a checkpoint replaced
        them, or a rollback), drop every plan, take the overlap's hooks off,
        and start the extensions afresh (:meth:`load_extension_state` then
        hands them a checkpoint's state). The next step starts a new epoch,
        in which every tensor takes worker 0's value."""
        if self._epoch is not None:
            if self._epoch.buffers is not None:
                self._last_roots = self._epoch.buffers.roots
            self._epoch.close()
            self._epoch = None
        self.load_extension_state({})


def _dtype(name: str) -> torch.dtype:
    """The dtype ``str(dtype)`` wrote (``"torch.float32"``)."""
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"the checkpoint's buffer state names no dtype: {name!r}")
    return found
