"""How a range of rows is cut into one contiguous block per worker.

Several parts of the library must agree, row for row, on which worker holds
what: the sampler that feeds each worker its block (``ShardSampler(by_block=True)``),
the plates that draw subsamples inside blocks, the local parameters that store
only their worker's block, and evaluation, which gives each worker one block of
the held-out data. They all call :func:`block_range`, so that the arithmetic
lives in one place.
"""

from __future__ import annotations

from . import runtime


def block_range(n: int) -> range:
    """This worker's contiguous block of ``range(n)``: every item on exactly one
    worker, block lengths differing by at most one, blocks in rank order."""
    workers, rank = runtime.world_size(), runtime.rank()
    return range(rank * n // workers, (rank + 1) * n // workers)
