"""Reducer: everything one optimizer step does around the gradient exchange.

A front end (a Pyro optimizer for SVI, a torch optimizer for the
torch-native loop, the next one) steps its wrapped optimizer; the
:class:`Reducer` it holds does the rest, in the same order on every worker,
in three calls and no callbacks::

    reduced = reducer.reduce(key, tensors, sparse)  # exchange: .grad is the average
    try:
        if reduced.finite:
            wrapped.step(reduced.tensors)
    finally:
        reducer.done(reduced)  # buffers, refusal of non-finite, release, drift check

:meth:`Reducer.reduce` binds the engine at the first step
(:class:`~.options.EngineBinding`), splits off local parameters, whose
gradients never travel, and scales them, and the rows of sparse local
parameters, as the exchange scales an average (``GradientSync.average_alone_``:
the same operations, so a local row is bitwise what the replicated run would
hold), exchanges the rest with the flag "some local gradient is not finite"
in its header, observes the noise scale and starts averaging the modules'
buffers (:mod:`.module_buffers`), which travel while the optimizer steps.
:meth:`Reducer.done` finishes the buffers, skips (or refuses) a non-finite
step on every worker alike, drops gradients borrowed from other workers and
runs the drift check every ``check_every`` steps. The torch front end's
``synchronize()`` is ``reduce`` alone, before the user clips.

The steady state has one key: the front end's ``key`` for its tensors (their
ids: one pass, in C) and the local registry's generation. While both are the
last step's, every step reads one :class:`Plan` (names, split, the
exchange's plan, the stepped tuple, the front end's multi-tensor groups, the
buffer groups); when either changes, or after :meth:`Reducer.forget`, one
new plan is made. The reducer knows its tensors' names through a
:class:`Names` object given at construction, never through the front end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from ..consensus import ABSENT, require_agreement
from ..digest import digest
from ..engines import Engine
from ..exchange import Exchanged, ExchangePlan, GradientSync
from ..local.gradients import LocalGradients, nonfinite_rows, scale_row_grads, split_local
from ..local.registry import generation, local_params
from ..local.sparse import RowGradients
from .module_buffers import BufferGroups, ModuleBuffers, named_buffers
from .multi_tensor import GroupedSteps
from .noise_scale import NoiseScale, NoiseScaleEstimator
from .options import EngineBinding, ReducerOptions
from .step_guards import refuse_nonfinite


class Names(Protocol):
    """How a front end's tensors are known to every worker (given to a
    :class:`Reducer` at construction)."""

    #: What the exchange calls a worker's parameters in its errors.
    catalog_name: str

    def of(self, tensors: tuple[Tensor, ...]) -> dict[str, Tensor]:
        """``tensors`` by names every worker shares; called once per plan."""
        ...

    def catalog(self) -> dict[str, Tensor]:
        """Every parameter this worker could step, by shared name (local ones
        left out): the exchange's catalog, and what the drift check compares."""
        ...

    def check_local(self, local: dict[str, Tensor]) -> None:
        """Refuse local parameters the optimizer cannot step, before anything moves."""
        ...


@dataclass(eq=False)
class Plan:
    """What a step works out from its tensors, for one set of them.

    Each part is made the first time a step needs it. What the optimizer
    steps follows the tensors the workers agreed on (:meth:`follow`): in the
    steady state the very tuple of the last step; when they agreed on other
    tensors (one borrowed from another worker), the stepped tuple, the groups
    and the buffer groups are made again for them. A caller changes nothing
    a plan holds but :attr:`groups`.
    """

    key: Hashable
    #: The front end's tensors (held, so that their ids stay theirs).
    tensors: tuple[Tensor, ...]
    generation: int
    #: The tensors by shared name, split (at the first exchange).
    replicated: dict[str, Tensor] = field(default_factory=dict)
    local: dict[str, Tensor] = field(default_factory=dict)
    #: The exchange's part (at the first exchange; ``None`` with one worker).
    exchange: ExchangePlan | None = None
    #: The dense tensors the optimizer steps: the agreed ones, then the local ones.
    stepped: tuple[Tensor, ...] = ()
    #: The front end's multi-tensor groups for :attr:`stepped` (the front end's to fill).
    groups: GroupedSteps | None = None
    #: The module buffers to average, and the sparse local parameters they were found with.
    buffers: BufferGroups | None = None
    buffers_with: tuple[str, ...] = ()
    _agreed: tuple[Tensor, ...] | None = None

    def follow(self, agreed: tuple[Tensor, ...]) -> None:
        """Step ``agreed`` (the tensors every worker agreed on, then the local ones)."""
        if agreed is self._agreed:
            return
        self._agreed = agreed
        self.stepped = (*agreed, *self.local.values()) if self.local else agreed
        self.groups, self.buffers = None, None


def _nothing() -> None:
    """The buffers' finish of a step on one worker."""


@dataclass(eq=False)
class Reduced:
    """One step's reduction: what the front end's optimizer steps, and whether it may."""

    plan: Plan
    #: The row gradients of sparse local parameters (``local_updates="sparse"``).
    sparse: list[RowGradients]
    #: The exchange's outcome; ``None`` with one worker.
    exchanged: Exchanged | None = None
    _finish_buffers: Callable[[], None] = _nothing

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The dense tensors to step: the exchanged ones, then the local ones
        (the same tuple step after step in the steady state)."""
        return self.plan.stepped

    @property
    def finite(self) -> bool:
        """Whether every gradient, on every worker, is finite (the same everywhere)."""
        return self.exchanged is None or self.exchanged.finite

    def named(self) -> dict[str, Tensor]:
        """Every stepped parameter by name: exchanged, local, sparse local."""
        exchanged = self.exchanged
        agreed = (
            {} if exchanged is None else dict(zip(exchanged.names, exchanged.tensors, strict=True))
        )
        return {**agreed, **self.plan.local, **{rows.name: rows.tensor for rows in self.sparse}}


class Reducer:
    """The step around the exchange, shared by every front end (module docstring).

    :param engine: an engine or its name, bound at the first step.
    :param options: the checked options (:meth:`ReducerOptions.of`).
    :param names: how the front end's tensors are named.
    :param state: the wrapped optimizer's per-parameter state by shared name,
        for the drift check.
    """

    def __init__(
        self,
        engine: str | Engine,
        options: ReducerOptions,
        names: Names,
        state: Callable[[], dict[str, Any]],
    ) -> None:
        self.options = options
        #: How many steps were taken (saved in checkpoints).
        self.num_steps = 0
        self._names = names
        self._state = state
        self._noise: NoiseScaleEstimator | None = None
        self._sync: GradientSync | None = None
        self._local: LocalGradients | None = None
        self._buffers: ModuleBuffers | None = None
        self._plan: Plan | None = None
        self._binding = EngineBinding(engine)
        if self._binding.bound:
            self._bind()

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
        """The gradient exchange; ``None`` with one worker."""
        self.engine  # noqa: B018 (binds the engine)
        return self._sync

    def _bind(self) -> None:
        engine, options = self._binding.engine(), self.options
        self._noise = NoiseScaleEstimator.create(options.noise_scale, engine.world_size)
        if engine.world_size > 1:  # one worker has nothing to exchange
            self._sync = GradientSync(
                engine,
                max(1, int(options.bucket_cap_mb * 2**20)),
                options.reduction,
                overlap=options.overlap,
                measure_norms=self._noise is not None,
                catalog_name=self._names.catalog_name,
            )
            self._buffers = ModuleBuffers(engine)
        self._local = LocalGradients(engine)

    def reduce(
        self, key: Hashable, tensors: Iterable[Tensor], sparse: list[RowGradients] | None = None
    ) -> Reduced:
        """Count a step and exchange: every ``.grad`` of :attr:`Reduced.tensors`
        is then the average over workers (a collective with more than one).

        :param key: what identifies the tensors, by identity (their ids, in a
            frozenset or a tuple: one pass in C); equal keys promise the same
            tensors under the same names.
        :param tensors: the tensors, read only when a new plan is made.
        :param sparse: the sparse local rows taken for this step.
        """
        sparse = [] if sparse is None else sparse
        plan, now = self._plan, generation()
        if plan is None or plan.generation != now or plan.key != key:
            plan = self._plan = Plan(key, tuple(tensors), now)
        self.num_steps += 1
        sync = self.sync
        if sync is None:
            plan.follow(plan.tensors)
            return Reduced(plan, sparse)
        local_gradients, buffers = self._local, self._buffers
        assert local_gradients is not None and buffers is not None  # bound with the exchange
        if plan.exchange is None:  # the plan's first exchange
            plan.replicated, plan.local = split_local(self._names.of(plan.tensors))
            plan.exchange = sync.plan(plan.replicated)
        local = plan.local
        local_finite = True
        if local or sparse:
            self._names.check_local(local)
            # Local gradients never travel: scaled as the exchange scales an
            # average, and checked here; the check rides in the exchange's header.
            scale = sync.average_alone_
            local_finite = local_gradients.prepare(local, scale, scale_row_grads(sparse, scale))
        exchanged = sync.exchange(
            plan.exchange, self._names.catalog, nonfinite_here=not local_finite
        )
        plan.follow(exchanged.tensors)
        reduced = Reduced(plan, sparse, exchanged)
        if reduced.finite and self._noise is not None and exchanged.tensors:
            self._noise.observe(*sync.squared_norms())  # before the optimizer clips
        # The modules are those of the plan's tensors, and of the sparse local
        # parameters that stepped with them (which may differ from step to step).
        sparse_names = tuple(rows.name for rows in sparse)
        if plan.buffers is None or plan.buffers_with != sparse_names:
            plan.buffers, plan.buffers_with = buffers.groups(reduced.named()), sparse_names
        reduced._finish_buffers = buffers.start(plan.buffers)  # travels while the optimizer steps
        return reduced

    def done(self, reduced: Reduced) -> None:
        """Finish the step :meth:`reduce` began, after the optimizer stepped (or
        not): the buffers' average, the refusal (or skip warning) of a
        non-finite step, release of borrowed gradients, the drift check."""
        exchanged = reduced.exchanged
        if exchanged is None:
            return
        reduced._finish_buffers()
        options = self.options
        if not exchanged.finite:
            names = (*exchanged.names, *reduced.plan.local)
            named = zip(names, reduced.tensors, strict=True)
            extra = nonfinite_rows(reduced.sparse)
            refuse_nonfinite(named, self.num_steps, options.nonfinite, 5, extra)
        exchanged.release_borrowed()
        if options.check_every and self.num_steps % options.check_every == 0:
            self.check_in_sync()

    def check_in_sync(self) -> None:
        """:func:`~pyro_distributed.assert_in_sync` on the named parameters, the
        optimizer's state and the trained modules' buffers (a collective)."""
        compare_across_workers(self.engine, self._names.catalog(), self.buffers(), self._state())

    def noise_scale(self, batch_size: int | None) -> NoiseScale:
        """The gradient noise scale so far; ``ValueError`` without ``noise_scale=True``."""
        self.engine  # noqa: B018 (binds the engine)
        if self._noise is None:
            raise ValueError("noise_scale() needs DistributedOptimizer(..., noise_scale=True)")
        return self._noise.estimate(batch_size)

    def buffers(self) -> dict[str, Tensor]:
        """The buffers of the modules trained so far, all dtypes (none before the first step)."""
        roots = self._buffers.roots if self._buffers is not None else []
        return dict(named_buffers(roots))

    def forget(self) -> None:
        """Treat every tensor as new (after a checkpoint replaced them): drop the
        plan; the exchange and the buffers start again from them."""
        self._plan = None
        if self._sync is not None:
            self._sync.forget()
        if self._buffers is not None:
            self._buffers.forget()


def compare_across_workers(
    engine: Engine,
    tensors: dict[str, Tensor],
    buffers: dict[str, Tensor],
    state: dict[str, Any] | None,
) -> None:
    """:func:`~pyro_distributed.assert_in_sync` on what it reads: parameters
    (local ones left out: each worker holds its own rows), module buffers and,
    where given, optimizer state by parameter name."""
    local = local_params()
    values: dict[str, Any] = {
        f"parameter {name!r}": value for name, value in sorted(tensors.items()) if name not in local
    }
    values.update((f"buffer {name!r}", value) for name, value in buffers.items())
    if state is not None:
        values.update(
            (f"optimizer state of {name!r}", state[name])
            for name in sorted(state, key=str)
            if name not in local
        )
    require_identical(engine, values)


def _drifted(name: str, split: str) -> str:
    return f"workers have drifted apart: {name} differs ({split})"


def require_identical(
    engine: Engine,
    values: dict[str, Any],
    message: Callable[[str, str], str] = _drifted,
    absent: str = "none",
) -> None:
    """The drift check, the one every caller makes: a digest of each of
    ``values`` (by the label a message names it with), compared in one
    collective; every worker raises
    :class:`~pyro_distributed.PyroDistributedError` with ``message(label,
    split)`` for the first that differs (``absent`` where a worker lacks it).
    """
    require_agreement(
        engine,
        {label: digest(value) for label, value in values.items()},
        message=message,
        describe=lambda value: absent if value is ABSENT else f"version {value}",
    )


class FrontEnd(ABC):
    """What every front end reads from its :class:`Reducer` (``_reducer``): the
    face :func:`~pyro_distributed.assert_in_sync` and users read.

    It holds no state and defines no ``__init__``, so a front end that is a
    ``torch.optim.Optimizer`` still never runs ``Optimizer.__init__``.
    """

    _reducer: Reducer

    @property
    def engine(self) -> Engine:
        """The engine this optimizer averages on, chosen at its first step
        (:class:`~pyro_distributed.optim.options.EngineBinding`)."""
        return self._reducer.engine

    @property
    def sync(self) -> GradientSync | None:
        """The gradient exchange; ``None`` with one worker, which has nothing to
        exchange. Its read-only properties (``overlaps``, ``overlap_armed``,
        ``bucket_count``) show how gradients travel."""
        return self._reducer.sync

    @property
    def num_steps(self) -> int:
        """How many times the optimizer stepped (saved in checkpoints)."""
        return self._reducer.num_steps

    @num_steps.setter
    def num_steps(self, count: int) -> None:
        self._reducer.num_steps = count

    @property
    def nonfinite(self) -> str:
        """What every worker does when a gradient is not finite: ``"skip"`` or ``"raise"``."""
        return self._reducer.options.nonfinite

    @property
    def check_every(self) -> int | None:
        """Run :func:`~pyro_distributed.assert_in_sync` after every ``check_every``-th step."""
        return self._reducer.options.check_every

    def noise_scale(self, batch_size: int | None = None) -> NoiseScale:
        """The gradient noise scale so far (needs ``noise_scale=True``); no communication.

        ``batch_size`` (data points per worker per step) adds B_simple in data
        points. ``print(optim.noise_scale(32))`` shows the figures and a reading.
        """
        return self._reducer.noise_scale(batch_size)

    def checked_buffers(self) -> dict[str, Tensor]:
        """The buffers of the modules this optimizer trains, by names shared by
        every worker (:mod:`.module_buffers`), all dtypes."""
        return self._reducer.buffers()

    @abstractmethod
    def checked_tensors(self) -> dict[str, Tensor]:
        """The parameters that must be identical on every worker, by shared name."""

    @abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Per-parameter optimizer state, by the names of :meth:`checked_tensors`."""
