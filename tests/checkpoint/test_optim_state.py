"""A torch optimizer's saved state tried before it is loaded
(pyro_distributed.checkpoint.optim_state): another optimizer's state, or a
moment of the wrong shape, is refused by name and changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import pyro_distributed as pd
from pyro_distributed.checkpoint import files


def _trained(kind: Any, **settings: Any) -> tuple[torch.nn.Module, pd.DistributedTorchOptimizer]:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    optimizer = pd.DistributedTorchOptimizer(kind(net.parameters(), **settings))
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return net, optimizer


def _refused(path: Path, kind: Any, message: str, **settings: Any) -> None:
    net, optimizer = _trained(kind, **settings)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    state = repr(optimizer.state_dict())
    with pytest.raises(ValueError, match=message):
        pd.load_checkpoint(path, optimizer, module=net)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    assert repr(optimizer.state_dict()) == state
    optimizer.step()  # the run goes on as it was


def test_another_optimizers_state_is_refused(tmp_path: Path) -> None:
    pd.init("local")
    net, adam = _trained(torch.optim.Adam, lr=0.1)
    path = tmp_path / "adam.pt"
    pd.save_checkpoint(path, adam, module=net)
    _refused(
        path,
        torch.optim.SGD,
        r"adam\.pt' holds optimizer state \['exp_avg', 'exp_avg_sq', 'step'\] for parameter "
        r"0 of group 0, where this run's SGD keeps \['momentum_buffer'\]",
        lr=0.1,
        momentum=0.9,
    )
    # SGD without momentum keeps no state, and would have ignored Adam's.
    _refused(path, torch.optim.SGD, r"where this run's SGD keeps none", lr=0.1)


def test_a_moment_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    pd.init("local")
    net, adam = _trained(torch.optim.Adam, lr=0.1)
    state = {**adam.state_dict()}
    good = tmp_path / "good.pt"
    pd.save_checkpoint(good, adam, module=net)
    state = files.load_file(good)
    state["optimizer"]["state"][1]["exp_avg"] = torch.zeros(7)
    files.write_checkpoint(tmp_path / "bad.pt", state)
    _refused(
        tmp_path / "bad.pt",
        torch.optim.Adam,
        r"bad\.pt' holds optimizer state 'exp_avg' of shape \[7\] for parameter 1 of group 0, "
        r"which needs \[2\]",
        lr=0.1,
    )


def test_other_groups_are_refused(tmp_path: Path) -> None:
    pd.init("local")
    net, adam = _trained(torch.optim.Adam, lr=0.1)
    path = tmp_path / "adam.pt"
    pd.save_checkpoint(path, adam, module=net)
    other = torch.nn.Linear(3, 2)
    split = torch.optim.Adam([{"params": [other.weight]}, {"params": [other.bias]}], lr=0.1)
    optimizer = pd.DistributedTorchOptimizer(split)
    with pytest.raises(ValueError, match=r"holds an optimizer of \[2\] parameters by group"):
        pd.load_checkpoint(path, optimizer, module=other)
