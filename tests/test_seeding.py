"""set_rng_seed: per-worker streams from one seed, and the draws every worker shares."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.seeding import block_generator, derived_seed, worker_seed

from .support.harness import run_workers


def seeded_draws(seed: int) -> dict[str, list[float]]:
    pd.set_rng_seed(seed)
    return {
        "own": torch.rand(3).tolist(),
        "shared": torch.rand(3, generator=pd.seeding.shared_generator()).tolist(),
    }


def test_set_rng_seed_differs_per_worker_shares_shared_draws_and_repeats() -> None:
    first_run = run_workers(seeded_draws, 11)
    second_run = run_workers(seeded_draws, 11)
    assert first_run == second_run, "reproducible for a fixed seed and world size"
    assert first_run[0]["own"] != first_run[1]["own"]
    assert first_run[0]["shared"] == first_run[1]["shared"]
    assert run_workers(seeded_draws, 12)[0]["own"] != first_run[0]["own"]


def test_set_rng_seed_rejects_bad_seeds() -> None:
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        pd.set_rng_seed(-1)


def draws_after_seeding(seed: int) -> dict[str, object]:
    pd.set_rng_seed(seed)
    return {
        "torch": torch.rand(2).tolist(),
        "numpy": np.random.rand(2).tolist(),
        "random": [random.random(), random.random()],
        "block": torch.rand(2, generator=block_generator()).tolist(),
    }


def test_each_worker_seeds_torch_numpy_and_random_with_its_worker_seed() -> None:
    results = run_workers(draws_after_seeding, 5, world_size=3)
    for rank, drawn in enumerate(results):
        expected = worker_seed(5, rank)
        assert (
            drawn["torch"]
            == torch.rand(2, generator=torch.Generator().manual_seed(expected)).tolist()
        )
        assert drawn["numpy"] == np.random.RandomState(expected).rand(2).tolist()
        reference = random.Random(expected)
        assert drawn["random"] == [reference.random(), reference.random()]
    blocks = [drawn["block"] for drawn in results]
    assert len({tuple(block) for block in blocks}) == 3, "block draws differ per worker"
    assert run_workers(draws_after_seeding, 5, world_size=3) == results, "and repeat"


def test_derived_seeds_are_32_bit_stable_and_differ_by_path() -> None:
    seeds = {derived_seed(7, *path) for path in [(), (1,), (2,), (0, 1), (1, 2), (2, 1)]}
    assert len(seeds) == 6
    assert all(0 <= s < 2**32 for s in seeds)
    assert derived_seed(7, 3) == derived_seed(7, 3) == worker_seed(7, 3)
    assert derived_seed(7, 3) != derived_seed(8, 3)


def test_paths_that_differ_by_trailing_zeros_are_different_streams() -> None:
    # ShardSampler's stream for rank 0 in epoch e is derived_seed(s, e, 0);
    # it must not be worker e's seed, derived_seed(s, e).
    assert derived_seed(7, 3, 0) != derived_seed(7, 3)
    assert derived_seed(7, 0) != derived_seed(7)


@pytest.mark.parametrize("bad", [True, 1.5, "3"])
def test_set_rng_seed_rejects_seeds_that_are_not_ints(bad: object) -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        pd.set_rng_seed(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2**64, 2**70])
def test_set_rng_seed_rejects_seeds_past_64_bits_by_name(bad: int) -> None:
    # The shared generator takes the seed itself, and torch's take 64 bits.
    with pytest.raises(ValueError, match=r"seed must be an int with 0 <= seed < 2\*\*64"):
        pd.set_rng_seed(bad)


def test_the_largest_seed_seeds_every_generator() -> None:
    pd.set_rng_seed(2**64 - 1)
    assert pd.seeding.shared_generator().initial_seed() == 2**64 - 1
    assert torch.initial_seed() == worker_seed(2**64 - 1, 0)
