"""A training script written for Pyro's own ``pyro.optim.HorovodOptimizer``.

It follows Pyro's documented recipe, boilerplate included (same seed on every
worker, a hand-written broadcast, a hand-averaged loss). The tests run it
as it is, and again with only the import line changed to
``from pyro_distributed import HorovodOptimizer``.
"""

import json

import horovod.torch as hvd
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import HorovodOptimizer

hvd.init()
torch.set_num_threads(1)
pyro.set_rng_seed(0)

generator = torch.Generator().manual_seed(hvd.rank())
x = torch.randn(64, 2, generator=generator)
y = x @ torch.tensor([1.5, -0.5]) + 0.1 * torch.randn(64, generator=generator)


def model(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", 1000, subsample=torch.arange(len(x))):
        pyro.sample("obs", dist.Normal(x @ w, 0.1), obs=y)


guide = AutoNormal(model)
guide(x, y)
hvd.broadcast_parameters(dict(pyro.get_param_store().named_parameters()), root_rank=0)

optim = HorovodOptimizer(pyro.optim.Adam({"lr": 0.05}))
svi = SVI(model, guide, optim, loss=Trace_ELBO())
for _ in range(100):
    loss = svi.step(x, y)
loss = hvd.allreduce(torch.tensor(loss), name="loss").item()

params = {name: p.tolist() for name, p in pyro.get_param_store().named_parameters()}
print(json.dumps({"rank": hvd.rank(), "loss": loss, "params": params}))
