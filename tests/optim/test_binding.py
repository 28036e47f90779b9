"""An optimizer binds its engine at its first step, on real workers.

Each worker here starts as Lightning's do: with no process group and no
torchrun environment, so that ``engine="auto"`` finds one worker. The
optimizer is built then; the workers meet afterwards, in a process group the
test creates itself (as Lightning, Ray Train or Accelerate would).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pyro
import pytest
import torch
import torch.distributed as dist

import pyro_distributed as pd
from pyro_distributed.optim.torch_optimizer import DistributedTorchOptimizer

from ..support.harness import ENGINE_TIMEOUT, run_workers

_TARGETS = torch.tensor([[1.0, -2.0, 3.0], [5.0, 2.0, -1.0]])  # one row per worker
_LR, _STEPS = 0.1, 5


@pytest.fixture(autouse=True)
def _no_engine_left_running():
    yield
    pd.shutdown()


def _leave_the_launcher() -> tuple[int, int, str]:
    """Forget torchrun's variables, as a process that Lightning launches has none
    of them before ``trainer.fit``; return what is needed to meet later."""
    rank, world_size = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    address = f"tcp://{os.environ.pop('MASTER_ADDR')}:{os.environ.pop('MASTER_PORT')}"
    return rank, world_size, address


def _meet(rank: int, world_size: int, address: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=address,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=ENGINE_TIMEOUT),
    )


def _step(optimizer: object, param: torch.Tensor, target: torch.Tensor) -> None:
    """One step of sum((param - target)^2), this worker's own loss."""
    param.grad = None
    ((param - target) ** 2).sum().backward()
    if isinstance(optimizer, DistributedTorchOptimizer):
        optimizer.step()
    else:
        optimizer([param])  # type: ignore[operator]


def _make(front_end: str) -> tuple[object, torch.Tensor]:
    if front_end == "torch":
        param = torch.nn.Parameter(torch.zeros(3))
        return pd.DistributedTorchOptimizer(torch.optim.SGD([param], lr=_LR)), param
    param = pyro.param("p", torch.zeros(3))
    return pd.DistributedOptimizer(pyro.optim.SGD({"lr": _LR})), param.unconstrained()


def built_before_the_group(front_end: str) -> tuple[int, list[float]]:
    rank, world_size, address = _leave_the_launcher()
    optimizer, param = _make(front_end)
    alone = pd.world_size()  # the runtime, asked now, sees one worker
    _meet(rank, world_size, address)
    for _ in range(_STEPS):
        _step(optimizer, param, _TARGETS[rank])
    return alone, param.detach().tolist()


def stepped_before_the_group(front_end: str) -> str:
    rank, world_size, address = _leave_the_launcher()
    optimizer, param = _make(front_end)
    _step(optimizer, param, _TARGETS[rank])  # binds the optimizer to one worker
    _meet(rank, world_size, address)
    with pytest.raises(pd.PyroDistributedError) as raised:
        _step(optimizer, param, _TARGETS[rank])
    dist.barrier()  # worker 0 hosts the rendezvous: it must not leave before the others joined
    return str(raised.value)


def _averaged_descent() -> list[float]:
    """Plain SGD on the mean of the workers' losses, in this process."""
    param = torch.zeros(3)
    for _ in range(_STEPS):
        param = param - _LR * 2.0 * (param - _TARGETS).mean(0)
    return param.tolist()


@pytest.mark.parametrize("front_end", ["pyro", "torch"])
def test_an_optimizer_built_before_the_process_group_averages_over_it(front_end: str) -> None:
    results = run_workers(built_before_the_group, front_end, engine="")
    assert [alone for alone, _ in results] == [1, 1]
    (_, first), (_, second) = results
    assert first == second
    assert first == pytest.approx(_averaged_descent(), rel=1e-6)


@pytest.mark.parametrize("front_end", ["pyro", "torch"])
def test_an_optimizer_bound_to_one_worker_refuses_a_larger_group(front_end: str) -> None:
    messages = run_workers(stepped_before_the_group, front_end, engine="")
    for message in messages:
        assert "bound to one worker" in message
        assert "a torch.distributed process group of 2 workers" in message


def test_a_local_engine_that_auto_chose_gives_way_to_a_process_group() -> None:
    names = run_workers(_runtime_engine_names, engine="")
    assert names == [("local", "torch", 2)] * 2


def _runtime_engine_names() -> tuple[str, str, int]:
    rank, world_size, address = _leave_the_launcher()
    before = pd.current_engine().name
    _meet(rank, world_size, address)
    return before, pd.current_engine().name, pd.world_size()


def test_an_unknown_engine_name_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tcp'"):
        pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), engine="tcp")


def test_the_repr_does_not_bind() -> None:
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
    assert "'auto' (unbound)" in repr(optim)
    assert optim.sync is None  # binds: one plain process
    assert "LocalEngine" in repr(optim)
