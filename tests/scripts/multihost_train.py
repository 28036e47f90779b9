"""Bayesian regression on each worker's shard, as a user's script would run it on a cluster.

python tests/scripts/multihost_train.py OUT_DIR STEPS [TIMEOUT_S]

Every worker writes ``OUT_DIR/rank{R}.pt``: its host name, the world size,
the interface gloo was told to use, and its final parameters. Each step also
touches ``OUT_DIR/step{R}`` so that a test can tell the run is under way.
"""

import os
import socket
import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd


def model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 10.0).expand([x.shape[1]]).to_event(1))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pd.data_plate("data", x):
        pyro.sample("y", dist.Normal(x @ w, sigma), obs=y)


def main(out: Path, steps: int, timeout: float) -> None:
    pd.init(timeout=timeout)
    pd.set_rng_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2_000, 3, generator=generator)
    y = x @ torch.tensor([2.0, -1.0, 0.5]) + 0.3 * torch.randn(2_000, generator=generator)
    x_mine, y_mine = pd.shard(x), pd.shard(y)
    guide = AutoNormal(model)
    svi = SVI(model, guide, pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05})), Trace_ELBO())
    beat = out / f"step{pd.rank()}"
    for step in range(steps):
        svi.step(x_mine, y_mine)
        beat.write_text(str(step))
    params = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    torch.save(
        {
            "host": socket.gethostname(),
            "world_size": pd.world_size(),
            "engine": pd.current_engine().name,
            "interface": os.environ.get("GLOO_SOCKET_IFNAME"),
            "params": params,
        },
        out / f"rank{pd.rank()}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 60.0)
