"""Quickstart: Bayesian linear regression, each worker on its shard, the posterior of all the data.

python examples/quickstart.py                                     # one process
torchrun --standalone --nproc-per-node 2 examples/quickstart.py   # two workers
"""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 10.0).expand([x.shape[1]]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pd.data_plate("data", x):  # sized by all the data, not by this worker's shard
        pyro.sample("y", dist.Normal(x @ w, sigma), obs=y)


def make_data(n, seed):
    generator = torch.Generator(device).manual_seed(seed)  # the same data on every worker
    x = torch.randn(n, 3, generator=generator)
    y = x @ torch.tensor([2.0, -1.0, 0.5]) + 0.3 * torch.randn(n, generator=generator)
    return x, y


pd.init()  # joins torchrun's, horovodrun's or mpirun's workers; a plain process is 1 worker
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":  # data, parameters and samples on this worker's GPU
    torch.set_default_device(device)
pd.set_rng_seed(0)  # independent guide noise on each worker, from one seed
x, y = make_data(10_000, seed=0)
x_mine, y_mine = pd.shard(x), pd.shard(y)  # this worker's rows: every row on one worker

guide = AutoNormal(model)
optim = pd.DistributedOptimizer(pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.999}))
svi = SVI(model, guide, optim, Trace_ELBO())
for step in range(1500):
    loss = pd.all_mean(svi.step(x_mine, y_mine))  # the global loss, on every worker
    if pd.is_main() and step % 500 == 0:
        print(f"step {step}: loss {loss:.1f}")

# Evaluation and prediction, each spread over the workers.
x_test, y_test = make_data(1_001, seed=1)
test_loss = pd.evaluate_loss(Trace_ELBO(), model, guide, (x_test, y_test), batch_size=256)
samples = pd.Predictive(model, guide=guide, num_samples=1000, seed=0)(x_test)
if pd.is_main():  # Predictive gathers on worker 0
    w = samples["w"].squeeze(1)
    print(f"w: mean {w.mean(0).tolist()} sd {w.std(0).tolist()}")
    print(f"held-out ELBO per point: {-test_loss / len(x_test):.3f}")
    print(f"predictions: {tuple(samples['y'].shape)}")
