"""How long bringing owned local rows back from a launch takes, at 10^6 rows.

Each worker trains one step of a model whose guide owns two (N, 3) parameters
(``shard_subsamples(own_local_params=True)``), so the whole posterior of the
local latents is 2 x 3 x N floats. The function returns as soon as the step
is done; what follows is the launch carrying every worker's block back:

    python benchmarks/launch_rows.py 1000000 2

prints, as JSON, the seconds of the whole launch with the rows loaded into
this process, with the rows left on disk (``rows_in_memory=0``), and of
reading them back from disk with ``Launched.local_rows``, each the median of
three, and the bytes of the rows.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

import pyro_distributed as pd

D = 3


def model(x: torch.Tensor) -> None:
    with pyro.plate("data", len(x), subsample_size=64) as idx:
        z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        pyro.sample("x", dist.Normal(z, 0.5).to_event(1), obs=x[idx])


def guide(x: torch.Tensor) -> None:
    with pyro.plate("data", len(x), subsample_size=64):
        loc = pyro.param("z_loc", torch.zeros(len(x), D), event_dim=1)
        scale = pyro.param(
            "z_scale", torch.ones(len(x), D), constraint=constraints.positive, event_dim=1
        )
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))


def one_step(rows: int) -> int:
    x = torch.zeros(rows, D)
    with pd.shard_subsamples(own_local_params=True):
        guide(x)
    svi = SVI(model, guide, pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01})), Trace_ELBO())
    with pd.shard_subsamples(own_local_params=True):
        svi.step(x)
    return rows


def timed(rows: int, workers: int, **options: object) -> tuple[float, pd.Launched]:
    pyro.clear_param_store()
    began = time.perf_counter()
    launched = pd.launch(one_step, rows, workers=workers, **options)  # type: ignore[arg-type]
    return time.perf_counter() - began, launched


def main() -> None:
    rows, workers = int(sys.argv[1]), int(sys.argv[2])
    loaded, on_disk, read = [], [], []
    for _ in range(3):
        seconds, _ = timed(rows, workers)
        loaded.append(seconds)
        seconds, launched = timed(rows, workers, rows_in_memory=0)
        on_disk.append(seconds)
        began = time.perf_counter()
        launched.local_rows("z_loc")
        launched.local_rows("z_scale")
        read.append(time.perf_counter() - began)
    report = {
        "rows": rows,
        "workers": workers,
        "row_bytes": 2 * rows * D * 4,
        "launch_rows_loaded_s": statistics.median(loaded),
        "launch_rows_on_disk_s": statistics.median(on_disk),
        "read_back_from_disk_s": statistics.median(read),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
