"""Sharded plate subsampling: ``pyro.plate(..., subsample_size=b)`` split across workers.

Without help, every worker's ``pyro.plate(name, size, subsample_size=b)``
draws the same b indices (or independent ones, if seeded apart), so averaging
gradients gains little. Inside :func:`shard_subsamples`, each such plate takes
one permutation of ``range(size)`` from the generator that all workers share,
and worker r keeps its slice ``[r*b, (r+1)*b)``. Together the W workers see
W*b distinct indices, a sample without replacement, fresh at every draw.

The plate's subsample site is an ordinary Pyro sample site, so this is a
plain effect handler: it fills in the indices only where nothing else did. A
user-supplied ``subsample=`` is left alone, and the model replays the indices
the guide drew under the same name (as SVI always does), so plates entered in
both guide and model agree. Pyro's scaling by size / b is unchanged, so the
average of the workers' gradients is an unbiased estimate from W*b points.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from . import runtime
from .plates import shard_lengths
from .seeding import shared_generator

__all__ = ["shard_subsamples"]


class shard_subsamples(Messenger):
    """Give each worker a disjoint share of every plate's subsample.

    Use it around ``svi.step``: every ``pyro.plate(name, size,
    subsample_size=b)`` entered inside gives this worker b indices, disjoint
    from the other workers' b, all drawn from one permutation shared by every
    worker and fresh at each draw.

    Example::

        pd.set_rng_seed(0)          # seeds the shared permutations too
        for step in range(num_steps):
            with pd.shard_subsamples():
                loss = svi.step(data)

    :raises ValueError: when ``world_size * subsample_size`` exceeds a plate's size.

    It also watches for the commonest mistake with sharded data: a plate
    sized by this worker's shard, ``pyro.plate("data", len(x_mine))`` with
    ``x_mine = pd.shard(x)``, which fits the posterior of the shard alone.
    Such a plate gets a :class:`UserWarning` naming it and the fix
    (:func:`~pyro_distributed.data_plate`).

    .. warning::
        Every worker must enter the same plates in the same order, as the
        shared generator advances once per subsampled plate. Seed it with
        :func:`pyro_distributed.set_rng_seed` (the same seed on every worker).
    """

    def _pyro_sample(self, msg: Any) -> None:
        fn = msg["fn"]
        if not isinstance(fn, _Subsample) or msg["value"] is not None:
            return
        size, per_worker = fn.size, fn.subsample_size
        workers, rank = runtime.world_size(), runtime.rank()
        if workers > 1:
            _warn_if_sized_by_a_shard(msg["name"], size)
        if per_worker is None or per_worker >= size:
            return  # no subsampling: every worker sees the whole plate
        if workers * per_worker > size:
            raise ValueError(
                f"plate {msg['name']!r}: {workers} workers x subsample_size {per_worker} "
                f"exceeds its size {size}; lower subsample_size to at most {size // workers}"
            )
        permutation = torch.randperm(size, generator=shared_generator())
        mine = permutation[rank * per_worker : (rank + 1) * per_worker]
        msg["value"] = mine.to(fn.device)


def _warn_if_sized_by_a_shard(name: str, size: int) -> None:
    whole = shard_lengths().get(size)
    if whole is None:
        return
    warnings.warn(
        f"plate {name!r} has size {size}, the length of this worker's shard from "
        f"pd.shard of a data set of {whole} rows: it fits the posterior of this shard "
        f"alone (widths about sqrt(W) too wide). Write the plate as "
        f"pd.data_plate({name!r}, x_mine), or pyro.plate({name!r}, {whole}, "
        f"subsample=...) with the shard's global indices",
        UserWarning,
        stacklevel=2,
    )
