"""The options both front ends take, checked and turned into an exchange one way.

``DistributedOptimizer`` over a Pyro optimizer and over a torch optimizer
take the same keyword arguments with the same meaning; this module checks
them and builds the :class:`~pyro_distributed.exchange.sync.GradientSync`
they share, so that the two cannot drift apart.

Binding: an optimizer is often built before the processes that will train it
have met (scvi-tools builds its Pyro optimizer before Lightning creates the
process group). So an optimizer does not choose its engine when it is built
but at its first step (:class:`EngineBinding`; :class:`BindsAtFirstStep`
gives both front ends the ``engine`` property that binds): by then the
launcher's or the host framework's process group exists and
``engine="auto"`` adopts it. An
optimizer already bound to one worker re-checks at every step that no larger
group has appeared since, and refuses to go on if one has: averaging over one
worker while others exist would train W independent replicas, silently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from .. import runtime
from ..checks import check_bool, check_choice, check_int, check_number
from ..engines import ENGINE_NAMES, Engine
from ..errors import PyroDistributedError
from ..exchange import GradientSync, Reduction
from ..local.gradients import LocalGradients
from .noise_scale import NoiseScaleEstimator

__all__ = ["BindsAtFirstStep", "EngineBinding", "bind_exchange", "check_options", "make_sync"]


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
            if engine != "auto" and engine not in ENGINE_NAMES:
                raise ValueError(
                    f"unknown engine {engine!r}; choose 'auto' or one of {', '.join(ENGINE_NAMES)}"
                )
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


class BindsAtFirstStep(ABC):
    """What both front ends share about binding: the :attr:`engine`, bound when first read.

    A front end sets ``_binding`` (an :class:`EngineBinding`) and
    ``_local = None`` in its constructor, and builds what depends on the
    engine (its exchange, with :func:`bind_exchange`) in :meth:`_bind`, which
    sets ``_local`` and ``_sync``. Reading :attr:`engine` or :attr:`sync`
    (every step does) binds once and then only re-checks the binding. It
    holds no state and defines no
    ``__init__``, so a front end that is a ``torch.optim.Optimizer`` still
    never runs ``Optimizer.__init__``.
    """

    _binding: EngineBinding
    _local: LocalGradients | None
    _sync: GradientSync | None

    @property
    def engine(self) -> Engine:
        """The engine this optimizer averages on, chosen at its first step
        (:class:`~pyro_distributed.optim.options.EngineBinding`)."""
        engine = self._binding.engine()
        if self._local is None:
            self._bind()
        return engine

    @property
    def sync(self) -> GradientSync | None:
        """The gradient exchange; ``None`` with one worker, which has nothing to
        exchange. Its read-only properties (``overlaps``, ``overlap_armed``,
        ``bucket_count``) show how gradients travel."""
        self.engine  # noqa: B018 (binds the engine)
        return self._sync

    @abstractmethod
    def _bind(self) -> None:
        """Build what depends on the bound engine, and set ``_local``."""


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


def bind_exchange(
    engine: Engine,
    noise_scale: bool | float,
    bucket_cap_mb: float,
    reduction: Reduction,
    overlap: bool,
    catalog_name: str,
) -> tuple[NoiseScaleEstimator | None, GradientSync | None, LocalGradients]:
    """What a front end builds once its engine is bound: the noise-scale
    estimator, the gradient exchange (``None`` with one worker) and the
    handling of local parameters' gradients."""
    noise = NoiseScaleEstimator.create(noise_scale, engine.world_size)
    sync = make_sync(engine, bucket_cap_mb, reduction, overlap, noise, catalog_name)
    return noise, sync, LocalGradients(engine)
