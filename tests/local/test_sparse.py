"""Sparse local steps: ``shard_subsamples(own_local_params=True, local_updates="sparse")``.

Every scenario runs on real gloo workers. The reference test checks each
step against a small implementation of the lazy rules written out here from
the formulas that ``pyro_distributed.optim.sparse_step`` states, fed the same rows
and gradients, at W=1, 2 and 3, with clipping active (ClippedAdam's clamp and
``clip_args``' norm); ``test_sparse_torch`` holds the torch-native path to the
same reference. The others check what must not change: row gradients are the
dense gradient's rows with vectorised and sequential particles, plain SGD and
full-coverage Adam equal the dense step bitwise, checkpoints resume bitwise
and re-partition, a NaN on one worker skips the step on all, the bytes sent
do not grow with N, and misuse is named.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pyro
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal, init_to_mean

import pyro_distributed as pd
from pyro_distributed.local import sparse as sparse_local
from pyro_distributed.pyro_internals import stored_unconstrained

from ..support.compare import assert_same_state
from ..support.harness import CountingEngine, run_workers
from ..support.ownership import BATCH, D, N, data, guide, model
from ..support.sparse import (
    CLIP_NORM,
    STEPS,
    assert_reference_facts,
    before_step,
    check_step,
    gradient_facts,
    plates,
)

LOCAL = ("z_loc", "z_scale")

OPTIMIZERS: dict[str, Any] = {
    "adam": lambda: pyro.optim.Adam({"lr": 0.05}),
    "adam-l2": lambda: pyro.optim.Adam({"lr": 0.05, "weight_decay": 0.1}),
    "adamw": lambda: pyro.optim.AdamW({"lr": 0.05, "weight_decay": 0.1}),
    "clipped": lambda: pyro.optim.ClippedAdam({"lr": 0.05, "clip_norm": 0.5, "lrd": 0.99}),
    # clip_args' clip_norm: torch's clip_grad_norm_ on each parameter's gradient.
    "adam-clipnorm": lambda: pyro.optim.Adam({"lr": 0.05}, {"clip_norm": CLIP_NORM}),
    "sgd": lambda: pyro.optim.SGD({"lr": 0.002}),
    "momentum": lambda: pyro.optim.SGD({"lr": 0.002, "momentum": 0.9, "nesterov": True}),
}
# Plain SGD behind a scheduler, and with clip_args, for the bitwise comparison with dense.
BESIDES: dict[str, Any] = {
    "sgd-steplr": lambda: pyro.optim.StepLR(
        {"optimizer": torch.optim.SGD, "optim_args": {"lr": 0.004}, "step_size": 3, "gamma": 0.5}
    ),
    "sgd-clip": lambda: pyro.optim.SGD({"lr": 0.002}, {"clip_value": 2.0}),
}


# ---------------------------------------------------------------------------
# The reference: the stated lazy rules on whole blocks, rows outside R masked.


def checked_against_reference(kinds: list[str]) -> dict[str, Any]:
    """Train each optimizer ``kinds`` sparsely, checking every step; return what was seen."""
    seen: dict[str, Any] = {}
    for kind in kinds:
        pyro.clear_param_store()
        pd.set_rng_seed(0)
        x = data()
        optim = pd.DistributedOptimizer(OPTIMIZERS[kind]())
        elbo = Trace_ELBO(num_particles=2)  # two draws per step: rows may repeat
        seen[kind] = {}
        for t in range(1, STEPS + 1):
            with (
                pd.shard_subsamples(own_local_params=True, local_updates="sparse"),
                poutine.trace(param_only=True) as capture,
            ):
                elbo.loss_and_grads(model, guide, x)
            params = {site["value"].unconstrained() for site in capture.trace.nodes.values()}
            before = {}
            for name in LOCAL:
                p = stored_unconstrained(name)
                held = optim.optim_objs.get(p)
                before[name] = before_step(name, p, held.state[p] if held else None)
                gradient_facts(seen[kind], before[name])
            optim(params)
            pyro.infer.util.zero_grads(params)
            for name, recorded in before.items():
                p = stored_unconstrained(name)
                check_step(kind, t, name, recorded, p, optim.optim_objs[p].state[p])
    return seen


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_each_step_is_the_stated_lazy_rule_within_one_ulp(workers: int) -> None:
    results = run_workers(checked_against_reference, list(OPTIMIZERS), world_size=workers)
    assert_reference_facts(results, OPTIMIZERS)
    for result in results:
        # clip_args' clip_norm scaled every step's gradient down.
        assert result["adam-clipnorm"]["min_norm"] > CLIP_NORM


# ---------------------------------------------------------------------------
# Where sparse and dense must agree bitwise.

#: (num_particles, vectorize_particles) of the gradient comparison.
PARTICLES = ((4, True), (4, False), (1, False))


def row_gradients(mode: str) -> dict[str, Any]:
    """The local parameters' gradient of one ELBO evaluation per particle setting,
    as a block: ``.grad`` (dense), or the row gradients the sparse step would
    take, written into a zero block."""
    seen: dict[str, Any] = {}
    for particles, vectorize in PARTICLES:
        pyro.clear_param_store()
        pd.set_rng_seed(0)
        elbo = Trace_ELBO(
            num_particles=particles, vectorize_particles=vectorize, max_plate_nesting=1
        )
        with pd.shard_subsamples(own_local_params=True, local_updates=mode):
            elbo.loss_and_grads(model, guide, data())
        for name in LOCAL:
            p = stored_unconstrained(name)
            key = f"{name}, {particles} particles{', vectorised' if vectorize else ''}"
            if mode == "dense":
                seen[key] = p.grad.clone()
                continue
            assert p.grad is None
            reads = sum(len(rows) for rows, _ in sparse_local.pending_reads(name))
            _, (rows,) = sparse_local.take_gradients([p])
            block = torch.zeros_like(p).index_copy_(rows.axis, rows.rows, rows.grad)
            seen[key] = {"block": block, "rows": rows.rows, "reads": reads}
    return seen


def test_row_gradients_are_the_dense_gradients_rows_with_particles() -> None:
    """Vectorised particles (one read inside the particle plate, broadcast) and
    sequential ones (one read per particle, rows may repeat) give each selected
    row bitwise the dense gradient's row, and no other row has a gradient."""
    dense = run_workers(row_gradients, "dense")
    sparse = run_workers(row_gradients, "sparse")
    for mine, reference in zip(sparse, dense, strict=True):
        assert mine.keys() == reference.keys()
        for key, want in reference.items():
            got = mine[key]
            assert torch.equal(got["block"], want), key
            outside = torch.ones(len(want), dtype=torch.bool)
            outside[got["rows"]] = False
            assert not want[outside].any(), f"{key}: the dense gradient is zero off the rows"
            particles = int(key.split(", ")[1].split()[0])
            vectorised = "vectorised" in key
            assert got["reads"] == BATCH * (1 if vectorised else particles), key
    # Sequential particles drew some row twice: it got the sum, as dense.
    assert any(
        len(w["rows"]) < w["reads"]
        for r in sparse
        for k, w in r.items()
        if k.endswith("4 particles")
    )


def plates_full_block(x: torch.Tensor) -> pyro.plate:
    return pyro.plate("data", len(x), subsample_size=len(x) // pd.world_size())


def full_block_model(x: torch.Tensor) -> None:
    mu = pyro.sample("mu", pyro.distributions.Normal(0.0, 5.0).expand([D]).to_event(1))
    with plates_full_block(x) as idx:
        z = pyro.sample("z", pyro.distributions.Normal(mu, 1.0).to_event(1))
        pyro.sample("x", pyro.distributions.Normal(z, 0.5).to_event(1), obs=x[idx])


def train(mode: str, optim_name: str, guide_name: str, size: int = N) -> dict[str, Any]:
    pyro.clear_param_store()
    pd.set_rng_seed(0)
    x = data(size)
    if guide_name == "delta-full":
        chosen_model: Any = full_block_model
        chosen: Any = AutoDelta(
            full_block_model, create_plates=plates_full_block, init_loc_fn=init_to_mean
        )
    else:
        chosen_model = model
        chosen = AutoNormal(model, create_plates=plates) if guide_name == "auto" else guide
    optim = pd.DistributedOptimizer({**OPTIMIZERS, **BESIDES}[optim_name]())
    svi = SVI(chosen_model, chosen, optim, Trace_ELBO(num_particles=2))
    for _ in range(STEPS):
        with pd.shard_subsamples(own_local_params=True, local_updates=mode):
            svi.step(x)
        if optim_name == "sgd-steplr":
            optim.step()  # the scheduler: the sparse step must use its learning rate
    store = pyro.get_param_store()
    return {
        "values": {name: value.detach().clone() for name, value in store.named_parameters()},
        "local": sorted(pd.local.registry.local_params()),
        "optim": optim.get_state(),
    }


@pytest.mark.parametrize(
    ("workers", "optim_name"),
    [(1, "sgd"), (2, "sgd"), (3, "sgd"), (2, "sgd-steplr"), (2, "sgd-clip")],
)
@pytest.mark.slow
def test_plain_sgd_is_bitwise_the_dense_step(workers: int, optim_name: str) -> None:
    """SGD moves no row without gradient, so lazy and dense are the same numbers:
    this pins the row gradients (two particles, AutoNormal) and their 1/W, and
    that schedulers and clip_args act on the sparse step as on the dense one."""
    dense = run_workers(train, "dense", optim_name, "auto", world_size=workers)
    sparse = run_workers(train, "sparse", optim_name, "auto", world_size=workers)
    for mine, reference in zip(sparse, dense, strict=True):
        assert mine["local"] == ["AutoNormal.locs.z", "AutoNormal.scales.z"]
        assert_same_state(mine["values"], reference["values"])


@pytest.mark.parametrize("workers", [2, 3])
def test_adam_on_every_row_of_the_block_is_bitwise_the_dense_step(workers: int) -> None:
    """With the batch the whole block, every row is in every step: lazy is dense."""
    dense = run_workers(train, "dense", "adam", "delta-full", 42, world_size=workers)
    sparse = run_workers(train, "sparse", "adam", "delta-full", 42, world_size=workers)
    for mine, reference in zip(sparse, dense, strict=True):
        assert mine["local"] == ["AutoDelta.z"]
        assert_same_state(mine["values"], reference["values"])
        assert_same_state(mine["optim"], reference["optim"])


# ---------------------------------------------------------------------------
# Checkpoints, elastic re-partitioning, gather_param and local_rows.


def _sparse_run(steps: int) -> tuple[SVI, pd.DistributedOptimizer, torch.Tensor]:
    pd.set_rng_seed(5)
    x = data()
    with pd.shard_subsamples(own_local_params=True, local_updates="sparse"):
        guide(x)  # create the parameters before a checkpoint is loaded
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    return SVI(model, guide, optim, Trace_ELBO()), optim, x


def _train(svi: SVI, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        with pd.shard_subsamples(own_local_params=True, local_updates="sparse"):
            svi.step(x)


def _snapshot(optim: pd.DistributedOptimizer) -> dict[str, Any]:
    store = pyro.get_param_store()
    return {
        "values": {name: value.detach().clone() for name, value in store.named_parameters()},
        "optim": optim.get_state(),
        "gathered": {name: pd.gather_param(name, to="all") for name in LOCAL},
        "rows": {name: pd.local_rows(name)[0] for name in LOCAL},
    }


def straight(path: str) -> dict[str, Any]:
    svi, optim, x = _sparse_run(0)
    _train(svi, x, 4)
    pd.save_checkpoint(path, optim)
    saved = _snapshot(optim)
    _train(svi, x, 4)
    return {"saved": saved, "end": _snapshot(optim)}


def resumed(path: str, steps: int) -> dict[str, Any]:
    svi, optim, x = _sparse_run(0)
    start = pd.load_checkpoint(path, optim)
    loaded = {name: pd.gather_param(name, to="all") for name in LOCAL}
    _train(svi, x, steps)
    return {"start": start, "loaded": loaded, "end": _snapshot(optim)}


@pytest.mark.slow
def test_checkpoints_resume_bitwise_and_repartition(tmp_path: Path) -> None:
    path = str(tmp_path / "run.pt")
    uninterrupted = run_workers(straight, path)
    again = run_workers(resumed, path, 4)
    for rank in range(2):
        assert again[rank]["start"] == 4
        assert_same_state(again[rank]["end"], uninterrupted[rank]["end"], f"worker {rank}")
    saved = uninterrupted[0]["saved"]
    state = saved["optim"]["z_loc"]["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, "dense Adam's state format"
    assert state["exp_avg"].shape == (N // 2, D), "full-block moments"
    for workers in (3, 1):
        elastic = run_workers(resumed, path, 2, world_size=workers)
        for rank, worker in enumerate(elastic):
            for name in LOCAL:
                assert torch.equal(worker["loaded"][name], saved["gathered"][name])
                rows = range(rank * N // workers, (rank + 1) * N // workers)
                assert worker["end"]["rows"][name].tolist() == list(rows)
                moments = worker["end"]["optim"][name]["state"][0]
                assert moments["exp_avg"].shape == (len(rows), D)
                assert int(moments["step"]) == 6


# ---------------------------------------------------------------------------
# NaN on one worker, bytes sent, misuse.


def nan_on_worker_1() -> dict[str, Any]:
    pd.set_rng_seed(0)
    x = data()
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    svi = SVI(model, guide, optim, Trace_ELBO())
    _train(svi, x, 2)
    store = pyro.get_param_store()
    before = {name: value.detach().clone() for name, value in store.named_parameters()}
    with (
        pd.shard_subsamples(own_local_params=True, local_updates="sparse"),
        poutine.trace(param_only=True) as capture,
    ):
        Trace_ELBO().loss_and_grads(model, guide, x)
    if pd.rank() == 1:
        sparse_local.pending_reads("z_scale")[0][1].grad[0, 0] = math.nan
    params = {site["value"].unconstrained() for site in capture.trace.nodes.values()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optim(params)
    pyro.infer.util.zero_grads(params)
    after = {name: value.detach().clone() for name, value in store.named_parameters()}
    _train(svi, x, 1)  # and the next step goes on
    return {
        "warnings": [str(w.message) for w in caught],
        "unchanged": all(torch.equal(after[name], before[name]) for name in before),
        "finite": all(bool(torch.isfinite(v).all()) for _, v in store.named_parameters()),
    }


def test_a_nan_in_one_workers_rows_skips_the_step_on_every_worker() -> None:
    results = run_workers(nan_on_worker_1)
    for result in results:
        assert result["unchanged"] and result["finite"]
        assert any("every worker skips this step" in w for w in result["warnings"])
    assert any("'z_scale'" in w for w in results[1]["warnings"]), "named where it arose"


def bytes_sent(size: int, mode: str) -> int:
    engine = CountingEngine(pd.current_engine())
    pd.set_rng_seed(0)
    x = data(size)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), engine=engine)
    svi = SVI(model, guide, optim, Trace_ELBO())
    sent = []
    for _ in range(4):
        engine.bytes = 0
        with pd.shard_subsamples(own_local_params=True, local_updates=mode):
            svi.step(x)
        sent.append(engine.bytes)
    return sent[-1]


@pytest.mark.slow
def test_bytes_sent_per_step_are_the_dense_steps_and_do_not_grow_with_n() -> None:
    dense = run_workers(bytes_sent, 100, "dense")
    small = run_workers(bytes_sent, 100, "sparse")
    large = run_workers(bytes_sent, 10_000, "sparse")
    assert small == large == dense
    assert 0 < small[0] < 1000


def refused(optim_name: str) -> str:
    optimizers = {
        "rmsprop": lambda: pyro.optim.RMSprop({"lr": 0.01}),
        "amsgrad": lambda: pyro.optim.Adam({"lr": 0.01, "amsgrad": True}),
        "dampening": lambda: pyro.optim.SGD({"lr": 0.01, "momentum": 0.9, "dampening": 0.1}),
    }
    optim = pd.DistributedOptimizer(optimizers[optim_name]())
    svi = SVI(model, guide, optim, Trace_ELBO())
    before = pyro.param("mu_loc", torch.zeros(D)).detach().clone()
    with pytest.raises(ValueError) as error:
        _train(svi, data(), 1)
    assert torch.equal(pyro.param("mu_loc").detach(), before), "refused before any step"
    return str(error.value)


@pytest.mark.slow
def test_optimizers_without_a_lazy_rule_are_refused_by_name() -> None:
    rmsprop, amsgrad, dampening = (
        run_workers(refused, name)[1] for name in ("rmsprop", "amsgrad", "dampening")
    )
    assert "no lazy rule for the optimizer RMSprop" in rmsprop
    assert "use local_updates='dense' for RMSprop" in rmsprop
    assert "does not implement Adam with amsgrad" in amsgrad
    assert "does not implement SGD with dampening=0.1" in dampening


def test_bad_local_updates_are_named() -> None:
    with pytest.raises(TypeError, match="local_updates must be 'dense' or 'sparse', got bool"):
        pd.shard_subsamples(own_local_params=True, local_updates=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 'foo'"):
        pd.shard_subsamples(own_local_params=True, local_updates="foo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_updates='sparse' needs own_local_params=True"):
        pd.shard_subsamples(by_block=True, local_updates="sparse")
    assert pd.shard_subsamples(own_local_params=True).local_updates == "dense"


def test_rows_drawn_in_o_batch_are_distinct_and_uniform() -> None:
    """The sparse mode's draw (rejecting repeats) against the uniform law.

    640 rows, 10 per draw: about one draw in 13 repeats a row in its first
    round and goes through the rejection loop. Each row is expected 100
    times in 6,400 draws; the chi-square statistic over 639 degrees of
    freedom has mean 639 and standard deviation 35.7 (a fixed seed: the
    bounds of 5 deviations are not a coin toss).
    """
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(640)
    first = torch.zeros(640)
    for _ in range(6400):
        rows = sparse_local.draw_rows(640, 10, generator)
        assert len(rows) == 10 and len(torch.unique(rows)) == 10
        assert int(rows.min()) >= 0 and int(rows.max()) < 640
        counts += torch.bincount(rows, minlength=640)
        first[rows[0]] += 1
    chi_square = float(((counts - 100) ** 2 / 100).sum())
    assert 639 - 5 * 35.7 < chi_square < 639 + 5 * 35.7
    # The order is random too: the first row drawn is any row alike (10 expected each).
    chi_first = float(((first - 10) ** 2 / 10).sum())
    assert 639 - 5 * 35.7 < chi_first < 639 + 5 * 35.7
    # A whole block (or most of it) is a permutation, as the dense mode draws.
    whole = sparse_local.draw_rows(20, 20, torch.Generator().manual_seed(1))
    assert torch.equal(whole, torch.randperm(20, generator=torch.Generator().manual_seed(1)))
