"""Checkpoints of runs with a torch optimizer (pyro_distributed.checkpoint.modules):
the module, its local blocks, the optimizer and the schedulers, on real workers."""

from __future__ import annotations

from typing import Any

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

from ..support.harness import run_workers
from ..support.torch_models import D_LOCAL, N_LOCAL, LocalModel, local_plates, small_net


def _local_run() -> tuple[torch.nn.Module, torch.Tensor, Any, Any]:
    pd.set_rng_seed(0)
    x = torch.randn(N_LOCAL, D_LOCAL, generator=torch.Generator().manual_seed(2)) + 1.0
    model = LocalModel()
    guide = AutoNormal(model, create_plates=local_plates)
    loss_fn = Trace_ELBO()(model, guide)
    with pd.shard_subsamples(own_local_params=True):
        loss_fn(x)
    optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.05))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    return loss_fn, x, optimizer, scheduler


def checkpointed(path: str, save_at: int | None, load: bool, steps: int) -> dict[str, Any]:
    pyro.settings.set(module_local_params=True)
    try:
        loss_fn, x, optimizer, scheduler = _local_run()
        start = 0
        if load:
            start = pd.load_checkpoint(path, optimizer, module=loss_fn, schedulers=[scheduler])
        for step in range(start, steps):
            optimizer.zero_grad()
            with pd.shard_subsamples(own_local_params=True):
                loss_fn(x).backward()
            optimizer.step()
            scheduler.step()
            if step + 1 == save_at:
                pd.save_checkpoint(path, optimizer, module=loss_fn, schedulers=[scheduler])
        named = dict(loss_fn.named_parameters())
        return {
            "global": {k: v.detach().clone() for k, v in named.items() if "z_" not in k},
            "locs": pd.gather_param("AutoNormal.locs.z", to="all"),
            "rows": pd.local_rows("guide.scales.z_unconstrained", module=loss_fn),
            "moments": optimizer.state[named["guide.scales.z_unconstrained"]]["exp_avg"].clone(),
            "lr": optimizer.param_groups[0]["lr"],
            "start": start,
        }
    finally:
        pyro.settings.set(module_local_params=False)


@pytest.mark.slow
def test_a_module_checkpoint_resumes_bitwise_in_fresh_processes(tmp_path: Any) -> None:
    path = str(tmp_path / "run.pt")
    straight = run_workers(checkpointed, path, 3, False, 6)
    resumed = run_workers(checkpointed, path, None, True, 6)
    for mine, reference in zip(resumed, straight, strict=True):
        assert mine["start"] == 3
        assert mine["lr"] == reference["lr"]
        for name, value in reference["global"].items():
            assert torch.equal(mine["global"][name], value), name
        assert torch.equal(mine["locs"], reference["locs"])
        assert torch.equal(mine["rows"][1], reference["rows"][1])
        assert torch.equal(mine["moments"], reference["moments"])


def test_a_module_checkpoint_repartitions_local_rows_for_another_world_size(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "run.pt")
    saved = run_workers(checkpointed, path, 3, False, 3)
    moved = run_workers(checkpointed, path, None, True, 3, world_size=3)
    for rank, mine in enumerate(moved):
        block = list(range(rank * N_LOCAL // 3, (rank + 1) * N_LOCAL // 3))
        indices, rows = mine["rows"]
        assert indices.tolist() == block
        assert torch.equal(mine["locs"], saved[0]["locs"])  # all N rows, as saved
        scales_then = torch.cat([saved[0]["rows"][1], saved[1]["rows"][1]])
        assert torch.equal(rows, scales_then[block])
        moments_then = torch.cat([saved[0]["moments"], saved[1]["moments"]])
        assert torch.equal(mine["moments"], moments_then[block])
        for name, value in saved[0]["global"].items():
            assert torch.equal(mine["global"][name], value), name


def test_module_checkpoints_refuse_the_wrong_kind_of_call(tmp_path: Any) -> None:
    pd.init("local")
    try:
        net = small_net(0)
        optimizer = pd.DistributedTorchOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        with pytest.raises(TypeError, match="needs module="):
            pd.save_checkpoint(str(tmp_path / "a.pt"), optimizer)
        pd.save_checkpoint(str(tmp_path / "a.pt"), optimizer, module=net)
        other = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="is of a different module"):
            pd.load_checkpoint(str(tmp_path / "a.pt"), optimizer, module=other)
        pyro_optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
        with pytest.raises(
            ValueError, match="load it with load_checkpoint\\(path, optimizer, module"
        ):
            pd.load_checkpoint(str(tmp_path / "a.pt"), pyro_optim)
        with pytest.raises(TypeError, match="module= and schedulers= are for runs with a torch"):
            pd.save_checkpoint(str(tmp_path / "b.pt"), pyro_optim, module=net)
    finally:
        pd.shutdown()
