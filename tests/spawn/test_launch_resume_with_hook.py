"""Two launches through LowRankHook end bitwise where one launch of both does.

``train`` fits a regression whose weight is a 20x16 ``pyro.param`` (and a
sampled noise scale, so that the workers' RNG states matter too) on
``pd.shard``'s rows, through ``LowRankHook(rank=2, warmup_steps=2)``: from
step 3 the weight's gradient is sent as two rank-2 factors, with a warm-start
Q and each worker's own error feedback carried from step to step. A launch
that resumes from an earlier one of 4 steps must end where one launch of 8
steps does, bitwise: the launch's checkpoint holds every worker's hook state.

The control resumes from the same launch with the hook's state cleared as the
optimizer is made (after the resume loaded it): its losses leave the straight
run's after the first step, and its parameters differ. So the hook's state is
what makes the resume exact.
"""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch.distributions import constraints

import pyro_distributed as pd

ROWS, IN, OUT, SIGMA = 64, 20, 16, 0.5
STEPS = 4  # per launch; the straight launch makes twice as many
NAMES = ("w", "log_sigma_loc", "log_sigma_scale")


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    pyro.clear_param_store()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, IN, generator=generator)
    w = torch.randn(IN, OUT, generator=generator)
    return x, x @ w + SIGMA * torch.randn(ROWS, OUT, generator=generator)


def model(x: torch.Tensor, y: torch.Tensor) -> None:
    w = pyro.param("w", lambda: torch.zeros(IN, OUT))
    log_sigma = pyro.sample("log_sigma", dist.Normal(0.0, 1.0))
    with pd.data_plate("data", x):
        pyro.sample("y", dist.Normal(x @ w, log_sigma.exp()).to_event(1), obs=y)


def guide(x: torch.Tensor, y: torch.Tensor) -> None:
    loc = pyro.param("log_sigma_loc", lambda: torch.tensor(0.0))
    scale = pyro.param(
        "log_sigma_scale", lambda: torch.tensor(0.1), constraint=constraints.positive
    )
    pyro.sample("log_sigma", dist.Normal(loc, scale))


def train(steps: int, seed: int | None = None, fresh_hook: bool = False) -> dict[str, Any]:
    """``steps`` SVI steps; a fresh launch seeds, a resumed one has its RNG
    states back. ``fresh_hook``: start the hook afresh after a resume loaded it."""
    if seed is not None:
        pd.set_rng_seed(seed)
    x, y = data()
    x_mine, y_mine = pd.shard(x), pd.shard(y)
    hook = pd.LowRankHook(rank=2, warmup_steps=2)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), comm_hook=hook)
    if fresh_hook:
        hook.load_state_dict({})
    svi = SVI(model, guide, optim, Trace_ELBO())
    losses = [svi.step(x_mine, y_mine) for _ in range(steps)]
    return {"losses": losses, "num_steps": optim.num_steps, "hook_state": hook.state_dict()}


def compressed(hook_state: dict[str, Any]) -> list[tuple[list[int], torch.Size, torch.Size]]:
    """Each compressed member's shape, its warm-start Q's and its error's."""
    return [
        (bucket["shapes"][index], q.shape, error.shape)
        for bucket in hook_state.values()
        for index, q, error in zip(bucket["matrices"], bucket["q"], bucket["error"], strict=True)
    ]


def _store() -> dict[str, torch.Tensor]:
    return {name: pyro.param(name).unconstrained().detach().clone() for name in NAMES}


@pytest.mark.slow  # four launches
def test_a_launch_resumed_through_a_low_rank_hook_ends_bitwise() -> None:
    straight = pd.launch(train, 2 * STEPS, 0, workers=2)
    whole = _store()
    pyro.clear_param_store()
    first = pd.launch(train, STEPS, 0, workers=2)
    # The hook compressed w (alone) before the save: 20x16, Q 16x2.
    assert compressed(first.value["hook_state"]) == [([IN, OUT], (OUT, 2), (IN, OUT))]
    second = pd.launch(train, STEPS, workers=2, resume=first)
    assert second.value["num_steps"] == straight.value["num_steps"] == 2 * STEPS
    assert first.value["losses"] == straight.value["losses"][:STEPS]
    assert second.value["losses"] == straight.value["losses"][STEPS:]
    assert whole["w"].shape == (IN, OUT)
    for name, value in _store().items():
        assert torch.equal(value, whole[name]), name

    afresh = pd.launch(train, STEPS, None, True, workers=2, resume=first)
    # The first resumed loss is computed before any exchange: the same.
    assert afresh.value["losses"][0] == straight.value["losses"][STEPS]
    for a, b in zip(afresh.value["losses"][1:], straight.value["losses"][STEPS + 1 :], strict=True):
        assert a != b
    for name in ("w", "log_sigma_loc"):
        assert not torch.equal(pyro.param(name).unconstrained(), whole[name]), name
