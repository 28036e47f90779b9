"""Owned local parameters never travel under a step policy: the sync points
average the global parameters alone, and each worker's block stays its own.

The model of the local-parameters guide (one effect per group, owned by the
worker whose block holds the group) with a global offset, under DiLoCo: a
recording policy counts what each sync point averaged, and what DiLoCo keeps
of the period's start, and an engine that forwards every collective to the
real one counts the bytes each step sent.
"""

from __future__ import annotations

from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
from pyro_distributed.policies import StepContext

from ..support.harness import CountingEngine, run_workers

G, M = 400, 4


class Counting(pd.DiLoCo):
    """DiLoCo that records the names and elements each sync point averaged."""

    def __init__(self) -> None:
        super().__init__(4)
        self.averaged: list[tuple[list[str], int]] = []

    def after_step(self, context: StepContext) -> bool:
        synced = super().after_step(context)
        if synced and not context.averaged:
            shared = context.shared
            self.averaged.append((sorted(shared), sum(t.numel() for t in shared.values())))
        return synced


def train() -> dict[str, Any]:
    pd.set_rng_seed(0)
    pyro.clear_param_store()
    generator = torch.Generator().manual_seed(0)
    effects = torch.randn(G, generator=generator)
    y = 2.0 + effects[:, None] + 0.5 * torch.randn(G, M, generator=generator)

    def model(y: torch.Tensor) -> None:
        offset = pyro.param("offset", torch.tensor(0.0))
        with pyro.plate("groups", G, subsample_size=50) as groups:
            b = pyro.sample("b", dist.Normal(0.0, 1.0))
            with pyro.plate("obs", M):
                pyro.sample("y", dist.Normal(offset + b, 0.5), obs=y[groups].T)

    def guide(y: torch.Tensor) -> None:
        with pyro.plate("groups", G, subsample_size=50):
            b_loc = pyro.param("b_loc", torch.zeros(G), event_dim=0)
            pyro.sample("b", dist.Normal(b_loc, 0.1))

    policy = Counting()
    engine = CountingEngine(pd.current_engine())
    optim = pd.DistributedOptimizer(
        pyro.optim.Adam({"lr": 0.05}), step_policy=policy, engine=engine
    )
    svi = SVI(model, guide, optim, Trace_ELBO())
    sent: dict[int, int] = {}  # bytes by step, after the first
    for step in range(201):  # ends at a sync point
        before = engine.bytes
        with pd.shard_subsamples(own_local_params=True):
            svi.step(y)
        if step:
            sent[engine.bytes - before] = sent.get(engine.bytes - before, 0) + 1
    assert optim.in_sync
    _, rows = pd.local_rows("b_loc")
    return {
        "averaged": policy.averaged,
        "kept": sorted(policy.state_dict()["start"]),
        "rows": len(rows),
        "offset": pyro.param("offset").detach().clone(),
        "sent": sent,
    }


def test_owned_rows_never_travel_under_a_policy_and_the_global_ones_agree() -> None:
    workers = run_workers(train)
    for worker in workers:
        assert len(worker["averaged"]) == 50  # steps 5, 9, ..., 201
        assert all(names == ["offset"] and size == 1 for names, size in worker["averaged"])
        assert worker["kept"] == ["offset"]
        assert worker["rows"] == G // 2  # each worker's block, and only it
        # Nothing on a step alone; at a sync point the header (two int64) and
        # the offset (one float32), whatever the number of groups.
        assert worker["sent"] == {0: 150, 16 + 4: 50}, worker["sent"]
    assert torch.equal(workers[0]["offset"], workers[1]["offset"])
    assert 1.0 < float(workers[0]["offset"]) < 3.0  # it learned (from 0.0 toward 2.0)


def train_many_parameters() -> list[str]:
    """An MLP whose eight parameters SVI hands over as a set: in an order of
    each process's own."""
    pyro.clear_param_store()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    y = x.sum(-1, keepdim=True) + torch.randn(64, 1, generator=generator)

    def model(x: torch.Tensor, y: torch.Tensor) -> None:
        h = x
        for layer in range(4):
            w = pyro.param(f"w{layer}", torch.full((h.shape[-1], 8 if layer < 3 else 1), 0.1))
            b = pyro.param(f"b{layer}", torch.zeros(8 if layer < 3 else 1))
            h = h @ w + b
            h = torch.tanh(h) if layer < 3 else h
        with pd.data_plate("data", x):
            pyro.sample("y", dist.Normal(h, 1.0).to_event(1), obs=y)

    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}), step_policy=pd.DiLoCo(2))
    svi = SVI(model, lambda x, y: None, optim, Trace_ELBO())
    for _ in range(5):
        svi.step(pd.shard(x), pd.shard(y))
    assert optim.in_sync
    return [name for name, _ in sorted(pyro.get_param_store().items())]


def test_workers_that_list_their_parameters_in_other_orders_average_them_by_name() -> None:
    names = run_workers(train_many_parameters)
    assert names[0] == names[1] and len(names[0]) == 8
