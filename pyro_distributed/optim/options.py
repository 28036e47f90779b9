"""The options both front ends take, checked and turned into an exchange one way.

``DistributedOptimizer`` over a Pyro optimizer and over a torch optimizer
take the same keyword arguments with the same meaning; this module checks
them and builds the :class:`~pyro_distributed.exchange.sync.GradientSync`
they share, so that the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from .. import runtime
from ..checks import check_bool, check_choice, check_int, check_number
from ..engines import Engine
from ..exchange.averager import Reduction
from ..exchange.sync import GradientSync
from .noise_scale import NoiseScaleEstimator

__all__ = ["check_options", "make_sync", "start_engine"]


def check_options(bucket_cap_mb: Any, nonfinite: Any, check_every: Any, overlap: Any) -> None:
    """``TypeError`` or ``ValueError`` for an option of the wrong type or value."""
    check_number("bucket_cap_mb", bucket_cap_mb, positive=True)
    check_choice("nonfinite", nonfinite, ("skip", "raise"))
    check_int("check_every", check_every, minimum=1, optional=True)
    check_bool("overlap", overlap)


def start_engine(engine: str | Engine) -> Engine:
    """The engine ``engine`` names, started if needed, or ``engine`` itself."""
    if not isinstance(engine, (str, Engine)):
        raise TypeError(f"engine must be a name or an Engine, got {type(engine).__name__}")
    return runtime.init(engine) if isinstance(engine, str) else engine


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
