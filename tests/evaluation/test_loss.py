"""evaluate_loss on real workers: every row once, the one-process value, on every worker.

The models here have no randomness left at evaluation time (parameters
only, or a delta guide), so the distributed loss must equal the loss one
process computes on all the data, up to the order of summation.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta

import pyro_distributed as pd

from ..support.harness import run_workers, with_engines
from ..support.loss import N, batch_plate_model, data, empty_guide, losses


def global_latent_in_batch_plate(x: torch.Tensor, y: torch.Tensor) -> None:
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_the_loss_is_the_one_process_loss_on_every_worker(workers: int, batch_size: int) -> None:
    results = run_workers(losses, batch_size, world_size=workers)
    for result in results:
        for kind in ("global", "batch"):
            assert result[kind] == results[0][kind], "bitwise the same on every worker"
            assert result[kind] == pytest.approx(result[f"{kind}_reference"], rel=1e-6)


def rows_seen(batch_size: int) -> list[int]:
    seen: list[int] = []

    def recording_model(x: torch.Tensor) -> None:
        with pd.data_plate("data", x) as indices:
            seen.extend(indices.tolist())
            pyro.sample("x", dist.Normal(0.0, 1.0), obs=x)

    pd.evaluate_loss(
        Trace_ELBO(), recording_model, lambda x: None, torch.zeros(N), batch_size=batch_size
    )
    return seen


@pytest.mark.parametrize(("engine", "workers"), with_engines([2, 3], on_mpi=[3]))
def test_every_row_is_evaluated_exactly_once(engine: str, workers: int) -> None:
    seen = run_workers(rows_seen, 2, world_size=workers, engine=engine)
    everything = sorted(index for rows in seen for index in rows)
    assert everything == list(range(N))
    assert max(map(len, seen)) - min(map(len, seen)) <= 1, "blocks differ by at most one row"


def refused(rows: int) -> str:
    x, y = data()
    guide = AutoDelta(global_latent_in_batch_plate)
    with pytest.raises(ValueError) as error:
        pd.evaluate_loss(Trace_ELBO(), global_latent_in_batch_plate, guide, (x[:rows], y[:rows]))
    return str(error.value)


def test_a_global_latent_outside_a_batch_sized_plate_is_refused_on_every_worker() -> None:
    for message in run_workers(refused, N, world_size=2):
        assert "['w'] lie outside the plate over the data" in message
        assert "pd.data_plate" in message
    # Two rows on three workers: worker 0 evaluates nothing, and still raises.
    idle, *busy = run_workers(refused, 2, world_size=3)
    assert "another worker refused the model's plates" in idle
    assert all("['w'] lie outside" in message for message in busy)


def test_bad_arguments_are_named() -> None:
    x, y = data()
    with pytest.raises(TypeError, match="loss must be an ELBO"):
        pd.evaluate_loss(None, batch_plate_model, empty_guide, (x, y))
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        pd.evaluate_loss(Trace_ELBO(), batch_plate_model, empty_guide, (x, y), batch_size=0)
    with pytest.raises(ValueError, match=r"different lengths \[11, 10\]"):
        pd.evaluate_loss(Trace_ELBO(), batch_plate_model, empty_guide, (x, y[:10]))
    with pytest.raises(TypeError, match="data must be a tensor, a tuple of tensors"):
        pd.evaluate_loss(Trace_ELBO(), batch_plate_model, empty_guide, {"x": x})


def test_a_plate_sized_for_other_data_is_refused() -> None:
    x, y = data()

    def trained_size_model(x: torch.Tensor, y: torch.Tensor) -> None:
        with pyro.plate("data", 1000, subsample=torch.arange(len(x))):
            pyro.sample("y", dist.Normal(x.sum(-1), 1.0), obs=y)

    with pytest.raises(ValueError, match="plate 'data' has size 1000, but the data passed"):
        pd.evaluate_loss(Trace_ELBO(), trained_size_model, empty_guide, (x, y), batch_size=4)
