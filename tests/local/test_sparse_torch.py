"""Sparse local steps on the torch-native path: an ELBO module and a torch optimizer.

``pyro.settings.set(module_local_params=True)``, ``Trace_ELBO()(model, guide)``
and ``pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters()))``, inside
``shard_subsamples(own_local_params=True, local_updates="sparse")``. Every
scenario runs on real gloo workers. Each step is checked against the
reference implementation of the lazy rules in ``test_sparse`` (the same
formulas, fed the same rows and gradients), at W=1, 2 and 3, with an
AutoNormal guide and with a PyroModule guide of PyroParams; the others check
that the module's block parameter never gets a dense gradient, that
``zero_grad`` drops row gradients as it drops ``.grad``, refusals by name,
checkpoints (bitwise resume, re-partitioned), and row gradients with particles.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim.clipped_adam import ClippedAdam

import pyro_distributed as pd
from pyro_distributed.local import registry
from pyro_distributed.local import sparse as sparse_local

from ..support.compare import assert_same_state
from ..support.harness import run_workers
from ..support.sparse import (
    STEPS,
    Make,
    assert_reference_facts,
    before_step,
    check_step,
    elbo_module,
    fresh_run,
    gradient_facts,
    module_local_params,
    sparse,
    trained,
    x_data,
)
from ..support.torch_models import D_LOCAL, N_LOCAL, LocalModel, local_plates

#: The torch optimizers of test_sparse's reference kinds, with the same settings.
TORCH_OPTIMIZERS: dict[str, Make] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    "clipped": lambda ps: ClippedAdam(ps, lr=0.05, clip_norm=0.5, lrd=0.99),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.002),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.002, momentum=0.9, nesterov=True),
}


def local_tensors(loss_fn: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's local parameters, by the name Pyro gives them."""
    found = {}
    for param in loss_fn.parameters():
        record = registry.local_of(param)
        if record is not None:
            found[record.name] = param
    return found


def global_values(loss_fn: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone()
        for name, p in loss_fn.named_parameters()
        if registry.local_of(p) is None
    }


# ---------------------------------------------------------------------------
# Each step against the reference of the stated rules.


def checked_against_reference(kinds: list[str], guide_name: str) -> dict[str, Any]:
    """Train with each torch optimizer sparsely, checking every local step."""
    seen: dict[str, Any] = {}
    with module_local_params():
        for kind in kinds:
            loss_fn = elbo_module(guide_name)  # two particles: rows may repeat
            optimizer = pd.DistributedTorchOptimizer(TORCH_OPTIMIZERS[kind](loss_fn.parameters()))
            local = local_tensors(loss_fn)
            facts: dict[str, Any] = {"names": sorted(local)}
            for t in range(1, STEPS + 1):
                optimizer.zero_grad()
                with sparse():
                    loss = loss_fn(x_data())
                loss.backward()
                before = {}
                for name, p in local.items():
                    assert p.grad is None, "backward gives the block no dense gradient"
                    before[name] = before_step(name, p, optimizer.state.get(p))
                    gradient_facts(facts, before[name])
                optimizer.step()
                for name, p in local.items():
                    check_step(kind, t, name, before[name], p, optimizer.state[p])
            facts["globals"] = global_values(loss_fn)
            seen[kind] = facts
    return seen


@pytest.mark.parametrize(
    ("workers", "guide_name"), [(1, "auto"), (2, "auto"), (3, "auto"), (2, "module")]
)
@pytest.mark.slow
def test_each_torch_native_step_is_the_stated_lazy_rule_within_one_ulp(
    workers: int, guide_name: str
) -> None:
    kinds = list(TORCH_OPTIMIZERS)
    results = run_workers(checked_against_reference, kinds, guide_name, world_size=workers)
    assert_reference_facts(results, kinds)
    expected = (
        ["AutoNormal.locs.z", "AutoNormal.scales.z"]
        if guide_name == "auto"
        else ["z_loc", "z_scale"]  # a top-level PyroModule names them bare
    )
    for kind in kinds:
        for result in results:
            assert result[kind]["names"] == expected
            # Global parameters, stepped through the exchange, agree bitwise.
            assert_same_state(result[kind]["globals"], results[0][kind]["globals"], kind)


# ---------------------------------------------------------------------------
# zero_grad, plain SGD, refusals.


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.002)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_plain_sgd_on_the_torch_path_is_bitwise_the_dense_step(workers: int) -> None:
    """SGD moves no row without gradient: sparse and dense are the same numbers,
    which pins the row gradients, their 1/W and the exchange of the rest."""
    dense = run_workers(trained, "auto", sgd, 6, "dense", world_size=workers)
    mine = run_workers(trained, "auto", sgd, 6, world_size=workers)
    for got, want in zip(mine, dense, strict=True):
        assert_same_state(got, want)


def zero_grad_between(how: str) -> dict[str, torch.Tensor]:
    """Two SGD steps, each after one of these sequences.

    "plain": forward, backward, step. "discarded": a forward and backward
    first, then zero_grad, then the plain sequence: the first backward must
    not count. "forward first": forward, zero_grad, backward, step (the loss
    computed before zero_grad is what is stepped). All three draw the same
    rows in the same order, so they must end bitwise equal.
    """
    with module_local_params():
        loss_fn = elbo_module("auto")
        optimizer = pd.DistributedTorchOptimizer(torch.optim.SGD(loss_fn.parameters(), lr=0.01))
        local = local_tensors(loss_fn)
        for _ in range(2):
            optimizer.zero_grad()
            if how == "discarded":
                with sparse():
                    loss_fn(x_data()).backward()
                optimizer.zero_grad()
            else:
                with sparse():
                    loss_fn(x_data())  # the same draws as the discarded pass
            with sparse():
                loss = loss_fn(x_data())
            if how == "forward first":
                optimizer.zero_grad(set_to_none=False)
            loss.backward()
            optimizer.step()
            assert all(p.grad is None for p in local.values())
        return {name: p.detach().clone() for name, p in loss_fn.named_parameters()}


@pytest.mark.slow
def test_zero_grad_drops_row_gradients_as_it_drops_grad() -> None:
    plain = run_workers(zero_grad_between, "plain")
    for how in ("discarded", "forward first"):
        for got, want in zip(run_workers(zero_grad_between, how), plain, strict=True):
            assert_same_state(got, want, how)


REFUSED: dict[str, Make] = {
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "dampening": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.1),
}


def refused() -> dict[str, Any]:
    found = {}
    with module_local_params():
        for name, make in REFUSED.items():
            loss_fn = elbo_module("auto")
            optimizer = pd.DistributedTorchOptimizer(make(loss_fn.parameters()), overlap=False)
            before = {n: p.detach().clone() for n, p in loss_fn.named_parameters()}
            with sparse():
                loss_fn(x_data()).backward()
            with pytest.raises(ValueError) as error:
                optimizer.step()
            after = {n: p.detach().clone() for n, p in loss_fn.named_parameters()}
            unchanged = all(torch.equal(after[n], before[n]) for n in before)
            found[name] = {"message": str(error.value), "unchanged": unchanged}
    return found


def test_torch_optimizers_without_a_lazy_rule_are_refused_by_name() -> None:
    for result in run_workers(refused):
        assert all(case["unchanged"] for case in result.values()), "refused before any step"
        assert "no lazy rule for the optimizer RMSprop" in result["rmsprop"]["message"]
        assert "use local_updates='dense' for RMSprop" in result["rmsprop"]["message"]
        assert "does not implement Adam with amsgrad" in result["amsgrad"]["message"]
        assert "does not implement SGD with dampening=0.1" in result["dampening"]["message"]
        assert "local parameter 'AutoNormal." in result["rmsprop"]["message"]


def nan_in_worker_1s_rows() -> dict[str, Any]:
    with module_local_params():
        loss_fn = elbo_module("auto")
        optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.05))
        before = {n: p.detach().clone() for n, p in loss_fn.named_parameters()}
        with sparse():
            loss_fn(x_data()).backward()
        if pd.rank() == 1:
            leaves = [leaf for _, leaf in sparse_local.pending_reads("AutoNormal.scales.z")]
            next(leaf for leaf in leaves if leaf.grad is not None).grad[0, 0] = float("nan")
        with pytest.warns(RuntimeWarning, match="every worker skips this step") as caught:
            optimizer.step()
        after = {n: p.detach().clone() for n, p in loss_fn.named_parameters()}
        return {
            "unchanged": all(torch.equal(after[n], before[n]) for n in before),
            "message": str(caught[0].message),
        }


def test_a_nan_in_one_workers_rows_skips_the_torch_step_on_every_worker() -> None:
    results = run_workers(nan_in_worker_1s_rows)
    for result in results:
        assert result["unchanged"], "global and local parameters alike"
    assert "'AutoNormal.scales.z'" in results[1]["message"], "named where it arose"


# ---------------------------------------------------------------------------
# Checkpoints, gather_param and local_rows.

MODULE_NAMES = ("guide.locs.z_unconstrained", "guide.scales.z_unconstrained")


def _run(steps: int, path: str | None = None, load: bool = False) -> dict[str, Any]:
    with module_local_params():
        loss_fn = elbo_module("auto")
        optimizer = pd.DistributedTorchOptimizer(torch.optim.Adam(loss_fn.parameters(), lr=0.05))
        start = pd.load_checkpoint(path, optimizer, module=loss_fn) if load else 0
        loaded = {name: pd.gather_param(name, to="all", module=loss_fn) for name in MODULE_NAMES}
        saved = None
        for step in range(start, start + steps):
            optimizer.zero_grad()
            with sparse():
                loss_fn(x_data()).backward()
            optimizer.step()
            if path is not None and not load and step + 1 == steps // 2:
                pd.save_checkpoint(path, optimizer, module=loss_fn)
                saved = _snapshot(loss_fn, optimizer)
        return {
            "start": start,
            "loaded": loaded,
            "saved": saved,
            "end": _snapshot(loss_fn, optimizer),
        }


def _snapshot(loss_fn: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    named = dict(loss_fn.named_parameters())
    return {
        "values": {name: p.detach().clone() for name, p in named.items()},
        "state": {
            name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in named.items()
        },
        "gathered": {
            name: pd.gather_param(name, to="all", module=loss_fn) for name in MODULE_NAMES
        },
        "by_pyro_name": pd.gather_param("AutoNormal.locs.z", to="all"),
        "rows": {name: pd.local_rows(name, module=loss_fn)[0] for name in MODULE_NAMES},
    }


@pytest.mark.slow
def test_torch_native_checkpoints_resume_bitwise_and_repartition(tmp_path: Path) -> None:
    path = str(tmp_path / "run.pt")
    straight = run_workers(_run, 8, path)
    resumed = run_workers(_run, 4, path, True)
    for rank, (again, first) in enumerate(zip(resumed, straight, strict=True)):
        assert again["start"] == 4
        assert_same_state(again["end"], first["end"], f"worker {rank}")
    saved = straight[0]["saved"]
    state = saved["state"]["guide.locs.z_unconstrained"]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, "dense Adam's state format"
    assert state["exp_avg"].shape == (N_LOCAL // 2, D_LOCAL), "full-block moments"
    assert torch.equal(saved["by_pyro_name"], saved["gathered"]["guide.locs.z_unconstrained"])
    elastic = run_workers(_run, 2, path, True, world_size=3)
    for rank, worker in enumerate(elastic):
        rows = list(range(rank * N_LOCAL // 3, (rank + 1) * N_LOCAL // 3))
        for name in MODULE_NAMES:
            assert torch.equal(worker["loaded"][name], saved["gathered"][name])
            assert worker["end"]["rows"][name].tolist() == rows
            moments = worker["end"]["state"][name]
            assert moments["exp_avg"].shape == (len(rows), D_LOCAL)
            assert int(moments["step"]) == 6


# ---------------------------------------------------------------------------
# Row gradients with particles, against the dense gradient.

PARTICLES = ((4, True), (4, False))


def module_row_gradients(mode: str) -> dict[str, torch.Tensor]:
    """One backward pass per particle setting; each local parameter's gradient as a
    block (dense: its ``.grad``; sparse: the taken row gradients in a zero block),
    and (sparse) the most times one row was read by sequential particles."""
    seen: dict[str, Any] = {}
    most = 0
    with module_local_params():
        for particles, vectorize in PARTICLES:
            elbo = Trace_ELBO(
                num_particles=particles, vectorize_particles=vectorize, max_plate_nesting=1
            )
            fresh_run()
            pd.set_rng_seed(0)
            model = LocalModel()
            loss_fn = elbo(model, AutoNormal(model, create_plates=local_plates))
            with pd.shard_subsamples(own_local_params=True, local_updates=mode):
                loss_fn(x_data())  # warm-up: creates and cuts the parameters
                loss_fn(x_data()).backward()
            for name, p in local_tensors(loss_fn).items():
                key = f"{name}, {particles} particles{', vectorised' if vectorize else ''}"
                if mode == "dense":
                    seen[key] = p.grad.clone()
                else:
                    assert p.grad is None
                    if not vectorize:  # the last call's reads, one per particle
                        reads = sparse_local.pending_reads(name)[-particles:]
                        counts = torch.cat([rows for rows, _ in reads]).bincount()
                        most = max(most, int(counts.max()))
                    _, (rows,) = sparse_local.take_gradients([p])
                    seen[key] = torch.zeros_like(p).index_copy_(rows.axis, rows.rows, rows.grad)
    if mode == "sparse":
        seen["most reads"] = [most]
    return seen


def test_torch_native_row_gradients_are_the_dense_gradients_rows_with_particles() -> None:
    """Vectorised particles: bitwise the dense gradient's rows. Sequential ones
    run in one backward pass here (the ELBO module sums the particles' losses),
    where autograd adds up the block's incoming gradients in an order of its
    own, while the rows are summed in the order they were read: a row read by
    three particles or more can differ in the last bits (measured: 2 ulps, on
    a row read by three). The SVI path, one backward pass per particle, is
    bitwise (tests/local/test_sparse.py)."""
    dense = run_workers(module_row_gradients, "dense")
    mine = run_workers(module_row_gradients, "sparse")
    most_reads = [got.pop("most reads")[0] for got in mine]
    for got, want in zip(mine, dense, strict=True):
        assert got.keys() == want.keys() and len(got) == 4
        for key, value in want.items():
            if "vectorised" in key:
                assert torch.equal(got[key], value), key
            else:
                assert (got[key] != 0).equal(value != 0), f"{key}: the same rows"
                assert within_ulps(got[key], value, 4), key
    # Sequential particles here really read a row three times or more: the
    # case the tolerance is for is exercised.
    assert max(most_reads) >= 3


def within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> bool:
    ulp = (torch.nextafter(want, torch.full_like(want, math.inf)) - want).abs()
    return bool(((got - want).abs() <= ulps * ulp).all())
