"""The gradient's trip between workers, knowing nothing of Pyro.

A front end (:mod:`pyro_distributed.optim`) hands the exchange a list of named
tensors once per step; the exchange agrees with every other worker on which
tensors take part (:mod:`.agreement`), packs their gradients into a few fused
buckets (:mod:`.bucket`: each owns its layout, buffer and trip), averages them
(:mod:`.averager`; each bucket travels through a communication hook,
:mod:`.hooks`, :mod:`.compression`, :mod:`.low_rank`), starts the
buckets while backward is still running (:mod:`.overlap`), and writes the
averages back into ``.grad``. :class:`GradientSync` owns all of it, so a
second front end calls one object instead of re-implementing the trip.

The names below are the exchange's face: code outside this package imports
them from here, never from its modules (an import-linter contract checks it),
so the modules can be rearranged without touching the front ends. Nothing
here imports Pyro, directly or through this package's own modules (checked
the same way).
"""

from .agreement import Catalog
from .averager import Reduction
from .compression import Compression, compressor
from .hooks import (
    AverageHook,
    CommHook,
    Compressor,
    GradBucket,
    NarrowedHook,
    Reducing,
    Waiting,
    as_hook,
)
from .low_rank import LowRankHook
from .overlap import Channel
from .sync import Exchanged, ExchangePlan, GradientSync

__all__ = [
    "AverageHook",
    "Catalog",
    "Channel",
    "CommHook",
    "Compression",
    "Compressor",
    "ExchangePlan",
    "Exchanged",
    "GradBucket",
    "GradientSync",
    "LowRankHook",
    "NarrowedHook",
    "Reducing",
    "Reduction",
    "Waiting",
    "as_hook",
    "compressor",
]
