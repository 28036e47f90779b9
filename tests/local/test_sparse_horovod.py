"""Sparse local steps under the real ``horovodrun --gloo``: the same numbers as on gloo.

One horovodrun launch runs a Pyro-path run (``HorovodOptimizer``) and a
torch-native run (``DistributedOptimizer`` over ``torch.optim.Adam``, on the
horovod engine); each must equal, bitwise on every worker, the same run on the
torch engine under the test harness. At W=2 an average of two gradients is
the same float whichever engine sums it, so any difference would come from
the sparse step itself.
"""

from __future__ import annotations

from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

from ..support.compare import assert_same_state
from ..support.harness import WorkerFailure, run_under_launcher, run_workers
from ..support.ownership import data, model
from ..support.sparse import STEPS, plates, trained

pytestmark = pytest.mark.horovod


def pyro_path() -> dict[str, Any]:
    pd.set_rng_seed(0)
    engine = pd.current_engine().name
    wrap = pd.HorovodOptimizer if engine == "horovod" else pd.DistributedOptimizer
    optim = wrap(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(model, AutoNormal(model, create_plates=plates), optim, Trace_ELBO(num_particles=2))
    for _ in range(STEPS):
        with pd.shard_subsamples(own_local_params=True, local_updates="sparse"):
            svi.step(data())
    store = pyro.get_param_store()
    values = {name: value.detach().clone() for name, value in store.named_parameters()}
    return {"engine": engine, "values": values, "optim": optim.get_state()}


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def torch_path() -> dict[str, Any]:
    return {"engine": pd.current_engine().name, "values": trained("auto", adam, STEPS)}


def test_sparse_steps_under_horovodrun_equal_the_torch_engines_bitwise() -> None:
    outcome = run_under_launcher("horovod", [("pyro", pyro_path, ()), ("torch", torch_path, ())])
    for name, fn in (("pyro", pyro_path), ("torch", torch_path)):
        result = outcome[name]
        if isinstance(result, WorkerFailure):
            raise result
        on_gloo = run_workers(fn)
        for rank, (mine, reference) in enumerate(zip(result, on_gloo, strict=True)):
            assert (mine.pop("engine"), reference.pop("engine")) == ("horovod", "torch")
            assert_same_state(mine, reference, f"{name}, worker {rank}")
