"""Sharded data gives the posterior of all of it: pd.shard + pd.data_plate, on real workers.

The quickstart's pattern is trained at W=1 on the whole data and at W=2 and
W=3 on shards of a data set whose size divides by neither. Every worker
draws the same guide noise (all seeded alike), so the runs differ only in
where the data's terms are summed, and their posteriors must agree. The
natural mistake, a plate sized by the shard, is shown to be wrong (about
sqrt(2) too wide) and to be warned about.
"""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

import pyro_distributed as pd

from ..support.harness import run_workers

N = 301  # divides by neither 2 nor 3
PRIOR_SCALE = 10.0


def observations() -> torch.Tensor:
    return 2.0 + torch.randn(N, generator=torch.Generator().manual_seed(11))


def model(x: torch.Tensor) -> None:
    loc = pyro.sample("loc", dist.Normal(0.0, PRIOR_SCALE))
    with pd.data_plate("data", x):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=x)


def shard_sized_model(x: torch.Tensor) -> None:
    """The trap: a plate as long as this worker's shard."""
    loc = pyro.sample("loc", dist.Normal(0.0, PRIOR_SCALE))
    with pyro.plate("data", len(x)):
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=x)


def guide(x: torch.Tensor) -> None:
    loc = pyro.param("loc_q", torch.tensor(0.0))
    scale = pyro.param("scale_q", torch.tensor(1.0), constraint=constraints.positive)
    pyro.sample("loc", dist.Normal(loc, scale))


def fit(trap: bool = False, steps: int = 500) -> dict[str, float | list[str]]:
    """The quickstart: shard, one optimizer, SVI; the fitted posterior and any warnings."""
    pyro.set_rng_seed(0)  # the same guide noise on every worker and in one process
    x_mine = pd.shard(observations())
    optim = pd.DistributedOptimizer(pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.995}))
    svi = SVI(
        shard_sized_model if trap else model,
        guide,
        optim,
        Trace_ELBO(num_particles=16, vectorize_particles=True, max_plate_nesting=1),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            with pd.shard_subsamples():
                svi.step(x_mine)
    return {
        "loc": pyro.param("loc_q").item(),
        "scale": pyro.param("scale_q").item(),
        "rows": len(x_mine),
        "warnings": [str(w.message) for w in caught],
    }


def exact_posterior() -> tuple[float, float]:
    precision = N + 1 / PRIOR_SCALE**2
    return observations().sum().item() / precision, 1 / math.sqrt(precision)


def test_one_process_recovers_the_conjugate_posterior() -> None:
    (alone,) = run_workers(fit, world_size=1)
    mean, width = exact_posterior()
    assert alone["loc"] == pytest.approx(mean, abs=0.25 * width)
    assert alone["scale"] == pytest.approx(width, rel=0.1)
    assert alone["warnings"] == []


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.slow
def test_sharded_quickstart_gives_the_posterior_of_all_the_data(workers: int) -> None:
    (alone,) = run_workers(fit, world_size=1)
    results = run_workers(fit, world_size=workers)
    assert sorted(r["rows"] for r in results) == sorted(
        len(range(rank, N, workers)) for rank in range(workers)
    ), "every row on exactly one worker, though N does not divide by W"
    for result in results:
        assert result["loc"] == results[0]["loc"] and result["scale"] == results[0]["scale"]
        assert result["loc"] == pytest.approx(alone["loc"], rel=1e-4)
        assert result["scale"] == pytest.approx(alone["scale"], rel=1e-3)
        assert result["warnings"] == []


def test_a_plate_sized_by_the_shard_is_wrong_and_warned_about() -> None:
    results = run_workers(fit, True, world_size=2)
    _, width = exact_posterior()
    for result in results:
        assert result["scale"] == pytest.approx(math.sqrt(2) * width, rel=0.1)
        assert any(
            "plate 'data' has size" in message and "pd.data_plate('data', x_mine)" in message
            for message in result["warnings"]
        ), result["warnings"]


def plate_of(data: torch.Tensor, sliced: bool) -> tuple[int, list[int], float]:
    """Size, subsample and scale of the data plate over ``data`` (or a slice of it)."""
    tensor = data[:] if sliced else data
    with pd.data_plate("data", tensor) as indices:
        trace = pyro.poutine.trace(
            lambda: pyro.sample("obs", dist.Normal(0.0, 1.0), obs=tensor)
        ).get_trace()
    frame = trace.nodes["obs"]["cond_indep_stack"][0]
    return frame.full_size, indices.tolist(), float(trace.nodes["obs"]["scale"])


def plates_over_a_shard(sliced: bool) -> tuple[int, list[int], float]:
    return plate_of(pd.shard(torch.arange(7.0)), sliced)


def test_data_plate_spans_the_data_set_over_the_shards_global_rows() -> None:
    first, second = run_workers(plates_over_a_shard, False)
    # Pyro scales by 7 / len(shard); data_plate corrects it to W = 2, so that
    # the average of the two workers' gradients is the full-data gradient.
    assert first == (7, [0, 2, 4, 6], pytest.approx(2.0))
    assert second == (7, [1, 3, 5], pytest.approx(2.0))
    # A copy or slice of a shard has no record: an ordinary plate of its length.
    assert run_workers(plates_over_a_shard, True)[1] == (3, [0, 1, 2], 1.0)


def test_data_plate_outside_any_shard_is_a_plain_plate() -> None:
    assert plate_of(torch.zeros(5), sliced=False) == (5, [0, 1, 2, 3, 4], 1.0)
    with pytest.raises(TypeError, match="data_plate 'data': data must be a tensor"):
        pd.data_plate("data", [1.0, 2.0])  # type: ignore[arg-type]
