"""The options both front ends take, checked and turned into an exchange one way.

``DistributedOptimizer`` over a Pyro optimizer and over a torch optimizer
take the same keyword arguments with the same meaning; this module checks
them and builds the :class:`~pyro_distributed.exchange.sync.GradientSync`
that their shared step (:mod:`.step`) owns, so that the two cannot drift
apart.

Binding: an optimizer is often built before the processes that will train it
have met (scvi-tools builds its Pyro optimizer before Lightning creates the
process group). So an optimizer does not choose its engine when it is built
but at its first step (:class:`EngineBinding`, held by the shared step,
which binds when a front end's ``engine`` is first read): by then the
launcher's or the host framework's process group exists and
``engine="auto"`` adopts it. An
optimizer already bound to one worker re-checks at every step that no larger
group has appeared since, and refuses to go on if one has: averaging over one
worker while others exist would train W independent replicas, silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from .. import runtime
from ..checks import check_bool, check_choice, check_int, check_number
from ..engines import Engine, check_engine_name
from ..errors import PyroDistributedError
from ..exchange import Compression, GradientSync, Reduction, compressor
from .noise_scale import NoiseScaleEstimator


class OptimizerOptions(TypedDict, total=False):
    """Options for the optimizers a framework wraps for the user (the Lightning
    strategy's ``optimizer_options``), each as :class:`~pyro_distributed.DistributedOptimizer`
    documents it; an option left out takes its default.

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
        check_options(
            options.get("bucket_cap_mb", 25.0),
            options.get("nonfinite", "skip"),
            options.get("check_every"),
            options.get("overlap", True),
        )
        compressor(options.get("compression", "none"))
        NoiseScaleEstimator.smoothing_of(options.get("noise_scale", False))
        check_bool("multi_tensor", options.get("multi_tensor"), optional=True)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: optimizer_options: {error}") from None
    return OptimizerOptions(**options)  # type: ignore[typeddict-item]


def check_options(bucket_cap_mb: Any, nonfinite: Any, check_every: Any, overlap: Any) -> None:
    """``TypeError`` or ``ValueError`` for an option of the wrong type or value."""
    check_number("bucket_cap_mb", bucket_cap_mb, positive=True)
    check_choice("nonfinite", nonfinite, ("skip", "raise"))
    check_int("check_every", check_every, minimum=1, optional=True)
    check_bool("overlap", overlap)


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

        :raises PyroDistributedError: if it is bound to one worker and a
            process group of more workers has appeared since.
        """
        if self._engine is None:
            assert isinstance(self._wanted, str)
            self._engine = runtime.init(self._wanted)
        elif self._engine.world_size == 1:
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


def make_sync(
    engine: Engine,
    bucket_cap_mb: float,
    reduction: Reduction,
    overlap: bool,
    noise: NoiseScaleEstimator | None,
    catalog_name: str,
) -> GradientSync | None:
    """The gradient exchange for these options; ``None`` with one worker, which
    has nothing to exchange."""
    if engine.world_size == 1:
        return None
    return GradientSync(
        engine,
        max(1, int(bucket_cap_mb * 2**20)),
        reduction,
        overlap=overlap,
        measure_norms=noise is not None,
        catalog_name=catalog_name,
    )
