"""DataParallelStep: what one optimizer step does around the gradient exchange.

Every front end (a Pyro optimizer for SVI, a torch optimizer for the
torch-native loop, the next one) names its parameters and steps its wrapped
optimizer; everything between is here, once, in the same order on every
worker:

1. bind the engine, at the first step (:class:`~.options.EngineBinding`);
2. split off local parameters, whose gradients never travel, and scale
   them, and the rows of sparse local parameters, as the exchange scales an
   average (``GradientSync.average_alone_``: the same operations, so a
   local row is bitwise what the replicated run would hold, at any W, given
   the same global parameters; from W=3 those depend on where each element
   sits in the exchanged buffer, whose sum order is the ring's);
3. exchange the rest (:class:`~pyro_distributed.exchange.sync.GradientSync`),
   with the flag "some local gradient is not finite" in its header;
4. observe the gradient noise scale; let the front end step its optimizer,
   or skip (or refuse) the step on every worker if a gradient is not finite;
5. drop gradients borrowed from other workers; average the modules'
   buffers (:mod:`.module_buffers`); run the drift check every
   ``check_every`` steps.

Steps 2-3 (:meth:`DataParallelStep.exchange`) and 4-5
(:meth:`DataParallelStep.finish`) are two calls, because the torch front
end's ``synchronize()`` exchanges before the user clips. Both work from the
step's plan (:class:`~.plan.StepPlan`, from :meth:`DataParallelStep.plan`):
what follows from the tensors is worked out once per set of tensors, and
the steady state only checks that the set is the same. The step asks its
front end for what only the front end knows through one typed protocol,
:class:`StepOwner`; :class:`FrontEnd` gives a front end what it reads from its
step: ``engine``, ``sync``, ``num_steps``, ``noise_scale()``. Neither calls
back into the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from torch import Tensor

from ..engines import Engine
from ..exchange import (
    CommHook,
    Compression,
    Exchanged,
    GradBucket,
    GradientSync,
    Reducing,
    Reduction,
    as_hook,
    compressor,
)
from ..local.gradients import LocalGradients, nonfinite_rows, scale_row_grads, split_local
from ..local.registry import generation
from ..local.sparse import RowGradients
from .consistency import compare_across_workers
from .module_buffers import ModuleBuffers, named_buffers
from .noise_scale import NoiseScale, NoiseScaleEstimator
from .options import EngineBinding, check_options, make_sync
from .plan import StepPlan
from .step_guards import refuse_nonfinite


@dataclass(frozen=True)
class StepOptions:
    """The options every front end takes, with the meaning
    :class:`~pyro_distributed.DistributedOptimizer` documents."""

    bucket_cap_mb: float = 25.0
    reduction: Reduction = field(default_factory=Reduction)
    nonfinite: Literal["skip", "raise"] = "skip"
    check_every: int | None = None
    overlap: bool = True
    noise_scale: bool | float = False

    @classmethod
    def of(
        cls,
        bucket_cap_mb: float,
        nonfinite: Literal["skip", "raise"],
        check_every: int | None,
        compression: Compression,
        overlap: bool,
        noise_scale: bool | float,
        comm_hook: CommHook | Callable[[GradBucket, Engine], Reducing] | None = None,
    ) -> StepOptions:
        """The options, or ``TypeError``/``ValueError`` naming a wrong one."""
        check_options(bucket_cap_mb, nonfinite, check_every, overlap)
        NoiseScaleEstimator.smoothing_of(noise_scale)  # a wrong value fails here, not at step 1
        hook = None if comm_hook is None else as_hook(comm_hook)
        if hook is not None and compression != "none":
            raise ValueError(
                f"pass compression={compression!r} or comm_hook, not both: "
                f"a hook decides how gradients travel"
            )
        reduction = Reduction(compression=compressor(compression), hook=hook)
        return cls(bucket_cap_mb, reduction, nonfinite, check_every, overlap, noise_scale)


@dataclass(frozen=True)
class Stepped:
    """One step's exchange: what the front end's optimizer steps, and whether it may."""

    exchanged: Exchanged
    #: The step's plan, following the exchanged tensors (:meth:`~.plan.StepPlan.follow`).
    plan: StepPlan
    #: The row gradients of sparse local parameters (``local_updates="sparse"``).
    sparse: list[RowGradients]

    @property
    def local(self) -> dict[str, Tensor]:
        """Local parameters (their gradients scaled, never sent), by their own names."""
        return self.plan.local

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The dense tensors to step: the exchanged ones, then the local ones
        (the same tuple step after step in the steady state)."""
        return self.plan.stepped

    @property
    def finite(self) -> bool:
        """Whether every gradient, on every worker, is finite (the same everywhere)."""
        return self.exchanged.finite

    def named(self) -> dict[str, Tensor]:
        """Every stepped parameter by name: exchanged, local, sparse local."""
        exchanged = self.exchanged
        return {
            **dict(zip(exchanged.names, exchanged.tensors, strict=True)),
            **self.local,
            **{rows.name: rows.tensor for rows in self.sparse},
        }


class StepOwner(Protocol):
    """What a :class:`DataParallelStep` asks of the front end that owns it.

    None of these calls the step back. The two underscored calls are the
    step's alone: a front end's users have no reason to make them.
    """

    #: What the exchange calls a worker's parameters in its errors.
    catalog_name: ClassVar[str]

    def checked_tensors(self) -> dict[str, Tensor]:
        """Every parameter this worker could step, by shared name: the exchange's
        catalog, and what the drift check compares (local parameters left out)."""
        ...

    def get_state(self) -> dict[str, Any]:
        """Per-parameter optimizer state, by the names of :meth:`checked_tensors`."""
        ...

    def _named(self, tensors: tuple[Tensor, ...]) -> dict[str, Tensor]:
        """``tensors`` (what the front end gave :meth:`DataParallelStep.plan`) by
        names every worker shares; called once per plan."""
        ...

    def _on_bind(self, exchanges: bool) -> None:
        """Called once the engine is bound, with whether there is an exchange."""
        ...

    def _check_local(self, local: dict[str, Tensor]) -> None:
        """Refuse local parameters the wrapped optimizer cannot step, before anything moves."""
        ...


class DataParallelStep:
    """The step around the exchange, shared by every front end (module docstring).

    :param engine: an engine or its name, bound at the first step.
    :param options: the front end's checked options.
    :param owner: the front end, asked only what :class:`StepOwner` names.
    """

    def __init__(self, engine: str | Engine, options: StepOptions, owner: StepOwner) -> None:
        self.options = options
        #: How many steps were taken (saved in checkpoints).
        self.num_steps = 0
        self._owner = owner
        self._noise: NoiseScaleEstimator | None = None
        self._sync: GradientSync | None = None
        self._local: LocalGradients | None = None
        self._buffers: ModuleBuffers | None = None
        self._plan: StepPlan | None = None
        self._binding = EngineBinding(engine)
        if self._binding.bound:
            self._bind()

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
        self._sync = make_sync(
            engine,
            options.bucket_cap_mb,
            options.reduction,
            options.overlap,
            self._noise,
            self._owner.catalog_name,
        )
        self._local = LocalGradients(engine)
        self._buffers = ModuleBuffers(engine) if self._sync is not None else None
        self._owner._on_bind(self._sync is not None)

    def start(self) -> bool:
        """Count a step; return whether it exchanges (more than one worker)."""
        self.num_steps += 1
        return self.sync is not None

    def plan(self, key: Hashable, tensors: Iterable[Tensor]) -> StepPlan:
        """The plan for stepping ``tensors``: the last one while ``key`` and the
        local registry's generation are the same (:mod:`.plan`).

        :param key: what identifies the tensors, by identity (their ids, in a
            frozenset or a tuple: one pass in C); equal keys promise the same
            tensors under the same names.
        :param tensors: the tensors, read only when a new plan is made.
        """
        plan, now = self._plan, generation()
        if plan is None or plan.generation != now or plan.key != key:
            plan = self._plan = StepPlan(key, tuple(tensors), now)
        return plan

    def exchange(self, plan: StepPlan, sparse: list[RowGradients]) -> Stepped:
        """Scale the local gradients and rows, exchange the rest (a collective).

        :param plan: :meth:`plan` of the tensors to step.
        :param sparse: the sparse local rows taken for this step.
        """
        sync, local_gradients = self._sync, self._local
        assert sync is not None and local_gradients is not None  # start() said so
        if plan.exchange is None:  # the plan's first exchange
            plan.replicated, plan.local = split_local(self._owner._named(plan.tensors))
            plan.exchange = sync.plan(plan.replicated)
        local = plan.local
        local_finite = True
        if local or sparse:
            self._owner._check_local(local)
            # Local gradients never travel: scaled as the exchange scales an
            # average, and checked here; the check rides in the exchange's header.
            scale = sync.average_alone_
            local_finite = local_gradients.prepare(local, scale, scale_row_grads(sparse, scale))
        catalog = self._owner.checked_tensors
        exchanged = sync.exchange(plan.exchange, catalog, nonfinite_here=not local_finite)
        plan.follow(exchanged.tensors)
        return Stepped(exchanged, plan, sparse)

    def finish(self, stepped: Stepped, step_optimizer: Callable[[StepPlan], None]) -> None:
        """Step (``step_optimizer(plan)``, which steps ``plan.stepped``) or skip;
        then release, buffers, drift check."""
        sync, options, buffers = self._sync, self.options, self._buffers
        assert sync is not None and buffers is not None  # start() said so
        if stepped.finite and self._noise is not None and stepped.exchanged.tensors:
            self._noise.observe(*sync.squared_norms())  # before the optimizer clips
        exchanged, plan = stepped.exchanged, stepped.plan
        # The modules are those of the plan's tensors, and of the sparse local
        # parameters that stepped with them (which may differ from step to step).
        sparse_names = tuple(rows.name for rows in stepped.sparse)
        if plan.buffers is None or plan.buffers_with != sparse_names:
            plan.buffers, plan.buffers_with = buffers.groups(stepped.named()), sparse_names
        finish_buffers = buffers.start(plan.buffers)  # travels while the optimizer steps
        try:
            if stepped.finite:
                step_optimizer(plan)
            else:
                names = (*exchanged.names, *stepped.local)
                named = zip(names, stepped.tensors, strict=True)
                extra = nonfinite_rows(stepped.sparse)
                refuse_nonfinite(named, self.num_steps, options.nonfinite, 5, extra)
        finally:
            finish_buffers()
        exchanged.release_borrowed()
        if options.check_every and self.num_steps % options.check_every == 0:
            self._check_in_sync()

    def _check_in_sync(self) -> None:
        """:func:`~pyro_distributed.assert_in_sync` on the owner's parameters and
        state and this step's buffers (a collective)."""
        owner = self._owner
        compare_across_workers(
            self.engine, owner.checked_tensors(), self.buffers(), owner.get_state()
        )

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
        """Treat every tensor as new (after a checkpoint replaced them): drop the plan."""
        self._plan = None
        if self._sync is not None:
            self._sync.forget()
        if self._buffers is not None:
            self._buffers.forget()


class FrontEnd(ABC):
    """What a front end reads from its :class:`DataParallelStep` (``_step``).

    It holds no state and defines no ``__init__``, so a front end that is a
    ``torch.optim.Optimizer`` still never runs ``Optimizer.__init__``.
    """

    _step: DataParallelStep

    @property
    def engine(self) -> Engine:
        """The engine this optimizer averages on, chosen at its first step
        (:class:`~pyro_distributed.optim.options.EngineBinding`)."""
        return self._step.engine

    @property
    def sync(self) -> GradientSync | None:
        """The gradient exchange; ``None`` with one worker, which has nothing to
        exchange. Its read-only properties (``overlaps``, ``overlap_armed``,
        ``bucket_count``) show how gradients travel."""
        return self._step.sync

    @property
    def num_steps(self) -> int:
        """How many times the optimizer stepped (saved in checkpoints)."""
        return self._step.num_steps

    @num_steps.setter
    def num_steps(self, count: int) -> None:
        self._step.num_steps = count

    @property
    def nonfinite(self) -> str:
        """What every worker does when a gradient is not finite: ``"skip"`` or ``"raise"``."""
        return self._step.options.nonfinite

    @property
    def check_every(self) -> int | None:
        """Run :func:`~pyro_distributed.assert_in_sync` after every ``check_every``-th step."""
        return self._step.options.check_every

    def noise_scale(self, batch_size: int | None = None) -> NoiseScale:
        """The gradient noise scale so far (needs ``noise_scale=True``); no communication.

        ``batch_size`` (data points per worker per step) adds B_simple in data
        points. ``print(optim.noise_scale(32))`` shows the figures and a reading.
        """
        return self._step.noise_scale(batch_size)

    def checked_buffers(self) -> dict[str, Tensor]:
        """The buffers of the modules this optimizer trains, by names shared by
        every worker (:mod:`.module_buffers`), all dtypes."""
        return self._step.buffers()

    @abstractmethod
    def checked_tensors(self) -> dict[str, Tensor]:
        """The parameters that must be identical on every worker, by shared name."""

    @abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Per-parameter optimizer state, by the names of :meth:`checked_tensors`."""
