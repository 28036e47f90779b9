"""A BatchNorm regression trained on every worker, through ``pyro.module``, a
``PyroModule`` or plain torch, for the tests of module buffers
(``tests/optim/test_module_buffers.py`` and the same on Horovod)."""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.nn import PyroModule

import pyro_distributed as pd

STEPS = 4


def network() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1)
    )


class Regression(PyroModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(self.net(x).squeeze(-1), 1.0), obs=y)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's own batch: different on every worker."""
    generator = torch.Generator().manual_seed(10 + pd.rank())
    x = torch.randn(16, 3, generator=generator) * (1.0 + pd.rank()) + pd.rank()
    return x, x.sum(-1)


def trained(path: str) -> dict[str, Any]:
    """Train with BatchNorm on ``path``; the buffers after the first step before
    and after averaging, and every buffer at the end."""
    pd.set_rng_seed(0)
    x, y = data()
    pyro.settings.set(module_local_params=path == "torch")  # before the PyroModule is made
    model = Regression()
    bn = model.net[1]
    seen: list[torch.Tensor] = []
    bn.register_forward_hook(lambda *_: seen.append(bn.running_mean.clone()))
    if path == "torch":
        loss_fn = Trace_ELBO()(model, lambda x, y: None)
        optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.01))
        steps = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss_fn(x, y).backward()
            optimizer.step()
            steps.append(bn.running_mean.clone())
        pyro.settings.set(module_local_params=False)
    else:
        if path == "pyro.module":
            net = model.net

            def run(x: torch.Tensor, y: torch.Tensor) -> None:
                pyro.module("net", net)
                with pyro.plate("data", len(x)):
                    pyro.sample("y", dist.Normal(net(x).squeeze(-1), 1.0), obs=y)

        optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}))
        svi = SVI(run if path == "pyro.module" else model, lambda x, y: None, optim, Trace_ELBO())
        steps = []
        for _ in range(STEPS):
            svi.step(x, y)
            steps.append(bn.running_mean.clone())
        pd.assert_in_sync(optim)
        optimizer = optim
    pd.assert_in_sync(optimizer)  # covers buffers, integer ones included
    return {
        "own_first": seen[0],
        "first": steps[0],
        "buffers": {name: b.clone() for name, b in model.named_buffers()},
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
    }
