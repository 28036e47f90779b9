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
from .checks import check_int


def block_range(n: int) -> range:
    """This worker's contiguous block of ``range(n)``: every item on exactly one
    worker, block lengths differing by at most one, blocks in rank order.

    These are the rows whose local parameters this worker owns under
    ``shard_subsamples(own_local_params=True)``, so a worker can read only
    them (from disk, say) and never hold the others'. Name them in the
    plate with ``subsample=``:

    Example::

        rows = pd.block_range(N)                 # worker 1 of 2, N = 10: range(5, 10)
        counts_mine = read_rows(path, rows)      # your reader: these rows only
        held = torch.arange(rows.start, rows.stop)

        def model(counts_mine):
            with pyro.plate("spots", N, subsample=held) as spots:
                ...
                pyro.sample("obs", ..., obs=counts_mine[spots - rows.start])

    .. warning::
        With only its rows on a worker, let no plate draw its own subsample
        (``subsample_size=``) when the guide is an AutoGuide: the guide's
        first call traces the model where ``shard_subsamples`` cannot reach
        it (AutoGuides build their prototype under ``poutine.block``), and
        the plate there draws from all N rows, naming rows this worker does
        not hold. Pass ``subsample=``: the block, or a batch of it from
        :class:`~pyro_distributed.ShardSampler` with ``by_block=True``.
    """
    check_int("n", n, minimum=0)
    workers, rank = runtime.world_size(), runtime.rank()
    return range(rank * n // workers, (rank + 1) * n // workers)
