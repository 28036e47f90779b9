"""DistributedOptimizer over a torch optimizer (Pyro's torch-native loop), on real workers."""

from __future__ import annotations

import math
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule

import pyro_distributed as pd
from pyro_distributed.optim.torch_optimizer import DistributedTorchOptimizer

from ..support.harness import WorkerFailure, one_pytest_worker, run_under_launcher, run_workers
from ..support.torch_models import D_LOCAL, N_LOCAL, LocalModel, local_plates, small_net


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 3, generator=generator)
    return x, x.sum(-1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=generator)


def _loss(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((net(x) - y) ** 2).mean()


def train_net(steps: int, overlap: bool, scheduler: bool) -> dict[str, torch.Tensor]:
    """Every worker trains on its own batches."""
    net = small_net(seed=0)
    optimizer = pd.DistributedTorchOptimizer(
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
    net = small_net(seed=0)
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
    assert float(results[0]["lr"]) == pytest.approx(0.05 * 0.5**3)  # the scheduler stepped it


def first_step(lr: float) -> list[torch.Tensor]:
    net = small_net(seed=pd.rank())  # every worker starts elsewhere
    optimizer = pd.DistributedTorchOptimizer(torch.optim.SGD(net.parameters(), lr=lr))
    _loss(net, _batch(pd.rank(), 0)).backward()
    optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def test_the_first_step_gives_every_worker_worker_zeros_values() -> None:
    results = run_workers(first_step, 0.0)
    for mine, worker_zeros in zip(results[1], small_net(seed=0).parameters(), strict=True):
        assert torch.equal(mine, worker_zeros.detach())
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_one_worker_steps_exactly_as_the_plain_optimizer() -> None:
    pd.init("local")
    try:
        ours, plain = small_net(0), small_net(0)
        wrapped = pd.DistributedTorchOptimizer(torch.optim.Adam(ours.parameters(), lr=0.1))
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
    net = small_net(seed=pd.rank())
    optimizer = pd.DistributedTorchOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    )
    for step in range(2):
        optimizer.zero_grad()
        _loss(net, _batch(pd.rank(), step)).backward()
        optimizer.step()
    saved = optimizer.state_dict()
    fresh = pd.DistributedTorchOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    fresh.load_state_dict(saved)
    extra = torch.nn.Parameter(torch.full((2,), float(pd.rank())))
    fresh.add_param_group({"params": [extra], "lr": 0.5})
    fresh.zero_grad()
    (_loss(net, _batch(pd.rank(), 5)) + (extra * (pd.rank() + 1)).sum()).backward()
    fresh.step()
    momentum = fresh.state[next(net.parameters())]["momentum_buffer"]
    return {
        "extra": extra.detach().clone(),
        "momentum": momentum.clone(),
        "groups": len(fresh.param_groups),
    }


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
    optimizer = pd.DistributedTorchOptimizer(torch.optim.SGD([weight], lr=0.1))
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
    net = small_net(seed=0)
    optimizer = pd.DistributedTorchOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
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
    return {
        "norms": norms,
        "warned": warned,
        "params": [p.detach().clone() for p in net.parameters()],
    }


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
    optimizer = pd.DistributedTorchOptimizer(torch.optim.SGD([weight], lr=0.1))
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
    optimizer = pd.DistributedTorchOptimizer(torch.optim.SGD([weight], lr=1.0))
    for _ in range(3):
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
            return pyro.sample("y", dist.Normal((x * w).sum(-1), 0.5), obs=y)


def regression_rows() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 2, generator=generator)
    y = x @ torch.tensor([1.5, -2.0]) + 0.5 * torch.randn(400, generator=generator)
    return x, y


def elbo_module(steps: int) -> dict[str, Any]:
    pyro.settings.set(module_local_params=True)
    try:
        pd.set_rng_seed(0)
        x, y = regression_rows()
        x_mine, y_mine = pd.shard(x), pd.shard(y)
        model = Regression(len(x))
        guide = AutoNormal(model)
        loss_fn = Trace_ELBO(num_particles=8, vectorize_particles=True)(model, guide)
        loss_fn(x_mine, y_mine)  # creates the guide's parameters
        optimizer = pd.DistributedTorchOptimizer(
            torch.optim.Adam(loss_fn.parameters(), lr=0.05), noise_scale=pd.world_size() > 1
        )
        for _ in range(steps):
            optimizer.zero_grad()
            loss_fn(x_mine, y_mine).backward()
            optimizer.step()
        # Evaluation and prediction on held-out rows, split across the workers.
        generator = torch.Generator().manual_seed(1)
        x_test = torch.randn(301, 2, generator=generator)
        y_test = x_test @ torch.tensor([1.5, -2.0]) + 0.5 * torch.randn(301, generator=generator)
        elbo = Trace_ELBO(num_particles=64, vectorize_particles=True)
        held_out = pd.evaluate_loss(elbo, model, guide, (x_test, y_test), batch_size=64)
        samples = pd.Predictive(model, guide=guide, num_samples=400, seed=0)(x_test)
        return {
            "params": {name: p.detach().clone() for name, p in loss_fn.named_parameters()},
            "held_out": held_out,
            "predicted": None if samples is None else samples["y"].mean(0),
            "noise": optimizer.noise_scale(len(x_mine)) if pd.world_size() > 1 else None,
        }
    finally:
        pyro.settings.set(module_local_params=False)


SHARES_ELBO_RUNS = one_pytest_worker(f"{__name__}.elbo_runs")


@pytest.fixture(scope="module")
def elbo_runs() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """:func:`elbo_module`'s 800 steps on one worker, and on two (read by two tests)."""
    return run_workers(elbo_module, 800, world_size=1)[0], run_workers(elbo_module, 800)


@pytest.mark.slow
@SHARES_ELBO_RUNS
def test_an_elbo_module_trains_in_sync_to_the_posterior_of_all_the_data(
    elbo_runs: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    x, y = regression_rows()
    # The exact posterior of w: Normal(0, 10^2) prior, known noise 0.5.
    precision = x.T @ x / 0.25 + torch.eye(2) / 100.0
    covariance = torch.linalg.inv(precision)
    mean = covariance @ x.T @ y / 0.25
    log_sd = covariance.diagonal().sqrt().log()
    one, two = elbo_runs
    params = one["params"]
    assert params.keys() == two[0]["params"].keys()
    for name in params:
        assert torch.equal(two[0]["params"][name], two[1]["params"][name]), name
    loc = next(name for name in params if "locs" in name)
    scale = next(name for name in params if "scales" in name)
    for result in (one, two[0]):
        assert torch.allclose(result["params"][loc], mean, atol=0.01), result["params"]
        # AutoNormal's scales are stored unconstrained: log sd.
        assert torch.allclose(result["params"][scale], log_sd, atol=0.1), result["params"]


@pytest.mark.slow
@SHARES_ELBO_RUNS
def test_evaluation_prediction_and_noise_scale_work_on_the_torch_native_path(
    elbo_runs: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    one, two = elbo_runs
    # The held-out loss is a global figure, the same on every worker, and the
    # same model fitted on one worker or two gives about the same one.
    assert two[0]["held_out"] == two[1]["held_out"]
    assert abs(two[0]["held_out"] / one["held_out"] - 1) < 0.01, (one, two)
    assert two[1]["predicted"] is None, "Predictive gathers on worker 0"
    assert two[0]["predicted"].shape == (301,)
    assert torch.allclose(two[0]["predicted"], one["predicted"], atol=0.05)
    noise = two[0]["noise"]
    assert noise is not None and noise.steps == 800
    # Converged, |G|^2 is buried in noise (it may be negative); tr(Sigma) is not.
    assert math.isfinite(noise.gradient_sq) and noise.trace_sigma > 0
    assert noise == two[1]["noise"], "every worker holds the same figures"


# -- local parameters owned by their worker, on the torch-native path


def train_local(own: bool, optimizer_name: str, steps: int) -> dict[str, object]:
    pyro.settings.set(module_local_params=True)
    try:
        pd.set_rng_seed(0)
        x = torch.randn(N_LOCAL, D_LOCAL, generator=torch.Generator().manual_seed(2)) + 1.0
        model = LocalModel()
        guide = AutoNormal(model, create_plates=local_plates)
        loss_fn = Trace_ELBO()(model, guide)
        with pd.shard_subsamples(own_local_params=own, by_block=True):
            loss_fn(x)  # creates the parameters; under ownership, cuts them to the block
        make = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer_name]
        optimizer = pd.DistributedOptimizer(
            make(loss_fn.parameters(), lr=0.05), bucket_cap_mb=1e-9, overlap=False
        )
        for _ in range(steps):
            optimizer.zero_grad()
            with pd.shard_subsamples(own_local_params=own, by_block=True):
                loss_fn(x).backward()
            optimizer.step()
        values = {name: p.detach().clone() for name, p in loss_fn.named_parameters()}
        local = {
            name: pd.local_rows(name, module=loss_fn)
            for name in values
            if name.endswith("z_unconstrained")
        }
        gathered = {
            "by_pyro_name": pd.gather_param("AutoNormal.locs.z", to="all") if own else None,
            "by_module_name": pd.gather_param(
                "guide.scales.z_unconstrained", to="all", module=loss_fn
            ),
        }
        return {"values": values, "local": local, "gathered": gathered}
    finally:
        pyro.settings.set(module_local_params=False)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("optimizer_name", ["adam", "adamw"])
@pytest.mark.slow
def test_owned_module_parameters_change_where_rows_live_not_the_numbers(
    workers: int, optimizer_name: str
) -> None:
    replicated = run_workers(train_local, False, optimizer_name, 10, world_size=workers)
    owned = run_workers(train_local, True, optimizer_name, 10, world_size=workers)
    local_names = {"guide.locs.z_unconstrained", "guide.scales.z_unconstrained"}
    for rank, (mine, reference) in enumerate(zip(owned, replicated, strict=True)):
        assert set(mine["local"]) == local_names  # type: ignore[arg-type]
        block = list(range(rank * N_LOCAL // workers, (rank + 1) * N_LOCAL // workers))
        for name, value in reference["values"].items():  # type: ignore[attr-defined]
            if name in local_names:
                indices, rows = mine["local"][name]  # type: ignore[index]
                assert indices.tolist() == block
                assert rows.shape[0] == len(block)
                assert torch.equal(rows, value[block]), f"{name} rows differ on worker {rank}"
            else:
                assert torch.equal(mine["values"][name], value), name  # type: ignore[index]
        # Gathered from the owners, the N rows are the replicated run's.
        full = reference["values"]  # type: ignore[index]
        gathered = mine["gathered"]  # type: ignore[index]
        assert torch.equal(gathered["by_pyro_name"], full["guide.locs.z_unconstrained"])
        assert torch.equal(gathered["by_module_name"], full["guide.scales.z_unconstrained"])


# -- the layout of the exchange, at W=3 (the case a reviewer measured)

GROUPS = 3000
GROUP_BATCH = 64


class GroupsModel(PyroModule):
    """3,000 groups, 4 observations each; b's rows are local to the plate."""

    def forward(self, y: torch.Tensor) -> None:
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        tau = pyro.sample("tau", dist.HalfNormal(2.0))
        with pyro.plate("groups", GROUPS, subsample_size=GROUP_BATCH, dim=-1) as i:
            b = pyro.sample("b", dist.Normal(0.0, tau))
            with pyro.plate("obs", 4, dim=-2):
                pyro.sample("y", dist.Normal(mu + b, 1.0), obs=y[i].T)


def group_plates(y: torch.Tensor) -> pyro.plate:
    return pyro.plate("groups", GROUPS, subsample_size=GROUP_BATCH, dim=-1)


def train_groups(own: bool, bucket_cap_mb: float | None, steps: int) -> dict[str, torch.Tensor]:
    """Torch Adam over AutoNormal(create_plates); local rows gathered in global order."""
    pyro.settings.set(module_local_params=True)
    try:
        generator = torch.Generator().manual_seed(0)
        b_true = 0.7 * torch.randn(GROUPS, generator=generator)
        y = 1.5 + b_true.unsqueeze(1) + torch.randn(GROUPS, 4, generator=generator)
        model = GroupsModel()
        guide = AutoNormal(model, create_plates=group_plates)
        loss_fn = Trace_ELBO()(model, guide)
        pd.set_rng_seed(1)
        with pd.shard_subsamples(own_local_params=own, by_block=True):
            loss_fn(y)
        options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        optimizer = pd.DistributedTorchOptimizer(
            torch.optim.Adam(loss_fn.parameters(), lr=0.02), **options
        )
        for _ in range(steps):
            optimizer.zero_grad()
            with pd.shard_subsamples(own_local_params=own, by_block=True):
                loss_fn(y).backward()
            optimizer.step()
        names = ("guide.locs.b_unconstrained", "guide.scales.b_unconstrained")
        values = {
            name: pd.gather_param(name, to="all", module=loss_fn) if own else p.detach().clone()
            for name, p in loss_fn.named_parameters()
            if name in names
        }
        return values | {
            name: p.detach().clone() for name, p in loss_fn.named_parameters() if name not in names
        }
    finally:
        pyro.settings.set(module_local_params=False)


def groups_in_both_layouts(steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """Owned and replicated, in the default buckets and one bucket per parameter.

    Four models in one process, as in a notebook: the second owned guide's
    parameters have the first's names and are new parameters, not its rows.
    """
    return {
        f"{'owned' if own else 'replicated'} {layout}": train_groups(own, cap, steps)
        for own in (False, True)
        for layout, cap in (("default", None), ("per-parameter", 1e-9))
    }


def test_owned_rows_at_w3_are_bitwise_where_the_global_sums_are_laid_out_alike() -> None:
    """Owned against replicated at W=3, 200 steps: bitwise when each global
    parameter travels alone; to rounding in the default buckets.

    Why the layout matters only from W=3: gloo's ring sums each chunk of a
    buffer starting at a different worker, so the sum of three workers'
    gradients for one element depends on where the element sits. The owned
    run's buffer holds the global parameters alone; the replicated one also
    holds every local row, so their global elements sit elsewhere and are
    summed in another order (a + b == b + a, so W=2 cannot see it). A local
    row's own average (one worker's gradient and W-1 zeros) is exact in any
    order, which is why one bucket per parameter makes everything bitwise.
    """
    results = run_workers(groups_in_both_layouts, 200, world_size=3, timeout=240.0)
    assert all(set(r) == set(results[0]) for r in results)
    for rank, mine in enumerate(results):
        for name, value in mine["owned per-parameter"].items():
            reference = results[0]["replicated per-parameter"][name]
            assert torch.equal(value, reference), f"{name} differs on worker {rank}"
        for name, value in mine["owned default"].items():
            reference = results[0]["replicated default"][name]
            assert torch.equal(value, results[0]["owned default"][name]), name
            assert torch.allclose(value, reference, rtol=0, atol=1e-5), name
            assert value.shape == reference.shape, name


# -- the same under the real horovodrun

HOROVOD_SCENARIOS: list[tuple[str, Any, tuple[Any, ...]]] = [
    ("averaged", train_net, (6, True, True)),
    ("replicated", train_local, (False, "adam", 6)),
    ("owned", train_local, (True, "adam", 6)),
]


@pytest.mark.horovod
def test_the_torch_front_end_and_ownership_under_horovodrun() -> None:
    outcome = run_under_launcher("horovod", HOROVOD_SCENARIOS)
    for result in outcome.values():
        if isinstance(result, WorkerFailure):
            raise result
    expected = reference_net(6, 2, scheduler=True)
    for result in outcome["averaged"]:
        for name, value in expected.items():
            assert torch.equal(result[name], value), name
    for rank, (mine, reference) in enumerate(
        zip(outcome["owned"], outcome["replicated"], strict=True)
    ):
        block = list(range(rank * N_LOCAL // 2, (rank + 1) * N_LOCAL // 2))
        for name, value in reference["values"].items():
            if name in mine["local"]:
                assert torch.equal(mine["local"][name][1], value[block]), name
            else:
                assert torch.equal(mine["values"][name], value), name


def built_before_the_cut(how: str) -> dict[str, Any]:
    """The optimizer built before the call that cuts the local rows.

    ``how``: "warm-up" cuts them in a warm-up call under ownership, as the
    README says; "stepped" does too, after a step of all N rows replicated;
    "in-training" cuts them in the first training call, whose backward pass
    must be refused.
    """
    pyro.settings.set(module_local_params=True)
    try:
        pd.set_rng_seed(0)
        x = torch.randn(N_LOCAL, D_LOCAL, generator=torch.Generator().manual_seed(2)) + 1.0
        model = LocalModel()
        guide = AutoNormal(model, create_plates=local_plates)
        loss_fn = Trace_ELBO()(model, guide)
        with pd.shard_subsamples(by_block=True):
            loss_fn(x)  # creates the parameters, all N rows
        optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.05))
        if how == "stepped":
            with pd.shard_subsamples(by_block=True):
                loss_fn(x).backward()
            optimizer.step()  # Adam's moments now hold all N rows
        if how in ("warm-up", "stepped"):
            with pd.shard_subsamples(own_local_params=True):
                loss_fn(x)  # cuts the rows; no backward pass
        try:
            for _ in range(3):
                optimizer.zero_grad()
                with pd.shard_subsamples(own_local_params=True):
                    loss = loss_fn(x)
                loss.backward()
                optimizer.step()
        except pd.PyroDistributedError as exc:
            return {"error": str(exc)}
        return {"rows": pd.local_rows("AutoNormal.locs.z")}
    finally:
        pyro.settings.set(module_local_params=False)


def test_an_optimizer_built_before_the_rows_are_cut_keeps_working() -> None:
    results = run_workers(built_before_the_cut, "warm-up")
    for rank, result in enumerate(results):
        indices, rows = result["rows"]
        assert indices.tolist() == list(range(rank * N_LOCAL // 2, (rank + 1) * N_LOCAL // 2))
        assert rows.shape == (len(indices), D_LOCAL)


def test_an_optimizer_that_stepped_all_the_rows_is_refused_by_name() -> None:
    results = run_workers(built_before_the_cut, "stepped")
    for result in results:
        message = result["error"]
        assert "local parameter 'AutoNormal." in message and "of this worker's block" in message
        assert "stepped the parameter before" in message


def test_backpropagating_the_call_that_cut_the_rows_is_refused_with_the_remedy() -> None:
    results = run_workers(built_before_the_cut, "in-training")
    for result in results:
        message = result["error"]
        assert "cut local parameter 'AutoNormal.scales.z' to this worker's block" in message
        assert "make one warm-up call" in message


def test_the_torch_front_end_is_a_public_type_that_names_itself() -> None:
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    wrapped = pd.DistributedTorchOptimizer(plain, engine="local")
    assert type(wrapped) is pd.DistributedTorchOptimizer
    # A torch optimizer, neither a PyroOptim nor the Pyro front end, whose step means SVI's.
    assert not isinstance(wrapped, pd.DistributedOptimizer)
    assert isinstance(wrapped, torch.optim.Optimizer)
    assert not isinstance(wrapped, pyro.optim.PyroOptim)
    assert repr(wrapped).startswith("DistributedTorchOptimizer(SGD (")
    assert isinstance(wrapped.engine, pd.Engine)
    assert {"DistributedTorchOptimizer", "Engine", "scaling"} <= set(pd.__all__)
