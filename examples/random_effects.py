"""Per-group random effects with local variational parameters owned by their worker.

python examples/random_effects.py                                     # one process
torchrun --standalone --nproc-per-node 2 examples/random_effects.py   # two workers
torchrun --standalone --nproc-per-node 2 examples/random_effects.py --local-updates sparse

Synthetic data with a known answer: G groups with m observations each,

    y[g, j] = mu + b[g] + noise,   b[g] ~ Normal(0, tau),   noise ~ Normal(0, sigma).

The guide has one Normal per group for b[g]: 2G local variational parameters,
declared with ``pyro.param(..., event_dim=0)`` inside the groups plate. Under
``pd.shard_subsamples(own_local_params=True)`` worker r holds only the r-th
block of them (and their Adam state), draws its subsample of groups from that
block, and never sends their gradients; mu, tau and sigma are global and
averaged as usual. At the end worker 0 gathers the posterior means of all G
effects (``pd.gather_param``) and compares them with the exact posterior
means, which this conjugate model has in closed form.

With ``--local-updates sparse`` each step touches only the groups in its
batch (``shard_subsamples(..., local_updates="sparse")``): a step costs
O(batch) instead of O(groups / W), with the lazy semantics of
``torch.optim.SparseAdam``. ``--trace-out run.json`` writes the loss against
wall time and the final figures, for ``benchmarks/convergence_local.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

import pyro_distributed as pd

TRUE_MU, TRUE_TAU, TRUE_SIGMA = 3.0, 1.0, 0.5


def make_data(groups: int, per_group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Observations (groups x per_group) and the true effects; the same on every worker."""
    generator = torch.Generator().manual_seed(seed)
    effects = TRUE_TAU * torch.randn(groups, generator=generator)
    noise = TRUE_SIGMA * torch.randn(groups, per_group, generator=generator)
    return TRUE_MU + effects[:, None] + noise, effects


def model(y: torch.Tensor, batch: int) -> None:
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = pyro.param("tau", torch.tensor(0.5), constraint=constraints.positive)
    sigma = pyro.param("sigma", torch.tensor(1.0), constraint=constraints.positive)
    with pyro.plate("groups", len(y), subsample_size=batch) as groups:
        b = pyro.sample("b", dist.Normal(0.0, tau))
        with pyro.plate("observations", y.shape[1]):
            pyro.sample("y", dist.Normal(mu + b, sigma), obs=y[groups].T)


def guide(y: torch.Tensor, batch: int) -> None:
    mu_loc = pyro.param("mu_loc", torch.tensor(0.0))
    mu_scale = pyro.param("mu_scale", torch.tensor(1.0), constraint=constraints.positive)
    pyro.sample("mu", dist.Normal(mu_loc, mu_scale))
    with pyro.plate("groups", len(y), subsample_size=batch):
        # Local: one row per group. Under own_local_params each worker keeps its block.
        b_loc = pyro.param("b_loc", torch.zeros(len(y)), event_dim=0)
        b_scale = pyro.param(
            "b_scale", torch.full((len(y),), 0.5), constraint=constraints.positive, event_dim=0
        )
        pyro.sample("b", dist.Normal(b_loc, b_scale))


def exact_posterior_means(y: torch.Tensor, mu: float, tau: float, sigma: float) -> torch.Tensor:
    """E[b | y] given mu, tau and sigma: the group mean's deviation, shrunk."""
    precision = y.shape[1] / sigma**2
    shrink = precision / (precision + 1 / tau**2)
    return shrink * (y.mean(dim=1) - mu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=5000)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--batch", type=int, default=250, help="groups per worker per step")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="of the data and of the run")
    parser.add_argument("--run-seed", type=int, help="of the run alone (default: --seed)")
    parser.add_argument(
        "--beta1",
        type=float,
        default=0.9,
        help="Adam's first-moment decay; lazy steps count it per visit of a row (see README)",
    )
    parser.add_argument(
        "--local-updates",
        choices=["dense", "sparse"],
        default="dense",
        help="step every owned row each step, or only the batch's (lazy)",
    )
    parser.add_argument("--trace-out", type=Path, help="write loss against wall time (JSON)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pd.init()
    pd.set_rng_seed(args.seed if args.run_seed is None else args.run_seed)
    y, effects = make_data(args.groups, args.per_group, seed=args.seed)
    # A decaying step size lets each group's parameters settle at the end.
    betas = (args.beta1, 0.999)
    optim = pd.DistributedOptimizer(
        pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.999, "betas": betas})
    )
    svi = SVI(model, guide, optim, Trace_ELBO())
    if pd.is_main():
        print(
            f"training on {pd.world_size()} worker(s): {args.groups} groups, "
            f"{args.batch} per worker per step"
        )
    started = time.perf_counter()
    trace: list[tuple[float, float]] = []  # (seconds, this worker's loss)
    for step in range(args.steps):
        with pd.shard_subsamples(own_local_params=True, local_updates=args.local_updates):
            loss = svi.step(y, args.batch)
        trace.append((time.perf_counter() - started, loss))
        if step % 500 == 0:
            # A collective, so only every 500 steps: the other steps stay local.
            loss = pd.all_mean(loss)
            if pd.is_main():
                print(f"step {step}: loss {loss:.1f}")
    elapsed = time.perf_counter() - started
    traces = pd.current_engine().allgather_object(trace)

    indices, _ = pd.local_rows("b_loc")  # this worker's block, and where it sits
    b_loc = pd.gather_param("b_loc")  # every worker takes part; worker 0 gets all rows
    if pd.is_main():
        assert b_loc is not None
        mu, tau, sigma = (pyro.param(n).item() for n in ("mu_loc", "tau", "sigma"))
        exact = exact_posterior_means(y, mu, tau, sigma)
        correlation = torch.corrcoef(torch.stack([b_loc, effects]))[0, 1].item()
        error = (b_loc - exact).pow(2).mean().sqrt().item()
        print(f"trained {args.steps} steps in {elapsed:.1f} s")
        print(f"worker 0 holds {len(indices)} of {args.groups} groups' parameters")
        print(f"mu {mu:.3f}, tau {tau:.3f}, sigma {sigma:.3f}")
        print(f"true mu {TRUE_MU}, tau {TRUE_TAU}, sigma {TRUE_SIGMA}")
        # Even the exact posterior means correlate with the truth by only
        # sqrt(shrinkage): the data say that much about each group.
        best = exact_posterior_means(y, TRUE_MU, TRUE_TAU, TRUE_SIGMA)
        ceiling = torch.corrcoef(torch.stack([best, effects]))[0, 1].item()
        print(f"effects: correlation with the truth {correlation:.3f} (at best {ceiling:.3f})")
        print(f"effects: RMS distance to the exact posterior means {error:.4f}")
        if args.trace_out is not None:
            # The loss averaged over workers, at worker 0's clock.
            losses = [sum(t[i][1] for t in traces) / len(traces) for i in range(args.steps)]
            record = {
                "local_updates": args.local_updates,
                "world_size": pd.world_size(),
                "seconds": [t for t, _ in traces[0]],
                "loss": losses,
                "correlation": correlation,
                "ceiling": ceiling,
                "rms_to_exact": error,
                "mu": mu,
                "tau": tau,
                "sigma": sigma,
            }
            args.trace_out.write_text(json.dumps(record) + "\n")
    pd.shutdown()


if __name__ == "__main__":
    main()
