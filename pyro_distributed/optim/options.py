"""The options every front end takes, their defaults written once, and the engine binding.

:class:`ReducerOptions` is the one frozen dataclass of the options a
:class:`~.reducer.Reducer` runs with: each front end's signature takes its
defaults from :data:`DEFAULTS`, and :meth:`ReducerOptions.of` checks them,
for the front ends, Horovod's contract and the Lightning strategy's
``optimizer_options`` (:class:`OptimizerOptions`, the typed spelling of the
same keyword arguments) alike.

Binding: an optimizer is often built before the processes that will train it
have met (scvi-tools builds its Pyro optimizer before Lightning creates the
process group). So an optimizer does not choose its engine when it is built
but at its first step (:class:`EngineBinding`, held by the reducer, which
binds when a front end's ``engine`` is first read): by then the launcher's or
the host framework's process group exists and ``engine="auto"`` adopts it. An
optimizer already bound to one worker re-checks at every step that no larger
group has appeared since, and refuses to go on if one has: averaging over one
worker while others exist would train W independent replicas, silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from .. import runtime
from ..checks import check_bool, check_choice, check_int, check_number
from ..engines import Engine, check_engine_name
from ..errors import PyroDistributedError
from ..exchange import (
    CommHook,
    Compression,
    GradBucket,
    NarrowedHook,
    Reducing,
    Reduction,
    as_hook,
    compressor,
)
from ..policies import StepPolicy
from .noise_scale import NoiseScaleEstimator


@dataclass(frozen=True)
class ReducerOptions:
    """The options of every front end, with the meaning
    :class:`~pyro_distributed.DistributedOptimizer` documents; the defaults
    are this class's (:data:`DEFAULTS`)."""

    bucket_cap_mb: float = 25.0
    nonfinite: Literal["skip", "raise"] = "skip"
    check_every: int | None = None
    compression: Compression = "none"
    overlap: bool = True
    noise_scale: bool | float = False
    comm_hook: CommHook | Callable[[GradBucket, Engine], Reducing] | None = None
    #: When workers exchange, and what (``None``: every step's gradients).
    step_policy: StepPolicy | None = None
    #: How gradients are combined: from ``compression`` and ``comm_hook``, or
    #: Horovod's arguments.
    reduction: Reduction = field(default_factory=Reduction, compare=False)

    @classmethod
    def of(cls, *, reduction: Reduction | None = None, **options: Any) -> ReducerOptions:
        """The options (each one left out takes its default), or
        ``TypeError``/``ValueError`` naming a wrong one.

        :param reduction: Horovod's combination, in place of ``compression``'s.
        """
        given = dataclasses.replace(DEFAULTS, **options)  # an unknown name is a TypeError
        check_number("bucket_cap_mb", given.bucket_cap_mb, positive=True)
        check_choice("nonfinite", given.nonfinite, ("skip", "raise"))
        check_int("check_every", given.check_every, minimum=1, optional=True)
        check_bool("overlap", given.overlap)
        NoiseScaleEstimator.smoothing_of(given.noise_scale)  # fails here, not at step 1
        policy = given.step_policy
        if policy is not None and not isinstance(policy, StepPolicy):
            raise TypeError(
                f"step_policy must be a pyro_distributed.StepPolicy (pd.LocalSGD, pd.DiLoCo) "
                f"or None, got {type(policy).__name__}"
            )
        if policy is not None and policy.steps_alone and given.noise_scale is not False:
            raise ValueError(
                f"noise_scale needs every step's averaged gradient, and step_policy={policy!r} "
                f"lets workers step alone: leave one of them out"
            )
        if reduction is None:
            hook = None if given.comm_hook is None else as_hook(given.comm_hook)
            narrow = compressor(given.compression)
            if hook is not None and narrow is not None:
                # The hook runs on the bucket cast to the narrow type.
                hook, narrow = NarrowedHook(hook, narrow), None
            reduction = Reduction(compression=narrow, hook=hook)
        return dataclasses.replace(given, reduction=reduction)


#: The default options: what every front end's signature shows.
DEFAULTS = ReducerOptions()


class OptimizerOptions(TypedDict, total=False):
    """Options for the optimizers a framework wraps for the user (the Lightning
    strategy's ``optimizer_options``), each as :class:`~pyro_distributed.DistributedOptimizer`
    documents it; an option left out takes its default there.

    ``multi_tensor`` concerns ``pyro.optim`` optimizers alone: a torch
    optimizer steps its tensors together already (its ``foreach``).

    Example::

        from pyro_distributed.integrations.lightning import (
            OptimizerOptions,
            PyroDistributedStrategy,
        )

        options: OptimizerOptions = {"compression": "bf16", "check_every": 100}
        strategy = PyroDistributedStrategy(optimizer_options=options)
    """

    bucket_cap_mb: float
    nonfinite: Literal["skip", "raise"]
    check_every: int | None
    compression: Compression
    overlap: bool
    noise_scale: bool | float
    comm_hook: CommHook | Callable[[GradBucket, Engine], Reducing] | None
    step_policy: StepPolicy | None
    multi_tensor: bool | None


def check_optimizer_options(options: Any, where: str) -> OptimizerOptions:
    """``options`` as :class:`OptimizerOptions`, or ``TypeError``/``ValueError``
    naming a wrong one (checked now, not when the first optimizer is wrapped)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{where}: optimizer_options must be a dict, got {type(options).__name__}")
    if "engine" in options:
        raise TypeError(f"{where}: optimizer_options cannot hold 'engine'; pass engine= instead")
    known = OptimizerOptions.__annotations__
    unknown = sorted(str(name) for name in options if name not in known)
    if unknown:
        raise TypeError(
            f"{where}: unknown optimizer option(s) {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(map(repr, known))}"
        )
    try:
        ReducerOptions.of(**{name: options[name] for name in options if name != "multi_tensor"})
        check_bool("multi_tensor", options.get("multi_tensor"), optional=True)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: optimizer_options: {error}") from None
    return OptimizerOptions(**options)  # type: ignore[typeddict-item]


class EngineBinding:
    """The engine an optimizer runs on, chosen when it is first needed.

    A running :class:`~pyro_distributed.engines.Engine`, or ``"local"``, is
    bound at once: it says how many workers there are. Any other name
    (``"auto"``, ``"torch"``, ``"horovod"``) is started with
    :func:`pyro_distributed.init` at the first call to :meth:`engine`, which
    the front ends make at their first step.
    """

    def __init__(self, engine: str | Engine) -> None:
        if isinstance(engine, str):
            check_engine_name(engine, "the optimizer's engine=")
        elif not isinstance(engine, Engine):
            raise TypeError(f"engine must be a name or an Engine, got {type(engine).__name__}")
        self._wanted = engine
        self._engine: Engine | None = None
        if isinstance(engine, Engine):
            self._engine = engine
        elif engine == "local":
            self._engine = runtime.init("local")

    @property
    def bound(self) -> bool:
        """Whether the engine was chosen already."""
        return self._engine is not None

    def describe(self) -> str:
        """The engine for a ``repr``, without choosing one."""
        return repr(self._engine) if self._engine is not None else f"{self._wanted!r} (unbound)"

    def engine(self) -> Engine:
        """The engine, started now if it was not yet chosen.

        :raises PyroDistributedError: if it was bound to one worker by name
            (``"auto"`` before a process group existed, or ``"local"``) and a
            process group of more workers has appeared since. An engine object
            the caller passed is used as given: loading a launch's results at
            one worker, inside a worker of another launch, asks for exactly that.
        """
        if self._engine is None:
            assert isinstance(self._wanted, str)
            self._engine = runtime.init(self._wanted)
        elif self._engine.world_size == 1 and isinstance(self._wanted, str):
            larger = self._engine.outgrown()
            if larger is not None:
                raise PyroDistributedError(
                    f"this optimizer was bound to one worker (the {self._engine.name!r} "
                    f"engine), but {larger} has appeared since; averaging over one worker "
                    f"would leave every worker training its own replica. Build the "
                    f"optimizer with engine='auto' and do not step it (nor call "
                    f"pd.init('local')) before the process group exists."
                )
        return self._engine
