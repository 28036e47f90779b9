"""Owned local rows trained on two workers, as torchrun runs it and as a notebook launches it.

``train`` is what a notebook's cell defines (tests/spawn/test_notebooks.py
copies its source into one); run as a script under torchrun, it trains the
same way and saves what ``pd.gather_param`` joins on worker 0.

    torchrun --nproc-per-node 2 tests/spawn/scripts/owned_rows.py STEPS OUT
"""

from __future__ import annotations

import sys

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
from tests.local.test_ownership import data, guide, model

NAMES = ("mu_loc", "z_loc", "z_scale")


def train(steps, seed=None):  # type: ignore[no-untyped-def]
    if seed is not None:
        pd.set_rng_seed(seed)
    x = data()
    with pd.shard_subsamples(own_local_params=True):
        guide(x)  # the parameters, local ones cut to this worker's block
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(steps):
        with pd.shard_subsamples(own_local_params=True):
            svi.step(x)
    return optim.num_steps


if __name__ == "__main__":
    steps, out = int(sys.argv[1]), sys.argv[2]
    pd.init()
    train(steps, seed=0)
    joined = {name: pd.gather_param(name) for name in NAMES}  # constrained, on worker 0
    if pd.is_main():
        torch.save(joined, out)
