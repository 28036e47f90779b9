"""A run whose local rows are owned, for the tests of block-file checkpoints
(``tests/local/test_blocks.py``, ``tests/checkpoint/test_fuzz.py``)."""

from __future__ import annotations

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
import pyro_distributed.local.blocks
import pyro_distributed.local.registry

from .ownership import data, guide, model


def owned_svi() -> tuple[SVI, pd.DistributedOptimizer, torch.Tensor]:
    pd.set_rng_seed(5)
    x = data()
    with pd.shard_subsamples(own_local_params=True):
        guide(x)  # create the parameters before a checkpoint is loaded
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    return SVI(model, guide, optim, Trace_ELBO()), optim, x


def train_owned(svi: SVI, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        with pd.shard_subsamples(own_local_params=True):
            svi.step(x)
