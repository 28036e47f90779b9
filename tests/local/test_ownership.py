"""Local parameters owned by their worker: the replicated path's numbers, bitwise.

Each scenario trains twice from the same seeds, drawing the same per-block
subsamples: once with every row on every worker (``by_block=True``, averaged
as always) and once with ownership (``own_local_params=True``). Global
parameters must end bitwise equal, and each worker's local rows bitwise
equal to the same rows of the replicated run.

Both runs use one bucket per parameter and no overlap, so that the global
parameters travel in identical buffers: gloo's ring sums a buffer's segments
in different orders, so at W=3 a float's place in the buffer can change its
last bit, and only the local parameters may differ between the two runs.
"""

from __future__ import annotations

from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_distributed as pd

from ..support.harness import CountingEngine, run_workers, with_engines
from ..support.ownership import BATCH, D, N, data, gathered_and_local_rows, guide, model, train

LOCAL = {
    "hand": ("z_loc", "z_scale"),
    "auto": ("AutoNormal.locs.z", "AutoNormal.scales.z"),
    "delta": ("AutoDelta.z",),
}


@pytest.mark.parametrize(
    ("engine", "workers", "optim_name", "guide_name"),
    with_engines(
        [
            (workers, *run)
            for workers in (2, 3)
            for run in [("adam", "hand"), ("clipped", "auto"), ("adam", "delta")]
        ],
        on_mpi=[(3, "clipped", "auto")],
    ),
)
@pytest.mark.slow
def test_ownership_changes_where_rows_live_not_the_numbers(
    engine: str, workers: int, optim_name: str, guide_name: str
) -> None:
    runs = {"world_size": workers, "engine": engine}
    replicated = run_workers(train, False, optim_name, guide_name, **runs)
    owned = run_workers(train, True, optim_name, guide_name, **runs)
    local_names = LOCAL[guide_name]
    for rank, (mine, reference) in enumerate(zip(owned, replicated, strict=True)):
        assert set(mine["local"]) == set(local_names)
        for name, value in reference["values"].items():
            if name in local_names:
                indices, rows = mine["local"][name]
                assert indices.tolist() == list(
                    range(rank * N // workers, (rank + 1) * N // workers)
                )
                # Stored unconstrained rows, and the constrained rows read back.
                assert torch.equal(
                    mine["values"][name], _unconstrained_rows(reference, name, indices)
                )
                assert rows.shape == (len(indices), D)
            else:
                assert torch.equal(mine["values"][name], value), f"global {name!r}, worker {rank}"


def _unconstrained_rows(result: dict[str, Any], name: str, indices: torch.Tensor) -> torch.Tensor:
    return result["values"][name].index_select(0, indices)


def test_memory_per_worker_is_the_blocks_share() -> None:
    (alone,) = run_workers(train, False, "adam", "hand", 4000, world_size=1)
    owned = run_workers(train, True, "adam", "hand", 4000, world_size=2)
    replicated = run_workers(train, False, "adam", "hand", 4000, world_size=2)
    for worker in owned:
        assert worker["bytes"] <= 0.55 * alone["bytes"]
    assert replicated[0]["bytes"] == alone["bytes"]


def bytes_sent(size: int) -> int:
    engine = CountingEngine(pd.current_engine())
    pd.set_rng_seed(0)
    x = data(size)
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}), engine=engine)
    svi = SVI(model, guide, optim, Trace_ELBO())
    sent = []
    for _ in range(4):
        engine.bytes = 0
        with pd.shard_subsamples(own_local_params=True):
            svi.step(x)
        sent.append(engine.bytes)
    return sent[-1]


def test_bytes_sent_per_step_do_not_grow_with_n() -> None:
    small = run_workers(bytes_sent, 100)
    large = run_workers(bytes_sent, 10_000)
    assert small == large
    assert 0 < small[0] < 1000


@pytest.mark.parametrize(("engine", "workers"), with_engines([2, 3], on_mpi=[2]))
def test_gather_param_assembles_the_rows_in_order_on_worker_0(engine: str, workers: int) -> None:
    replicated = run_workers(train, False, "adam", "hand", world_size=workers, engine=engine)
    results = run_workers(gathered_and_local_rows, world_size=workers, engine=engine)
    # z_loc is unconstrained, so the stored values are the ones gather_param returns.
    reference = replicated[0]["values"]["z_loc"]
    assert torch.equal(results[0]["gathered"], reference)
    assert all(result["gathered"] is None for result in results[1:])
    assert all(torch.equal(result["everywhere"], reference) for result in results)
    assert torch.equal(results[0]["global"], replicated[0]["values"]["mu_loc"])
    together = torch.cat([result["local"][0] for result in results])
    assert together.tolist() == list(range(N)), "blocks in order, every row once"


def block_sampler_epochs() -> list[list[int]]:
    sampler = pd.ShardSampler(range(N), by_block=True, seed=1)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    return epochs


def test_block_sampler_keeps_each_workers_block_and_shuffles_inside_it() -> None:
    first, second = run_workers(block_sampler_epochs)
    for rank, epochs in enumerate((first, second)):
        block = set(range(rank * N // 2, (rank + 1) * N // 2))
        for epoch in epochs:
            assert len(epoch) == N // 2 and set(epoch) <= block
        assert epochs[0] != epochs[1], "a new order inside the block each epoch"


def misuse(case: str) -> str:
    x = data()
    with pytest.raises((ValueError, pd.PyroDistributedError)) as error:
        if case == "init":

            def bad_guide(x: torch.Tensor) -> None:
                with pyro.plate("data", len(x), subsample_size=BATCH):
                    pyro.param("z_loc", torch.zeros(len(x) + 1, D), event_dim=1)

            with pd.shard_subsamples(own_local_params=True):
                bad_guide(x)
        elif case == "outside":
            with pd.shard_subsamples(own_local_params=True):
                guide(x)
                pyro.param("z_loc")
        elif case == "index":
            indices = torch.tensor([0, N - 1])
            with (
                pd.shard_subsamples(own_local_params=True),
                pyro.plate("data", N, subsample=indices),
            ):
                pass
        elif case == "size":
            size = N + pd.rank()  # the plate's size differs on worker 1
            optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))
            svi = SVI(model, guide, optim, Trace_ELBO())
            with pd.shard_subsamples(own_local_params=True):
                svi.step(data(size))
    return str(error.value)


def test_misuse_is_named() -> None:
    init, outside, index, size = (
        run_workers(misuse, case)[1] for case in ("init", "outside", "index", "size")
    )
    assert "local parameter 'z_loc' has 42 rows along plate 'data'" in init
    assert "needs the plate's size 41, or worker 1's block of 21 rows" in init
    assert "local parameter 'z_loc' of plate 'data' is used outside that plate" in outside
    assert "plate 'data': subsample index 0 lies outside worker 1's block [20, 41)" in index
    assert "workers disagree on local parameter" in size
    assert "worker 0: plate 'data' of size 41; worker 1: plate 'data' of size 42" in size


def drift_check() -> dict[str, str | None]:
    train(True, "adam", "hand")
    optim = pd.DistributedOptimizer(pyro.optim.Adam({"lr": 0.05}))
    pd.assert_in_sync()  # local rows differ by design, and are skipped
    outcome: dict[str, str | None] = {"local rows": None}
    if pd.rank() == 1:
        with torch.no_grad():
            pyro.param("mu_loc").unconstrained().add_(1.0)
    with pytest.raises(pd.PyroDistributedError) as error:
        pd.assert_in_sync(optim)
    outcome["global drift"] = str(error.value)
    return outcome


def test_assert_in_sync_skips_local_rows_but_checks_global_parameters() -> None:
    for result in run_workers(drift_check):
        assert "parameter 'mu_loc' differs" in str(result["global drift"])


def owned_then_replicated() -> dict[str, Any]:
    train(True, "adam", "hand")
    pyro.clear_param_store()  # the same names, new parameters: no longer local
    return train(False, "adam", "hand")


def test_a_recreated_parameter_is_no_longer_local() -> None:
    fresh = run_workers(train, False, "adam", "hand")
    again = run_workers(owned_then_replicated)
    for rank in range(2):
        assert again[rank]["local"] == {}
        for name, value in fresh[rank]["values"].items():
            assert torch.equal(again[rank]["values"][name], value), name
