"""pd.Predictive on real workers: one process's shapes and order, nothing lost or repeated.

With a seed, sample chunks are seeded by their position, so the gathered
result must be bitwise the one-process result at any world size. Split by
data, a deterministic site shows that every data point lands in its place.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyro_distributed as pd

from ..support.harness import run_workers, with_engines
from ..support.predictive import SAMPLES, N, by_data, by_samples, data, model, trained_guide


@pytest.mark.parametrize(("engine", "workers"), with_engines([2, 3, 4], on_mpi=[3]))
def test_seeded_samples_are_the_one_process_samples_at_any_world_size(
    engine: str, workers: int
) -> None:
    (alone,) = run_workers(by_samples, 0, "main", world_size=1, engine=engine)
    results = run_workers(by_samples, 0, "main", world_size=workers, engine=engine)
    assert all(result is None for result in results[1:]), "gathered on worker 0 only"
    assert results[0].keys() == alone.keys() == {"slope", "mean", "local", "y"}
    for name, value in alone.items():
        assert value.shape[0] == SAMPLES
        assert torch.equal(results[0][name], value), name


def test_gather_all_and_unseeded_draws_keep_one_process_shapes() -> None:
    (alone,) = run_workers(by_samples, None, "all", world_size=1)
    first, second, third = run_workers(by_samples, None, "all", world_size=3)
    again = run_workers(by_samples, None, "all", world_size=3)
    for name, value in alone.items():
        assert first[name].shape == value.shape, name
        assert torch.equal(first[name], second[name]) and torch.equal(first[name], third[name])
        assert torch.equal(first[name], again[0][name]), "repeatable at a fixed seed and W"
    # Every worker was seeded alike (trained_guide seeds torch last), yet each
    # drew its own samples: seeds are mixed with the rank.
    assert len(set(first["slope"].flatten().tolist())) == SAMPLES


@pytest.mark.parametrize("workers", [2, 3])
def test_split_by_data_joins_the_blocks_in_order(workers: int) -> None:
    (alone,) = run_workers(by_data, 1, world_size=1)
    result, *others = run_workers(by_data, 1, world_size=workers)
    assert others == [None] * (workers - 1)
    assert result.keys() == alone.keys()
    for name, value in alone.items():
        assert result[name].shape == value.shape == (SAMPLES, N), name
    # The deterministic site is slope * x: every point in its place, exactly.
    assert torch.equal(result["mean"], alone["mean"])
    expected = torch.linspace(0.5, 2.0, SAMPLES)[:, None] * data()
    assert torch.equal(result["mean"], expected)
    # Local draws are independent across points, so no two columns repeat.
    assert len({tuple(column.tolist()) for column in result["local"].T}) == N


def split_data_with_guided_global() -> str:
    predictive = pd.Predictive(model, guide=trained_guide(), num_samples=4, split="data")
    with pytest.raises(pd.PyroDistributedError) as error:
        predictive(data())
    return str(error.value)


def test_split_by_data_refuses_global_sites_that_differ_across_workers() -> None:
    pd_messages = run_workers(split_data_with_guided_global, world_size=2)
    for message in pd_messages:
        assert "'slope' should be identical on every worker" in message


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="split must be 'samples' or 'data'"):
        pd.Predictive(model, num_samples=2, split="rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gather must be 'main' or 'all'"):
        pd.Predictive(model, num_samples=2, gather="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        pd.Predictive(model, num_samples=2, chunk_size=0)
    with pytest.raises(ValueError, match="Either posterior_samples or num_samples"):
        pd.Predictive(model)
    with pytest.raises(TypeError, match=r"data\[0\] must be a tensor"):
        pd.Predictive(model, num_samples=2, split="data")(3.0)


@pytest.mark.parametrize("count", [0, -3])
def test_sample_counts_below_one_are_refused_by_name(count: int) -> None:
    # Before any draw: a count of 0 once reached the model as a shape error.
    with pytest.raises(ValueError, match=f"num_samples must be a positive int, got {count}"):
        pd.Predictive(model, guide=trained_guide(), num_samples=count)


@pytest.mark.parametrize("count", [True, 2.0, "4", torch.tensor(3.0)])
def test_sample_counts_that_are_not_integers_are_refused_by_name(count: object) -> None:
    with pytest.raises(TypeError, match="num_samples must be an int or None"):
        pd.Predictive(model, guide=trained_guide(), num_samples=count)  # type: ignore[arg-type]


def test_integer_counts_that_pyro_takes_are_taken() -> None:
    # pyro.infer.Predictive draws with NumPy's integers and integer tensors.
    for count in (np.int64(3), torch.tensor(3)):
        predictive = pd.Predictive(model, guide=trained_guide(), num_samples=count, seed=0)  # type: ignore[arg-type]
        samples = predictive(data())
        assert samples is not None
        assert samples["y"].shape == (3, N)


def test_posterior_samples_without_rows_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="posterior_samples hold no samples"):
        pd.Predictive(model, posterior_samples={"slope": torch.zeros(0)})
    with pytest.raises(ValueError, match=r"posterior_samples\['slope'\] must have a first dim"):
        pd.Predictive(model, posterior_samples={"slope": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"posterior_samples\['slope'\] must be a tensor"):
        pd.Predictive(model, posterior_samples={"slope": 1.0})  # type: ignore[dict-item]


def test_return_sites_that_are_not_a_collection_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="return_sites must be a list, tuple or set"):
        pd.Predictive(model, num_samples=2, return_sites="y")
