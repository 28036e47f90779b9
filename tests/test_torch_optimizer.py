"""DistributedOptimizer over a torch optimizer (Pyro's torch-native loop), on real workers."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule

import pyro_distributed as pd
from pyro_distributed.optim.torch_optimizer import DistributedTorchOptimizer

from .harness import run_workers


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 3, generator=generator)
    return x, x.sum(-1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=generator)


def _loss(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((net(x) - y) ** 2).mean()


def train_net(steps: int, overlap: bool, scheduler: bool) -> dict[str, torch.Tensor]:
    """Every worker starts from its own random init and trains on its own batches."""
    net = _net(seed=pd.rank())
    optimizer = pd.DistributedOptimizer(
        torch.optim.Adam(net.parameters(), lr=0.05), overlap=overlap
    )
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(net, _batch(pd.rank(), step)).backward()
        optimizer.step()
        if scheduler:
            schedule.step()
    return {name: p.detach().clone() for name, p in net.named_parameters()} | {
        "lr": torch.tensor(optimizer.param_groups[0]["lr"])
    }


def reference_net(steps: int, world_size: int, scheduler: bool) -> dict[str, torch.Tensor]:
    """One process that averages the workers' gradients itself, as the wire does:
    the sum over workers, then times 1/W."""
    net = _net(seed=0)  # worker 0's init, which the first step broadcasts
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in net.parameters()]
        for rank in range(world_size):
            net.zero_grad()
            _loss(net, _batch(rank, step)).backward()
            for acc, p in zip(total, net.parameters(), strict=True):
                acc.add_(p.grad)  # type: ignore[arg-type]
        for acc, p in zip(total, net.parameters(), strict=True):
            p.grad = acc.mul_(1.0 / world_size)
        optimizer.step()
        if scheduler:
            schedule.step()
    return {name: p.detach().clone() for name, p in net.named_parameters()} | {
        "lr": torch.tensor(optimizer.param_groups[0]["lr"])
    }


@pytest.mark.parametrize("overlap", [True, False])
def test_averaged_steps_are_bitwise_one_process_averaging_the_same_gradients(
    overlap: bool,
) -> None:
    results = run_workers(train_net, 6, overlap, True)
    expected = reference_net(6, 2, scheduler=True)
    for result in results:
        assert result.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result[name], value), name
    assert float(results[0]["lr"]) == 0.05 * 0.5**3  # the scheduler drove the wrapped optimizer


def test_one_worker_steps_exactly_as_the_plain_optimizer() -> None:
    pd.init("local")
    try:
        ours, plain = _net(0), _net(0)
        wrapped = pd.DistributedOptimizer(torch.optim.Adam(ours.parameters(), lr=0.1))
        reference = torch.optim.Adam(plain.parameters(), lr=0.1)
        assert isinstance(wrapped, torch.optim.Optimizer)
        assert isinstance(wrapped, DistributedTorchOptimizer)
        assert wrapped.sync is None
        for step in range(3):
            for net, optimizer in ((ours, wrapped), (plain, reference)):
                optimizer.zero_grad()
                _loss(net, _batch(0, step)).backward()
                optimizer.step()
        for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a, b)
        assert wrapped.state_dict()["state"].keys() == reference.state_dict()["state"].keys()
    finally:
        pd.shutdown()


def state_round_trip() -> dict[str, object]:
    net = _net(seed=pd.rank())
    optimizer = pd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    for step in range(2):
        optimizer.zero_grad()
        _loss(net, _batch(pd.rank(), step)).backward()
        optimizer.step()
    saved = optimizer.state_dict()
    fresh = pd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    fresh.load_state_dict(saved)
    extra = torch.nn.Parameter(torch.full((2,), float(pd.rank())))
    fresh.add_param_group({"params": [extra], "lr": 0.5})
    fresh.zero_grad()
    (_loss(net, _batch(pd.rank(), 5)) + (extra * (pd.rank() + 1)).sum()).backward()
    fresh.step()
    momentum = fresh.state[next(net.parameters())]["momentum_buffer"]
    return {"extra": extra.detach().clone(), "momentum": momentum.clone(), "groups": len(fresh.param_groups)}


def test_state_dict_load_state_dict_and_add_param_group_act_on_the_wrapped_optimizer() -> None:
    results = run_workers(state_round_trip)
    assert [r["groups"] for r in results] == [2, 2]
    # The new parameter took worker 0's value (0.0), then one step of the
    # averaged gradient (1 + 2) / 2 at lr 0.5.
    for result in results:
        assert torch.equal(result["extra"], torch.full((2,), -0.75))
    assert torch.equal(results[0]["momentum"], results[1]["momentum"])


def disagreeing() -> str:
    shape = 3 if pd.rank() == 0 else 4
    weight = torch.nn.Parameter(torch.zeros(shape))
    optimizer = pd.DistributedOptimizer(torch.optim.SGD([weight], lr=0.1))
    weight.sum().backward()
    with pytest.raises(pd.PyroDistributedError) as info:
        optimizer.step()
    return str(info.value)


def test_workers_with_different_optimizers_get_an_error_naming_the_parameter() -> None:
    messages = run_workers(disagreeing)
    assert messages[0] == messages[1]
    assert "'param_groups[0][0]' differs in shape or dtype" in messages[0]
    assert "worker 0: shape [3]" in messages[0] and "worker 1: shape [4]" in messages[0]


def clipped(synchronize: bool) -> dict[str, object]:
    net = _net(seed=0)
    optimizer = pd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    norms = []
    with pytest.warns() if not synchronize else _no_warning() as record:
        for step in range(3):
            optimizer.zero_grad()
            (_loss(net, _batch(pd.rank(), step)) * (1 + 10 * pd.rank())).backward()
            if synchronize:
                optimizer.synchronize()
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)))
            optimizer.step()
    warned = [str(w.message) for w in record] if record is not None else []
    return {"norms": norms, "warned": warned, "params": [p.detach().clone() for p in net.parameters()]}


class _no_warning:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_synchronize_lets_clipping_see_the_averaged_gradient() -> None:
    results = run_workers(clipped, True)
    # Clipping measured the same (averaged) norm on every worker.
    assert results[0]["norms"] == results[1]["norms"]
    assert results[0]["warned"] == [] and results[1]["warned"] == []
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):  # type: ignore[call-overload]
        assert torch.equal(a, b)


def test_clipping_without_synchronize_warns_that_it_saw_one_workers_gradient() -> None:
    results = run_workers(clipped, False)
    assert results[0]["norms"] != results[1]["norms"], "each worker clipped its own gradient"
    for result in results:
        assert len(result["warned"]) == 1  # type: ignore[arg-type]
        assert "call optimizer.synchronize() before clipping" in result["warned"][0]  # type: ignore[index]


def nan_on_worker_one() -> dict[str, object]:
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = pd.DistributedOptimizer(torch.optim.SGD([weight], lr=0.1))
    scale = float("nan") if pd.rank() == 1 else 1.0
    (weight.sum() * scale).backward()
    with pytest.warns(RuntimeWarning, match="every worker skips this step") as record:
        optimizer.step()
    return {"weight": weight.detach().clone(), "message": str(record[0].message)}


def test_a_nan_on_one_worker_makes_every_worker_skip_the_step() -> None:
    results = run_workers(nan_on_worker_one)
    for result in results:
        assert torch.equal(result["weight"], torch.ones(2))
        assert "'param_groups[0][0]'" in result["message"]


def accumulated(passes: int) -> torch.Tensor:
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = pd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0))
    for step in range(3):
        optimizer.zero_grad()
        for k in range(passes):
            (weight * torch.tensor([1.0, 2.0, 3.0]) * (pd.rank() + 1 + k)).sum().backward()
        optimizer.step()
    return weight.detach().clone()


def test_several_backward_passes_per_step_are_all_averaged() -> None:
    results = run_workers(accumulated, 3)
    # Per step, worker r accumulates (r+1)+(r+2)+(r+3); averaged over r = 0, 1: 7.5.
    expected = -3 * 7.5 * torch.tensor([1.0, 2.0, 3.0])
    for result in results:
        assert torch.equal(result, expected)


# -- Pyro's torch-native loop: an ELBO module, PyroModules, a lazily built guide


class Regression(PyroModule):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 10.0).to_event(1))
        with pd.data_plate("data", x):
            return pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)


def elbo_module(steps: int) -> dict[str, torch.Tensor]:
    pyro.settings.set(module_local_params=True)
    try:
        pd.set_rng_seed(0)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(400, 2, generator=generator)
        y = x @ torch.tensor([1.5, -2.0]) + 0.5 * torch.randn(400, generator=generator)
        x_mine, y_mine = pd.shard(x), pd.shard(y)
        model = Regression(len(x))
        guide = AutoNormal(model)
        loss_fn = Trace_ELBO(num_particles=8, vectorize_particles=True)(model, guide)
        loss_fn(x_mine, y_mine)  # creates the guide's parameters
        optimizer = pd.DistributedOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.05))
        for _ in range(steps):
            optimizer.zero_grad()
            loss_fn(x_mine, y_mine).backward()
            optimizer.step()
        return {name: p.detach().clone() for name, p in loss_fn.named_parameters()}
    finally:
        pyro.settings.set(module_local_params=False)


def test_an_elbo_module_trains_in_sync_to_the_one_process_posterior() -> None:
    one = run_workers(elbo_module, 300, world_size=1)[0]
    two = run_workers(elbo_module, 300)
    assert one.keys() == two[0].keys() and any("loc" in name for name in one)
    for name in one:
        assert torch.equal(two[0][name], two[1][name]), f"{name} differs between workers"
    loc = next(name for name in one if "locs" in name)
    scale = next(name for name in one if "scales" in name)
    assert torch.allclose(two[0][loc], one[loc], atol=0.02), (two[0][loc], one[loc])
    # Posterior widths: those of all 400 rows on both (log scale within 0.15).
    assert torch.allclose(two[0][scale], one[scale], atol=0.15), (two[0][scale], one[scale])
