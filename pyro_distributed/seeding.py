"""Per-worker randomness from one seed, and the draws all workers share.

Data-parallel SVI needs two kinds of randomness. The guide's Monte Carlo
samples must be independent across workers, or the extra workers reduce no
variance; but some draws, such as which data points each plate subsamples,
must be identical everywhere so that workers can split them. :func:`set_rng_seed`
seeds Pyro, torch, NumPy and :mod:`random` with a different seed on each
worker, derived from one seed and the rank, and seeds the shared generator
that :func:`pyro_distributed.shard_subsamples` draws from with the seed itself.
"""

from __future__ import annotations

import numpy as np
import pyro
import torch

from . import runtime
from .checks import check_int

_shared = torch.Generator().manual_seed(0)
# Draws inside this worker's own block of a plate: seeded from the rank, on
# first use if set_rng_seed never ran, so that workers draw independently.
_block: torch.Generator | None = None
_BLOCK_STREAM = 1
#: Seeds are below this: the shared generator takes the seed itself, and
#: torch's generators take 64-bit seeds. Each worker's own generators get a
#: 32-bit seed derived from it, which NumPy's legacy seeding also takes.
_SEED_LIMIT = 2**64


def derived_seed(seed: int, *path: int) -> int:
    """A 32-bit seed for the stream named by ``path`` under ``seed``; streams
    with different paths are independent."""
    # The path's length goes first: SeedSequence pads its entropy with zeros,
    # so (s, e) and (s, e, 0) would otherwise name the same stream.
    entropy = [seed, len(path), *path]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint32)[0])


def worker_seed(seed: int, rank: int) -> int:
    """The seed worker ``rank`` uses under ``set_rng_seed(seed)`` (fits in 32 bits)."""
    return derived_seed(seed, rank)


def set_rng_seed(seed: int) -> None:
    """Seed every generator for a reproducible run that is random across workers.

    Each worker seeds Pyro, torch, NumPy and :mod:`random` with
    ``worker_seed(seed, rank)``, so guide samples are independent across
    workers; the generator behind shared draws (plate subsamples under
    :func:`~pyro_distributed.shard_subsamples`) gets ``seed`` itself on every
    worker. A fixed seed and world size give the same run every time.

    Example::

        pyro_distributed.set_rng_seed(0)   # instead of pyro.set_rng_seed(0)

    :param seed: an int with ``0 <= seed < 2**64``.

    .. warning::
        Call it on every worker with the same ``seed``.
    """
    check_int("seed", seed, minimum=0)
    if seed >= _SEED_LIMIT:
        raise ValueError(f"seed must be an int with 0 <= seed < 2**64, got {seed!r}")
    pyro.set_rng_seed(worker_seed(seed, runtime.rank()))
    _shared.manual_seed(seed)
    block_generator().manual_seed(derived_seed(seed, runtime.rank(), _BLOCK_STREAM))


def shared_generator() -> torch.Generator:
    """The generator whose draws are identical on every worker."""
    return _shared


def block_generator() -> torch.Generator:
    """This worker's generator for subsamples drawn inside its own block."""
    global _block
    if _block is None:
        _block = torch.Generator().manual_seed(derived_seed(0, runtime.rank(), _BLOCK_STREAM))
    return _block
