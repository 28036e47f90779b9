"""The grouped multi-tensor step against PyroOptim's one optimizer per parameter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_distributed as pd

from ..support import ownership
from ..support.harness import run_workers
from ..support.models import bayesian_regression, param_values, regression_data

OPTIMIZERS: dict[str, Callable[[], pyro.optim.PyroOptim]] = {
    "Adam": lambda: pyro.optim.Adam({"lr": 0.05}),
    "AdamW": lambda: pyro.optim.AdamW({"lr": 0.05, "weight_decay": 0.1}),
    "SGD": lambda: pyro.optim.SGD({"lr": 1e-6, "momentum": 0.9}),
    "RMSprop": lambda: pyro.optim.RMSprop({"lr": 0.01}),
    "per-param": lambda: pyro.optim.Adam(lambda name: {"lr": 0.1 if "locs" in name else 0.01}),
    "Adam, amsgrad": lambda: pyro.optim.Adam({"lr": 0.05, "amsgrad": True, "weight_decay": 0.1}),
    "SGD, Nesterov": lambda: pyro.optim.SGD(
        {"lr": 1e-6, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    ),
    "RMSprop, centred": lambda: pyro.optim.RMSprop({"lr": 0.01, "centered": True, "momentum": 0.5}),
    "Adagrad": lambda: pyro.optim.Adagrad({"lr": 0.05, "lr_decay": 0.01}),
    "Adamax": lambda: pyro.optim.Adamax({"lr": 0.05}),
}
#: Grouped only when asked for: they round differently (multi_tensor.py).
ROUNDING: dict[str, Callable[[], pyro.optim.PyroOptim]] = {
    "NAdam": lambda: pyro.optim.NAdam({"lr": 0.002}),
    # torch's RAdam (pyro.optim.RAdam is Pyro's own). Its first steps are plain
    # momentum, and this model's gradients reach 1e5: hence the tiny rate.
    "RAdam": lambda: pyro.optim.PyroOptim(torch.optim.RAdam, {"lr": 1e-6}),
}


def train(multi_tensor: bool | None, steps: int, exact: bool = True) -> dict[str, dict[str, Any]]:
    results = {}
    for case, make in (OPTIMIZERS if exact else ROUNDING).items():
        pyro.clear_param_store()
        pyro.set_rng_seed(pd.rank())
        x, y = regression_data(pd.rank(), 16)
        optim = pd.DistributedOptimizer(make(), multi_tensor=multi_tensor)
        svi = SVI(bayesian_regression, AutoNormal(bayesian_regression), optim, Trace_ELBO())
        for _ in range(steps):
            svi.step(x, y)
        results[case] = {
            "params": param_values(),
            "state": optim.get_state(),
            "grouped": optim.grouped,
            "optim_objs": len(optim.optim_objs),
        }
    return results


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.slow
def test_grouped_step_matches_one_optimizer_per_parameter_bitwise(world_size: int) -> None:
    grouped = run_workers(train, None, 15, world_size=world_size)  # the default groups these
    single = run_workers(train, False, 15, world_size=world_size)
    for rank in range(world_size):
        for case, expected in single[rank].items():
            got = grouped[rank][case]
            assert got["grouped"] and not expected["grouped"], case
            # Every parameter keeps its own torch optimizer in optim_objs.
            assert got["optim_objs"] == expected["optim_objs"] == 4, case
            for name, value in expected["params"].items():
                assert torch.equal(got["params"][name], value), (case, name)
            assert got["state"].keys() == expected["state"].keys()
            for name, state in expected["state"].items():
                for key, tensor in state["state"][0].items():
                    other = got["state"][name]["state"][0][key]
                    assert torch.equal(other, tensor), (case, name, key)


def test_nadam_and_radam_are_grouped_on_request_within_rounding() -> None:
    (default,) = run_workers(train, None, 15, False, world_size=1)
    (grouped,) = run_workers(train, True, 15, False, world_size=1)
    for case, expected in default.items():
        assert not expected["grouped"] and grouped[case]["grouped"], case
        for name, value in expected["params"].items():
            got = grouped[case]["params"][name]
            assert torch.allclose(got, value, rtol=1e-5, atol=1e-6), (case, name)


def live_state_in_optim_objs() -> list[bool]:
    x, y = regression_data(0, 16)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(bayesian_regression, AutoNormal(bayesian_regression), optim, Trace_ELBO())
    svi.step(x, y)
    before = {p: o.state[p]["exp_avg"].clone() for p, o in optim.optim_objs.items()}
    svi.step(x, y)
    # The per-parameter optimizers hold the very state the groups update.
    return [not torch.equal(o.state[p]["exp_avg"], before[p]) for p, o in optim.optim_objs.items()]


def test_optim_objs_show_the_live_grouped_state() -> None:
    (moved,) = run_workers(live_state_in_optim_objs, world_size=1)
    assert moved and all(moved)


def only_passed_params_step() -> dict[str, torch.Tensor]:
    a = pyro.param("a", torch.ones(2)).unconstrained()
    b = pyro.param("b", torch.ones(2)).unconstrained()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}), multi_tensor=True)
    (a.sum() + b.sum()).backward()
    optim([a, b])
    a.grad = torch.zeros(2)  # as SVI's zero_grads leaves it
    b.sum().backward()
    optim([b])  # a is not passed: it must not move (Adam's momentum would move it)
    return param_values()


def test_params_not_passed_are_not_stepped() -> None:
    (values,) = run_workers(only_passed_params_step, world_size=1)
    assert torch.allclose(values["a"], torch.full((2,), 0.9))
    assert not torch.allclose(values["b"], torch.full((2,), 0.9))


def checkpoint_across_modes(path: str, save_grouped: bool) -> dict[str, torch.Tensor]:
    x, y = regression_data(0, 16)
    results = {}
    for phase, grouped in (("first", save_grouped), ("second", not save_grouped)):
        pyro.set_rng_seed(0)
        guide = AutoNormal(bayesian_regression)
        guide(x, y)
        optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), multi_tensor=grouped)
        svi = SVI(bayesian_regression, guide, optim, Trace_ELBO())
        if phase == "second":
            pd.load_checkpoint(path, optim)
        for _ in range(5):
            svi.step(x, y)
        if phase == "first":
            pd.save_checkpoint(path, optim)
        results[phase] = param_values()["AutoNormal.locs.w"]
    return results


@pytest.mark.parametrize("save_grouped", [True, False])
@pytest.mark.slow
def test_checkpoints_move_between_the_two_modes(save_grouped: bool, tmp_path: Any) -> None:
    path = str(tmp_path / "run.pt")
    (grouped_first,) = run_workers(checkpoint_across_modes, path, save_grouped, world_size=1)
    (single_first,) = run_workers(checkpoint_across_modes, path, not save_grouped, world_size=1)
    assert torch.equal(grouped_first["second"], single_first["second"])


def test_refused_where_it_cannot_be_exact() -> None:
    with pytest.raises(ValueError, match="clip_args clip each parameter separately"):
        pd.DistributedOptimizer(
            pyro.optim.Adam({"lr": 0.1}, clip_args={"clip_norm": 1.0}),
            engine="local",
            multi_tensor=True,
        )
    with pytest.raises(ValueError, match="not a plain PyroOptim"):
        scheduler = pyro.optim.ExponentialLR(
            {"optimizer": torch.optim.SGD, "optim_args": {"lr": 0.1}, "gamma": 0.9}
        )
        pd.DistributedOptimizer(scheduler, engine="local", multi_tensor=True)
    with pytest.raises(ValueError, match="ClippedAdam has no multi-tensor step"):
        pd.DistributedOptimizer(
            pyro.optim.ClippedAdam({"lr": 0.1}), engine="local", multi_tensor=True
        )
    pd.shutdown()


# -- switching a local parameter between sparse and dense steps mid-run

MODES = ("sparse", "sparse", "sparse", "dense", "dense", "sparse", "sparse", "dense")


def switching_modes(multi_tensor: bool | None) -> dict[str, Any]:
    """One run whose local parameters alternate between sparse and dense steps."""
    pd.set_rng_seed(0)
    x = ownership.data()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), multi_tensor=multi_tensor)
    svi = SVI(ownership.model, ownership.guide, optim, Trace_ELBO())
    counts = []
    for mode in MODES:
        with pd.shard_subsamples(own_local_params=True, local_updates=mode):
            svi.step(x)
        store = pyro.get_param_store()
        counts.append(
            {
                name: int(optim.optim_objs[p].state[p]["step"])
                for name, p in store.named_parameters()
            }
        )
    return {
        "grouped": optim.grouped,
        "params": param_values(),
        "state": optim.get_state(),
        "counts": counts,
    }


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.slow
def test_switching_sparse_and_dense_keeps_each_parameters_state_when_grouped(
    world_size: int,
) -> None:
    """A switch in either direction keeps Adam's moments and step count: the
    grouped run equals one optimizer per parameter bitwise, and every count
    is the number of steps so far."""
    grouped = run_workers(switching_modes, None, world_size=world_size)
    single = run_workers(switching_modes, False, world_size=world_size)
    for mine, reference in zip(grouped, single, strict=True):
        assert mine["grouped"] and not reference["grouped"]
        for t, counts in enumerate(mine["counts"], start=1):
            assert set(counts.values()) == {t}, (t, MODES[t - 1], counts)
        assert mine["counts"] == reference["counts"]
        for name, value in reference["params"].items():
            assert torch.equal(mine["params"][name], value), name
        for name, state in reference["state"].items():
            for key, tensor in state["state"][0].items():
                assert torch.equal(mine["state"][name]["state"][0][key], tensor), (name, key)
