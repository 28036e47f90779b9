"""Step policies: workers step alone between sync points and are bitwise
identical at each, on the Pyro path and torch-native, at W=2 and W=3.

Each run trains a linear regression for 12 steps on each worker's shard and
records, after every step, whether the optimizer says it is in sync and a
digest of every worker's shared parameters. A recording policy wraps the
real one and keeps what the parameters were just before each sync point, so
that the average (and DiLoCo's outer step) can be recomputed here.
"""

from __future__ import annotations

from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd
from pyro_distributed.policies import StepContext

from ..support.harness import HorovodSuites, one_pytest_worker, run_workers
from ..support.policies import data, guide, make_policy, model

STEPS = 12


class Recording(pd.StepPolicy):
    """Runs ``inner``, keeping the shared parameters before each of its steps."""

    def __init__(self, inner: pd.StepPolicy) -> None:
        self.inner = inner
        self.steps_alone = inner.steps_alone
        self.before: dict[int, dict[str, torch.Tensor]] = {}

    def averages_gradients(self, step: int) -> bool:
        return self.inner.averages_gradients(step)

    def after_step(self, context: StepContext) -> bool:
        self.before[context.step] = {n: t.detach().clone() for n, t in context.shared.items()}
        return self.inner.after_step(context)


def train_pyro(policy_name: str, check_every: int | None = None) -> dict[str, Any]:
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    policy = Recording(make_policy(policy_name))
    optim = pd.DistributedOptimizer(
        pyro.optim.Adam({"lr": 0.05}), step_policy=policy, check_every=check_every
    )
    checked_at: list[int] = []  # the step counts at which the drift check ran
    check = optim.check_in_sync

    def counted_check() -> None:
        checked_at.append(optim.num_steps)
        check()

    optim.check_in_sync = counted_check
    svi = SVI(model, guide, optim, Trace_ELBO())
    x, y = data()
    in_sync, params = [], []
    for _ in range(STEPS):
        svi.step(x, y)
        in_sync.append(optim.in_sync)
        store = pyro.get_param_store()
        params.append({name: store[name].detach().clone() for name in ("weight", "bias")})
    return {"in_sync": in_sync, "params": params, "before": policy.before, "checked": checked_at}


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def train_torch(policy_name: str) -> dict[str, Any]:
    torch.manual_seed(pd.rank())  # worker 0's values reach every worker at the first step
    module = Regression()
    policy = Recording(make_policy(policy_name))
    optimizer = pd.DistributedTorchOptimizer(
        torch.optim.Adam(module.parameters(), lr=0.05), step_policy=policy
    )
    x, y = data()
    in_sync, params = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
        in_sync.append(optimizer.in_sync)
        params.append({n: p.detach().clone() for n, p in module.named_parameters()})
    # The torch front end names its tensors by place in the optimizer's groups.
    names = [name for name, _ in module.named_parameters()]
    before = {
        step: dict(zip(names, shared.values(), strict=True))
        for step, shared in policy.before.items()
    }
    return {"in_sync": in_sync, "params": params, "before": before}


def expected_sync_steps(policy_name: str) -> list[int]:
    """The steps after which every worker holds the same parameters."""
    return {
        "local_sgd": [0, 4, 8],
        "local_sgd_warmup": [0, 1, 4, 7, 10],
        "diloco": [0, 4, 8],
    }[policy_name]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("front_end", ["pyro", "torch"])
@pytest.mark.parametrize("policy_name", ["local_sgd", "local_sgd_warmup", "diloco"])
def test_workers_are_bitwise_identical_at_sync_points_and_differ_between(
    policy_name: str, front_end: str, world_size: int
) -> None:
    train = train_pyro if front_end == "pyro" else train_torch
    check_sync_points(run_workers(train, policy_name, world_size=world_size), policy_name)


@pytest.mark.mpi
@pytest.mark.parametrize("world_size", [2, 3])
def test_sync_points_on_mpi(world_size: int) -> None:
    for policy_name in ("local_sgd_warmup", "diloco"):
        workers = run_workers(train_pyro, policy_name, world_size=world_size, engine="mpi")
        check_sync_points(workers, policy_name)


HOROVOD = HorovodSuites(
    {"main": [(name, train_pyro, (name,)) for name in ("local_sgd_warmup", "diloco")]}
)


@pytest.mark.horovod
@one_pytest_worker(__name__)
@pytest.mark.parametrize("policy_name", ["local_sgd_warmup", "diloco"])
def test_sync_points_on_horovod(policy_name: str) -> None:
    check_sync_points(HOROVOD.outcome(policy_name), policy_name)


def check_sync_points(workers: list[dict[str, Any]], policy_name: str) -> None:
    """Identical exactly at the policy's sync points, and what the averages
    (and DiLoCo's outer steps) should have made of each worker's parameters."""
    synced = expected_sync_steps(policy_name)
    for worker in workers:
        assert [i for i, flag in enumerate(worker["in_sync"]) if flag] == synced
    for step in range(STEPS):
        same = all(
            all(torch.equal(worker["params"][step][n], workers[0]["params"][step][n])
                for n in workers[0]["params"][step])
            for worker in workers[1:]
        )  # fmt: skip
        assert same == (step in synced), step
    # The averages themselves, recomputed from what each worker held before them.
    for step in synced:
        if (policy_name == "local_sgd_warmup" and step < 2) or step == 0:
            continue  # averaged gradients, not parameters
        for name in workers[0]["params"][step]:
            before = torch.stack([worker["before"][step][name] for worker in workers])
            after = workers[0]["params"][step][name]
            if policy_name == "diloco":
                # The period's start, every worker's after the last sync point.
                start = workers[0]["params"][step - 4][name]
                move = (start - before).mean(0)
                velocity = move if step == 4 else None
                if velocity is None:  # the second outer step: recompute the first's
                    first_start = workers[0]["params"][0][name]
                    first_move = (first_start - torch.stack(
                        [worker["before"][4][name] for worker in workers]
                    )).mean(0)  # fmt: skip
                    velocity = 0.9 * first_move + move
                expected = start - 0.7 * (move + 0.9 * velocity)
            else:
                expected = before.mean(0)
            torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-6)


def test_the_drift_check_runs_at_sync_points_alone() -> None:
    """``check_every=1``: checked after every step, the workers' differing
    parameters between sync points would fail it."""
    workers = run_workers(train_pyro, "local_sgd", 1)
    for worker in workers:
        # After steps 1, 5 and 9 (sync points: indices 0, 4, 8), and only there.
        assert worker["checked"] == [1, 5, 9], worker["checked"]


def test_one_worker_runs_every_policy_unchanged_from_its_script() -> None:
    """At W=1 local SGD is plain training, and DiLoCo with an outer step of
    one and no momentum moves the parameters where the inner steps took them."""
    pd.init("local")
    plain = train_pyro("local_sgd")
    pd.shutdown()
    pd.init("local")
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(model, guide, optim, Trace_ELBO())
    x, y = data()
    for _ in range(STEPS):
        svi.step(x, y)
    for name in ("weight", "bias"):
        assert torch.equal(plain["params"][-1][name], pyro.param(name).detach())
    pd.shutdown()
    pd.init("local")
    outer = train_pyro("diloco_plain")  # start - (start - now): now, up to rounding
    for name in ("weight", "bias"):
        torch.testing.assert_close(outer["params"][-1][name], plain["params"][-1][name])
    pd.shutdown()
