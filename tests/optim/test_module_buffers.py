"""Module buffers end every step identical on every worker (optim/module_buffers.py).

A real ``torch.nn.BatchNorm1d`` is trained on real gloo workers, each on its
own data, on the SVI path (``pyro.module`` and a ``PyroModule`` whose
parameters are the param store's) and on the torch-native path. Without the
averaging, each worker's running statistics follow its own batches.
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO

import pyro_distributed as pd
from pyro_distributed.optim.module_buffers import trained_modules

from ..support.harness import run_workers, with_engines
from ..support.module_buffers import STEPS, Regression, data, network, trained


@pytest.mark.parametrize(
    ("engine", "workers", "path"),
    with_engines(
        [(workers, path) for workers in (2, 3) for path in ("pyro.module", "PyroModule", "torch")],
        on_mpi=[(3, "PyroModule")],
    ),
)
@pytest.mark.slow
def test_batchnorm_statistics_are_the_same_on_every_worker_after_every_step(
    engine: str, workers: int, path: str
) -> None:
    results = run_workers(trained, path, world_size=workers, timeout=600, engine=engine)
    first = results[0]
    own = [result["own_first"] for result in results]
    assert not torch.equal(own[0], own[1]), "each worker's batch moves its own statistics"
    # After the first step: the mean of the workers' own running means.
    mean = torch.stack(own).sum(0) * (1.0 / workers)
    for result in results:
        assert torch.allclose(result["first"], mean, rtol=1e-6, atol=1e-7)
        for name, value in first["buffers"].items():
            assert torch.equal(result["buffers"][name], value), name
        assert result["buffers"]["net.1.num_batches_tracked"] == STEPS
        for name, value in first["params"].items():
            assert torch.equal(result["params"][name], value), name


def drifted() -> str:
    """A buffer changed on worker 1 only, after the step: the drift check names it."""
    x, y = data()
    pyro.settings.set(module_local_params=True)
    model = Regression()
    loss_fn = Trace_ELBO()(model, lambda x, y: None)
    optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.01))
    loss_fn(x, y).backward()
    optimizer.step()
    pyro.settings.set(module_local_params=False)
    if pd.rank() == 1:
        model.net[1].running_var.add_(1.0)
    try:
        pd.assert_in_sync(optimizer)
    except pd.PyroDistributedError as error:
        return str(error)
    return "no error"


def test_assert_in_sync_names_a_buffer_that_drifted() -> None:
    for message in run_workers(drifted):
        assert "net.1.running_var" in message and "drifted" in message, message


def test_the_modules_found_are_the_topmost_ones_whose_parameters_are_all_stepped() -> None:
    outer = torch.nn.Sequential(network(), torch.nn.Linear(1, 1))
    inner = outer[0]
    assert trained_modules(list(inner.parameters())) == [inner]
    assert trained_modules(list(outer.parameters())) == [outer]
    assert trained_modules([]) == []
