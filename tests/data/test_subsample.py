"""shard_subsamples: every worker a disjoint share of each plate's subsample, on real workers."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

from ..support.harness import run_workers

SIZE = 20


def plate_model(data: torch.Tensor) -> None:
    """A local latent per data point, so the AutoGuide enters the plate too."""
    loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
    with pyro.plate("data", SIZE, subsample_size=5) as idx:
        z = pyro.sample("z", dist.Normal(loc, 1.0))
        pyro.sample("obs", dist.Normal(z, 1.0), obs=data[idx])


def indices_seen_by_model_and_guide(steps: int) -> list[tuple[list[int], list[int]]]:
    pd.set_rng_seed(3)
    data = torch.arange(float(SIZE))
    guide = AutoNormal(plate_model)
    seen = []
    for _ in range(steps):
        with pd.shard_subsamples():
            guide_trace = poutine.trace(guide).get_trace(data)
            model_trace = poutine.trace(poutine.replay(plate_model, guide_trace)).get_trace(data)
        seen.append(
            (
                guide_trace.nodes["data"]["value"].tolist(),
                model_trace.nodes["data"]["value"].tolist(),
            )
        )
    return seen


def test_subsamples_are_disjoint_cover_the_shared_permutation_and_change_each_step() -> None:
    worker0, worker1, worker2, worker3 = run_workers(
        indices_seen_by_model_and_guide, 6, world_size=4
    )
    for step in range(6):
        shares = [w[step][0] for w in (worker0, worker1, worker2, worker3)]
        for share, w in zip(shares, (worker0, worker1, worker2, worker3), strict=True):
            assert len(share) == 5
            assert w[step][1] == share, "the model replays the guide's subsample"
        together = sorted(index for share in shares for index in share)
        assert together == list(range(SIZE)), "4 x 5 = 20: the whole permutation"
    assert worker0[0][0] != worker0[1][0], "a fresh permutation each step"


def test_two_workers_draw_disjoint_halves_of_the_same_draw() -> None:
    first, second = run_workers(indices_seen_by_model_and_guide, 3)
    for step in range(3):
        assert not set(first[step][0]) & set(second[step][0])


def nested_and_user_supplied() -> dict[str, list[int]]:
    pd.set_rng_seed(0)

    def model() -> None:
        outer_plate = pyro.plate("outer", 8, subsample_size=2, dim=-1)
        inner_plate = pyro.plate("inner", 6, subsample_size=3, dim=-2)
        with outer_plate as outer, inner_plate as inner:
            pyro.sample("x", dist.Normal(0.0, 1.0))
        with pyro.plate("given", 10, subsample=torch.tensor([7, 8])) as given:
            pass
        seen["outer"], seen["inner"], seen["given"] = outer.tolist(), inner.tolist(), given.tolist()

    seen: dict[str, list[int]] = {}
    with pd.shard_subsamples():
        model()
    return seen


def test_nested_plates_are_sharded_and_a_given_subsample_is_left_alone() -> None:
    first, second = run_workers(nested_and_user_supplied)
    for name in ("outer", "inner"):
        assert not set(first[name]) & set(second[name]), name
    assert first["given"] == second["given"] == [7, 8]


def too_many_workers_for_the_plate() -> str:
    with pytest.raises(ValueError) as info, pd.shard_subsamples(), pyro.plate("small", 5, 3):
        pass
    return str(info.value)


def test_plate_too_small_for_all_workers_is_a_clear_error() -> None:
    message = run_workers(too_many_workers_for_the_plate)[0]
    assert "plate 'small': 2 workers x subsample_size 3 exceeds its size 5" in message


def indices_with_one_messenger(steps: int, by_block: bool) -> tuple[list[list[int]], bool]:
    """The guide's indices at each step, fresh messengers against one re-entered."""
    data = torch.arange(float(SIZE))
    guide = AutoNormal(plate_model)
    seen: dict[str, list[list[int]]] = {}
    reused = pd.shard_subsamples(by_block=by_block)
    for kind in ("fresh", "reused"):
        pd.set_rng_seed(3)
        seen[kind] = []
        for _ in range(steps):
            with reused if kind == "reused" else pd.shard_subsamples(by_block=by_block):
                trace = poutine.trace(guide).get_trace(data)
            seen[kind].append(trace.nodes["data"]["value"].tolist())
    # Nothing drawn at an earlier use is left to scale a later one's sites.
    with reused:
        drawn_before = bool(reused._blocks)
    return seen["reused"], seen["reused"] == seen["fresh"] and not drawn_before


@pytest.mark.parametrize("by_block", [False, True])
def test_one_messenger_re_entered_draws_as_fresh_ones_do(by_block: bool) -> None:
    first, second = run_workers(indices_with_one_messenger, 3, by_block)
    assert first[1] and second[1]
    assert not set(first[0][0]) & set(second[0][0])
